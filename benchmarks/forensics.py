"""Forensics at scale: load a 10,000,000-record trace into DuckDB (records, miss attribution,
cache entries) and run checkpoint_pushouts, beside DuckDB's own ingest of the same number of rows.

The trace comes from a small free-queue simulation on the default model's geometry (Kimi-K3:
384-token blocks, one MLA and three KDA groups; a pool of 4,096 blocks, zipf-popular system
prompts, one published transient checkpoint per request in each KDA group), so evictions, hits
and pushouts are all present. It is generated once, in a child process, and cached beside the
output (``--trace``).

Each repeat runs, in fresh child processes (so that each one's peak memory is its own):

* the anchor: DuckDB ingesting numpy columns into a database file (six int64 columns of as many
  rows as the trace has records, CHECKPOINT included): what loading that many rows costs at
  least;
* kvtrace: ``load_traces`` (one pass: records, attribution, cache entries) then
  ``checkpoint_pushouts``, with the child's peak RSS.

It prints each repeat (wall seconds, and the CPU seconds of all the child's threads, which other
jobs on a shared machine move less), the median with the range of the three, the ratio
kvtrace / anchor per repeat, and the machine's load average. Targets (issue "Forensics at the
speed of DuckDB", on 10 M records): load + attribution + checkpoint_pushouts <= 5 s, peak RSS
<= 1 GiB, ratio <= 3x. A 100 M-record trace: ``--events 100000000 --no-anchor``. The load's
own peak RSS is printed too; ``--load-memory-limit 128MB`` lowers DuckDB's share of it (its
buffers while loading) to show that the rest does not grow with the trace's length;
``--spill-only`` runs the C core's pass alone, without DuckDB, and prints its spill file's size.

    .venv/bin/python benchmarks/forensics.py [--events 10000000] [--trace PATH] [--repeats 3]
        [--no-anchor] [--load-memory-limit SIZE] [--spill-only]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict

POOL_BLOCKS = 4096
SYSTEM_PROMPTS = 256
ANCHOR_COLUMNS = 6


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


def anchor(db_path: str, num_rows: int) -> dict:
    """DuckDB's own ingest: six int64 numpy columns into a database file."""
    import duckdb
    import numpy as np

    rng = np.random.default_rng(0)
    columns = {f"c{i}": rng.integers(0, 1 << 20, num_rows, dtype=np.int64)
               for i in range(ANCHOR_COLUMNS)}
    started, cpu = time.perf_counter(), time.process_time()
    connection = duckdb.connect(db_path)
    connection.register("columns", columns)
    connection.execute("CREATE TABLE anchor AS SELECT * FROM columns")
    connection.execute("CHECKPOINT")
    connection.close()
    return {"seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu}


def forensics(trace: str, db_path: str, memory_limit: str) -> dict:
    """kvtrace's load (records, attribution, cache entries; DuckDB's buffers limited to
    ``memory_limit``, or kvtrace's own limit if empty) and checkpoint_pushouts."""
    from kvtrace.analysis import load
    from kvtrace.analysis.database import open_database
    from kvtrace.analysis.load import load_traces
    from kvtrace.analysis.queries import run_query

    load.LOAD_MEMORY_LIMIT = memory_limit or load.LOAD_MEMORY_LIMIT
    started, cpu = time.perf_counter(), time.process_time()
    summary = load_traces([trace], db_path)
    loaded = time.perf_counter()
    load_rss_mib = peak_rss_mib()
    connection = open_database(db_path)
    result = run_query(connection, "checkpoint_pushouts")
    queried, cpu = time.perf_counter(), time.process_time() - cpu
    lookups = connection.execute("SELECT count(DISTINCT seq) FROM miss_attribution").fetchone()[0]
    connection.close()
    return {"records": summary.num_records, "load": loaded - started,
            "query": queried - loaded, "seconds": queried - started, "cpu": cpu,
            "pushouts": len(result.rows), "load_rss_mib": load_rss_mib,
            "regret": sum(row[-1] for row in result.rows), "lookups": lookups,
            "db_mib": os.path.getsize(db_path) / 2**20}


def streaming_pass(trace: str) -> dict:
    """The load's pass alone (the C core: records' rows, attribution, cache entries, taken and
    dropped; no DuckDB), spilling beside the trace: its time and its spill file's size."""
    from kvtrace.analysis import stream
    from kvtrace.traceio import TraceReader

    started, cpu = time.perf_counter(), time.process_time()
    reader = TraceReader(trace)
    analysis = stream.new_pass(reader.header, trace, spill_dir=os.path.dirname(trace) or ".")
    for batch in reader.batches():
        analysis.feed(batch)
        analysis.take_tables(1 << 16)
    analysis.finish()
    analysis.take_tables(0)
    spill_bytes, trims = analysis.core.spill
    return {"seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu,
            "spill_mib": spill_bytes / 2**20, "trims": trims}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def in_child(work: str, *args: str) -> dict:
    """Run ``work`` (anchor, forensics or pass) in a fresh interpreter: its figures and peak
    RSS."""
    output = subprocess.run([sys.executable, __file__, "--child", work, *args], check=True,
                            stdout=subprocess.PIPE, text=True).stdout
    return json.loads(output.splitlines()[-1])


def spread(values: list[float], unit: str = "s") -> str:
    return (f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--trace", help="trace path (generated if missing)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-anchor", action="store_true", help="skip DuckDB's own ingest")
    parser.add_argument("--load-memory-limit", default="",
                        help="DuckDB's memory_limit while loading (default: kvtrace's)")
    parser.add_argument("--spill-only", action="store_true",
                        help="only the C core's pass, without DuckDB: its spill file and RSS")
    parser.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        work, *rest = args.child
        figures = (anchor(rest[0], int(rest[1])) if work == "anchor"
                   else streaming_pass(rest[0]) if work == "pass" else forensics(*rest))
        figures["rss_mib"] = peak_rss_mib()
        print(json.dumps(figures))
        return 0
    trace = args.trace or os.path.join(tempfile.gettempdir(),
                                       f"kvtrace-bench-{args.events}-kimi-k3-v2.kvtrace")
    if args.generate_only:
        generate(trace, args.events)
        return 0
    if not os.path.exists(trace):
        started = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--events", str(args.events), "--trace", trace,
                        "--generate-only"], check=True)
        print(f"generated {trace} in {time.perf_counter() - started:.1f} s")
    if args.spill_only:
        for repeat in range(args.repeats):
            figures = in_child("pass", trace)
            print(f"repeat {repeat + 1}: the pass alone {figures['seconds']:.2f} s (CPU "
                  f"{figures['cpu']:.2f} s), peak RSS {figures['rss_mib']:.0f} MiB; spill file "
                  f"{figures['spill_mib']:.0f} MiB, trimmed {figures['trims']} times", flush=True)
        return 0
    num_records = _records(trace)
    runs: list[tuple[dict | None, dict]] = []
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(trace))) as scratch:
        for repeat in range(args.repeats):
            load_average = os.getloadavg()[0]
            base = None
            if not args.no_anchor:
                base = in_child("anchor", os.path.join(scratch, f"anchor{repeat}.duckdb"),
                                str(num_records))
            ours = in_child("forensics", trace, os.path.join(scratch, f"trace{repeat}.duckdb"),
                            args.load_memory_limit)
            runs.append((base, ours))
            print(f"repeat {repeat + 1}: load {ours['load']:.2f} s + checkpoint_pushouts "
                  f"{ours['query']:.2f} s = {ours['seconds']:.2f} s (CPU {ours['cpu']:.2f} s), "
                  f"peak RSS {ours['rss_mib']:.0f} MiB (load {ours['load_rss_mib']:.0f} MiB)"
                  + (f"; anchor {base['seconds']:.2f} s (CPU {base['cpu']:.2f} s, peak RSS "
                     f"{base['rss_mib']:.0f} MiB), ratio {ours['seconds'] / base['seconds']:.2f}x"
                     f" (CPU {ours['cpu'] / base['cpu']:.2f}x)" if base else "")
                  + f"; load average {load_average:.2f}", flush=True)
    ours = runs[-1][1]
    print(f"{ours['records']:,} records ({os.path.getsize(trace) / 2**20:.0f} MiB trace, "
          f"{ours['db_mib']:.0f} MiB database), {ours['lookups']:,} admitted lookups, "
          f"{ours['pushouts']:,} pushouts, regret {ours['regret']:,} tokens")
    totals = [r[1]["seconds"] for r in runs]
    print(f"load {spread([r[1]['load'] for r in runs])}, checkpoint_pushouts "
          f"{spread([r[1]['query'] for r in runs])}, total {spread(totals)} (CPU "
          f"{spread([r[1]['cpu'] for r in runs])}), peak RSS "
          f"{spread([r[1]['rss_mib'] for r in runs], ' MiB')} (load "
          f"{spread([r[1]['load_rss_mib'] for r in runs], ' MiB')})")
    if not args.no_anchor:
        print(f"anchor (DuckDB, {ANCHOR_COLUMNS} int64 columns x {ours['records']:,} rows) "
              f"{spread([r[0]['seconds'] for r in runs])} (CPU "
              f"{spread([r[0]['cpu'] for r in runs])}); ratio "
              f"{spread([r[1]['seconds'] / r[0]['seconds'] for r in runs], 'x')} (CPU "
              f"{spread([r[1]['cpu'] / r[0]['cpu'] for r in runs], 'x')})")
    return 0


def _records(trace: str) -> int:
    """The trace's number of records."""
    from kvtrace.traceio import TraceReader

    reader = TraceReader(trace)
    for _ in reader.batches():
        pass
    return reader.num_records


if __name__ == "__main__":
    sys.exit(main())
