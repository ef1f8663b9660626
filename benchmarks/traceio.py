"""Trace writer/reader throughput and size: 1,000,000 effect records.

Targets (issue "Foundation"): writer >= 1,000,000 records/s, reader >= 1,000,000 records/s,
<= 24 bytes per effect record. A baseline in the same run - msgspec encoding and decoding each
record on its own (array_like, the fastest per-record form) - puts the numbers in proportion on a
noisy machine.

    .venv/bin/python benchmarks/traceio.py [--records N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import msgspec

from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockTouched,
    EngineConfig,
    KVCacheGroup,
    RemoveReason,
    StoreKind,
    TraceHeader,
)
from kvtrace.traceio import TraceReader, TraceWriter


def effect_records(n: int, seed: int = 0) -> list:
    """A cache's effects at scale: 40,000 blocks, 2M distinct hashes, 4,000 live requests."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        block, req = rng.randrange(40_000), rng.randrange(4_000)
        kind = i % 5
        if kind == 0:
            records.append(BlockAllocated(block, req))
        elif kind == 1:
            records.append(BlockStored(block, rng.randrange(2_000_000), rng.randrange(2),
                                       16 * rng.randrange(1, 512), StoreKind.FULL, req))
        elif kind == 2:
            records.append(BlockTouched(block, req))
        elif kind == 3:
            records.append(BlockFreed(block, rng.randrange(3), rng.random() < 0.7))
        else:
            records.append(BlockRemoved(block, rng.randrange(2_000_000), rng.randrange(2),
                                        16 * rng.randrange(1, 512), RemoveReason.LRU_REUSE))
    return records


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = args.records
    records = effect_records(n)
    header = TraceHeader(kvtrace_version="bench", created_ns=time.time_ns(), source="test",
                         config=EngineConfig(kv_cache_groups=[KVCacheGroup(kind="full_attention", block_size=16)],
                                             hash_block_size=16, num_gpu_blocks=40_000))
    path = os.path.join(tempfile.mkdtemp(), "bench.kvtrace")

    rows_path = path + ".rows"

    def write(rows: bool = False) -> None:
        with TraceWriter(rows_path if rows else path, header, rows=rows) as writer:
            for record in records:
                writer.write(record)

    def read_rows() -> None:
        assert sum(1 for _ in TraceReader(rows_path)) == n

    def read_columns() -> None:
        assert sum(len(batch) for batch in TraceReader(path).batches()) == n

    def read_records() -> None:
        count = 0
        for _ in TraceReader(path):
            count += 1
        assert count == n

    encoder = msgspec.msgpack.Encoder()
    encoded: list[bytes] = []

    def baseline_encode() -> None:
        encoded[:] = [encoder.encode(r) for r in records]

    decoders = {type(r): msgspec.msgpack.Decoder(type(r)) for r in records[:5]}
    kinds = [type(r) for r in records]

    def baseline_decode() -> None:
        for kind, data in zip(kinds, encoded):
            decoders[kind].decode(data)

    results = {
        "records": n,
        "write_s": best_of(args.repeats, write),
        "read_columns_s": best_of(args.repeats, read_columns),
        "read_records_s": best_of(args.repeats, read_records),
        "write_rows_s": best_of(args.repeats, lambda: write(rows=True)),
        "read_rows_s": best_of(args.repeats, read_rows),
        "baseline_encode_s": best_of(args.repeats, baseline_encode),
        "baseline_decode_s": best_of(args.repeats, baseline_decode),
        "bytes_per_record": os.path.getsize(path) / n,
        "rows_bytes_per_record": os.path.getsize(rows_path) / n,
        "baseline_bytes_per_record": sum(map(len, encoded)) / n,
    }
    rates = {key.replace("_s", "_per_s"): n / value for key, value in results.items() if key.endswith("_s")}
    results.update(rates)
    checks = {
        "writer >= 1M records/s": rates["write_per_s"] >= 1e6,
        "reader (records) >= 1M records/s": rates["read_records_per_s"] >= 1e6,
        "<= 24 bytes per effect record": results["bytes_per_record"] <= 24,
    }
    results["targets_met"] = all(checks.values())
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{n:,} effect records (best of {args.repeats})")
        print(f"  write               {rates['write_per_s'] / 1e6:6.2f} M records/s   "
              f"(msgspec per-record encode baseline {rates['baseline_encode_per_s'] / 1e6:.2f} M/s, "
              f"ratio {rates['write_per_s'] / rates['baseline_encode_per_s']:.2f})")
        print(f"  read as records     {rates['read_records_per_s'] / 1e6:6.2f} M records/s   "
              f"(msgspec per-record decode baseline {rates['baseline_decode_per_s'] / 1e6:.2f} M/s, "
              f"ratio {rates['read_records_per_s'] / rates['baseline_decode_per_s']:.2f})")
        print(f"  read as columns     {rates['read_columns_per_s'] / 1e6:6.2f} M records/s")
        print(f"  row batches (what a live capture writes): write "
              f"{rates['write_rows_per_s'] / 1e6:.2f} M records/s, read "
              f"{rates['read_rows_per_s'] / 1e6:.2f} M records/s, "
              f"{results['rows_bytes_per_record']:.2f} bytes/record")
        print(f"  size                {results['bytes_per_record']:6.2f} bytes/record   "
              f"(per-record msgpack {results['baseline_bytes_per_record']:.2f})")
        for name, ok in checks.items():
            print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return 0 if results["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
