"""Per-call cost of kvtrace's probes on the real vLLM 0.33.0 cache (CPU).

Drives the same schedule (synthetic chats sharing system prompts, chunked prefill, decode)
through the vLLM backend twice - probes disarmed, then armed with a list-append sink - and
divides the extra time by the number of wrapped calls (counted in a third, counting run).
Target: a few hundred ns of kvtrace's own work per wrapped call.

    .venv/bin/python benchmarks/probe_overhead.py [--requests 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from vllm_support import seed_config  # noqa: E402

from kvtrace.probes import cache_probes  # noqa: E402


def schedule(backend, num_requests: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    systems = [list(range(10_000 * s, 10_000 * s + 32)) for s in range(4)]
    next_id = 1_000_000
    for req in range(num_requests):
        own = list(range(next_id, next_id + rng.randint(2, 12)))
        next_id += len(own)
        hash_ids = rng.choice(systems) + own
        backend.add_request(req, len(hash_ids) * 16 + 7, hash_ids, 8)
    step = 0
    waiting, running = list(range(num_requests)), []
    while waiting or running:
        backend.new_step(step, step)
        budget = 2048
        for req in list(running):
            request = backend.request(req)
            num_new = min(512, request.num_tokens - request.num_computed_tokens, budget)
            if not backend.allocate_slots(req, num_new):
                running.remove(req)
                backend.preempt(req)
                waiting.insert(0, req)
                continue
            budget -= num_new
            backend.advance(req, num_new)
            if request.num_output_tokens >= 8:
                running.remove(req)
                backend.free(req)
        while waiting and budget > 0 and len(running) < 32:
            req = waiting[0]
            num_hit, _ = backend.get_computed_blocks(req)
            request = backend.request(req)
            num_new = min(512, request.num_tokens - num_hit, budget)
            if not backend.allocate_slots(req, num_new, num_hit):
                break
            waiting.pop(0)
            running.append(req)
            budget -= num_new
            backend.advance(req, num_new)
        step += 1


def timed_run(backend_class, num_requests: int, armed: bool) -> tuple[float, int]:
    records = []
    backend = backend_class(seed_config(0, num_gpu_blocks=2048), "fixed", records.append)
    if not armed:
        backend.close()
    start = time.perf_counter()
    schedule(backend, num_requests)
    elapsed = time.perf_counter() - start
    backend.close()
    return elapsed, len(records)


def count_wrapped_calls(backend_class, num_requests: int) -> int:
    """Run once with every probe handler counting its calls (patches bind handlers at arm)."""
    calls = 0
    handlers = {name: function for name, function in vars(cache_probes.CacheProbes).items()
                if name.startswith("_on_")}

    def counting(function):
        def handler(*args, **kwargs):
            nonlocal calls
            calls += 1
            return function(*args, **kwargs)
        return handler

    for name, function in handlers.items():
        setattr(cache_probes.CacheProbes, name, counting(function))
    try:
        timed_run(backend_class, num_requests, armed=True)
    finally:
        for name, function in handlers.items():
            setattr(cache_probes.CacheProbes, name, function)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from kvtrace.replay.vllm_backend import VllmBackend

    timed_run(VllmBackend, 20, armed=True)  # warm up imports and caches
    calls = count_wrapped_calls(VllmBackend, args.requests)
    bare = min(timed_run(VllmBackend, args.requests, False)[0] for _ in range(args.repeats))
    probed_runs = [timed_run(VllmBackend, args.requests, True) for _ in range(args.repeats)]
    probed = min(elapsed for elapsed, _ in probed_runs)
    num_records = probed_runs[0][1]
    print(f"requests {args.requests}: {calls} wrapped calls, {num_records} records")
    print(f"unprobed {bare * 1e3:.1f} ms, probed {probed * 1e3:.1f} ms")
    print(f"overhead {(probed - bare) / calls * 1e9:.0f} ns per wrapped call, "
          f"{(probed - bare) / num_records * 1e9:.0f} ns per record")


if __name__ == "__main__":
    main()
