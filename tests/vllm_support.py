"""Shared set-up for tests that drive the real vLLM 0.33.0 cache through kvtrace's backend.

The seed scenario (reference §6): hash unit 16, full attention 16, Mamba 32 ("align", one
checkpoint block, alignment 16), a 240-token prompt prefilled in chunks of 128 then 112.
"""

from __future__ import annotations

import pytest

from kvtrace.events import EngineConfig, FinishStatus, KVCacheGroup

HASH_UNIT = 16
SEED_PROMPT = 240
SEED_HASH_IDS = list(range(100, 100 + SEED_PROMPT // HASH_UNIT))  # id at 16·(i+1) tokens


def seed_hash_id(num_tokens: int) -> int:
    """The seed prompt's hash id covering its first ``num_tokens`` tokens."""
    return SEED_HASH_IDS[num_tokens // HASH_UNIT - 1]


def seed_config(retention_interval: int | None, num_gpu_blocks: int = 64) -> EngineConfig:
    return EngineConfig(
        kv_cache_groups=[
            KVCacheGroup(kind="full_attention", block_size=16),
            KVCacheGroup(kind="mamba", block_size=32, mamba_cache_mode="align",
                         num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=16),
        ],
        hash_block_size=HASH_UNIT, num_gpu_blocks=num_gpu_blocks,
        retention_interval=retention_interval)


@pytest.fixture(scope="session")
def vllm_backend_class():
    """Import vLLM once per test session (about 7 s) and hand out the backend class."""
    import vllm.v1.core.kv_cache_manager  # noqa: F401 (the slow import, paid here once)

    from kvtrace.replay.vllm_backend import VllmBackend

    return VllmBackend


def prefill_chunks(backend, req: int, chunks: list[int], first_step: int = 0) -> int:
    """Admit ``req`` (lookup + first allocation) and prefill it chunk by chunk, one step each."""
    step = first_step
    backend.new_step(step, step)
    num_hit, _ = backend.get_computed_blocks(req)
    assert backend.allocate_slots(req, chunks[0], num_hit)
    backend.advance(req, chunks[0])
    for chunk in chunks[1:]:
        step += 1
        backend.new_step(step, step)
        assert backend.allocate_slots(req, chunk)
        backend.advance(req, chunk)
    return step


def run_mixed_workload(backend, chunk: int = 64, budget: int = 160) -> None:
    """A small FCFS schedule with chunked prefill, shared prefixes, multi-turn reuse, decode
    that completes hash units, a preemption and an abort: inputs for lockstep tests."""
    system = list(range(1000, 1010))  # a 160-token shared system prompt
    specs = {
        0: (system + [1, 2, 3, 4], 6),
        1: (system + [5, 6, 7], 20),
        2: (system[:6] + [8, 9, 10, 11, 12, 13], 3),
        3: (system + [1, 2, 3, 4, 14, 15], 40),
    }
    for req, (hash_ids, max_tokens) in specs.items():
        backend.add_request(req, len(hash_ids) * HASH_UNIT + 5, hash_ids, max_tokens)
    waiting, running, generated = list(specs), [], {req: 0 for req in specs}
    step = 0
    preempted_once = False
    while waiting or running:
        backend.new_step(step, step * 1000)
        tokens_left = budget
        for req in list(running):
            request = backend.request(req)
            num_new = min(chunk, request.num_tokens - request.num_computed_tokens, tokens_left)
            if num_new <= 0:
                continue
            if not backend.allocate_slots(req, num_new):
                running.remove(req)
                backend.preempt(req)
                waiting.insert(0, req)
                continue
            tokens_left -= num_new
            backend.advance(req, num_new)
            if request.num_computed_tokens >= request.num_prompt_tokens:
                generated[req] += 1
        for req in list(waiting):
            if tokens_left <= 0:
                break
            num_hit, _ = backend.get_computed_blocks(req)
            request = backend.request(req)
            num_new = min(chunk, request.num_tokens - num_hit, tokens_left)
            if not backend.allocate_slots(req, num_new, num_hit):
                break
            waiting.remove(req)
            running.append(req)
            tokens_left -= num_new
            backend.advance(req, num_new)
        if step == 6 and not preempted_once and running:
            victim = running.pop()
            backend.preempt(victim)
            waiting.insert(0, victim)
            preempted_once = True
        for req in list(running):
            if req == 2 and generated[req] >= 2:
                running.remove(req)
                backend.free(req, FinishStatus.ABORTED)
            elif generated[req] >= specs[req][1]:
                running.remove(req)
                backend.free(req)
        step += 1
