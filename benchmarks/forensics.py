"""Forensics at scale: load a 10,000,000-event trace into DuckDB and run checkpoint_pushouts.

The trace comes from a small free-queue simulation on the default model's geometry (Kimi-K3:
384-token blocks, one MLA and three KDA groups; a pool of 4,096 blocks, zipf-popular system
prompts, one published transient checkpoint per request in each KDA group), so evictions, hits and pushouts are
all present. It is generated once, in a child process (so that its memory does
not count), and cached beside the output. Target: load + query <= 30 s on 2 cores.

    .venv/bin/python benchmarks/forensics.py [--events 10000000] [--trace PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict

POOL_BLOCKS = 4096
SYSTEM_PROMPTS = 256


def generate(path: str, num_events: int, seed: int = 0) -> None:
    from kvtrace.events import (BlockAllocated, BlockFreed, BlockRemoved, BlockStored,
                                BlockTouched, CheckpointClass, CheckpointRecorded,
                                ComputedBlocksFound, RemoveReason, RequestArrived,
                                RequestFinished, SlotsAllocated, StepStarted, StoreKind,
                                TraceHeader)
    from kvtrace.traceio import TraceWriter
    from kvtrace.workloads.workload import EngineShape

    shape = EngineShape()  # the default model, at its shipped deployment
    config = shape.engine_config(num_gpu_blocks=POOL_BLOCKS + 1)
    unit = shape.attention_block
    kinds = [group.kind for group in config.kv_cache_groups]
    attention = kinds.index("full_attention")
    mamba_groups = [index for index, kind in enumerate(kinds) if kind == "mamba"]
    prompt_len = 4 * unit
    header = TraceHeader(kvtrace_version="bench", created_ns=time.time_ns(), source="synth",
                         config=config)
    rng = random.Random(seed)
    free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, POOL_BLOCKS + 1))
    keys: dict[int, tuple[int, int, int]] = {}  # block -> (hash_id, group, num_tokens)
    cached: dict[tuple[int, int], int] = {}  # (hash_id, group) -> block
    next_hash = SYSTEM_PROMPTS
    lru, full, checkpoint = RemoveReason.LRU_REUSE, StoreKind.FULL, StoreKind.CHECKPOINT
    with TraceWriter(path, header, atomic=True) as writer:
        req = step = 0
        while writer.num_records + len(writer._pending) < num_events:
            step += 1
            system_prompt = int(SYSTEM_PROMPTS * rng.random() ** 3)
            units = [system_prompt, next_hash, next_hash + 1, next_hash + 2]
            next_hash += 3
            out = [StepStarted(step, step), RequestArrived(req, prompt_len, units, 1)]
            hit_block = cached.get((system_prompt, attention))
            hit = unit if hit_block is not None else 0
            out += [ComputedBlocksFound(req, hit, 0),
                    SlotsAllocated(req, prompt_len - hit, 0, hit, 0, 0, prompt_len, True)]
            if hit_block is not None:
                out.append(BlockTouched(hit_block, req))
                free_queue.pop(hit_block, None)
            blocks = []
            num_full = 4 - (1 if hit else 0)
            for _ in range(num_full + len(mamba_groups)):
                block, _ = free_queue.popitem(last=False)
                if block in keys:
                    hash_id, group, num_tokens = keys.pop(block)
                    del cached[(hash_id, group)]
                    out.append(BlockRemoved(block, hash_id, group, num_tokens, lru))
                out.append(BlockAllocated(block, req))
                blocks.append(block)
            full_blocks, checkpoint_blocks = blocks[:num_full], blocks[num_full:]
            first_unit = 0 if hit_block is None else 1
            for offset, block in enumerate(full_blocks):
                index = first_unit + offset
                keys[block] = (units[index], attention, (index + 1) * unit)
                cached[(units[index], attention)] = block
                out.append(BlockStored(block, units[index], attention, (index + 1) * unit, full,
                                       req))
            for mamba, checkpoint_block in zip(mamba_groups, checkpoint_blocks):  # every KDA group
                out.append(CheckpointRecorded(req, mamba, 2 * unit, 1, CheckpointClass.TRANSIENT))
                keys[checkpoint_block] = (units[1], mamba, 2 * unit)
                cached[(units[1], mamba)] = checkpoint_block
                out.append(BlockStored(checkpoint_block, units[1], mamba, 2 * unit, checkpoint,
                                       req))
            out.append(RequestFinished(req, 0))
            held = ([hit_block] if hit_block is not None else []) + blocks
            for block in reversed(held):  # vLLM frees a request's tail first
                out.append(BlockFreed(block, 0, True))
                free_queue[block] = None
            writer.write_many(out)
            req += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--trace", help="trace path (generated if missing)")
    parser.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    trace = args.trace or os.path.join(tempfile.gettempdir(),
                                       f"kvtrace-bench-{args.events}-kimi-k3-v2.kvtrace")
    if args.generate_only:
        generate(trace, args.events)
        return
    if not os.path.exists(trace):
        started = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--events", str(args.events), "--trace", trace,
                        "--generate-only"], check=True)
        print(f"generated {trace} in {time.perf_counter() - started:.1f} s")

    from kvtrace.analysis.database import open_database
    from kvtrace.analysis.load import load_traces
    from kvtrace.analysis.queries import run_query

    db_path = trace + ".duckdb"
    started = time.perf_counter()
    summary = load_traces([trace], db_path)
    loaded = time.perf_counter()
    connection = open_database(db_path)
    result = run_query(connection, "checkpoint_pushouts")
    queried = time.perf_counter()
    connection.close()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"records: {summary.num_records:,} ({os.path.getsize(trace) / 2**20:.0f} MiB trace, "
          f"{os.path.getsize(db_path) / 2**20:.0f} MiB DB)")
    print(f"load: {loaded - started:.1f} s ({summary.num_records / (loaded - started) / 1e6:.2f} M records/s)")
    print(f"checkpoint_pushouts: {queried - loaded:.1f} s, {len(result.rows):,} pushouts, "
          f"regret {sum(r[-1] for r in result.rows):,} tokens")
    print(f"total: {queried - started:.1f} s (target <= 30 s); peak RSS {peak_mib:.0f} MiB")


if __name__ == "__main__":
    main()
