"""The scheduler model: hand-computed scheduling rules, then the real vLLM cache under it.

Pure rules (budget, threshold, FCFS, preemption, finishing) use a tiny in-test block counter
(``CountingPool``), which is not a prefix cache; everything that depends on cache behaviour
runs the real vLLM 0.33.0 ``KVCacheManager`` through ``VllmBackend``.
"""

from __future__ import annotations

import pytest

from kvtrace.engine_config import SchedulerSettings
from kvtrace.errors import ConfigError
from kvtrace.events import EngineConfig, FinishStatus, KVCacheGroup
from kvtrace.replay.arrivals import Arrival, arrivals_of
from kvtrace.replay.scheduler import Scheduler
from kvtrace.replay.scheduling_rules import MambaAlignedSplit, mamba_checkpoint_position
from vllm_support import seed_config

# The seed config of the PR analysis: full attention 16, Mamba align 32, hash unit 16.
HYBRID = seed_config(0)
NO_CHECKPOINT_BLOCKS = EngineConfig(
    kv_cache_groups=[HYBRID.kv_cache_groups[0],
                     KVCacheGroup(kind="mamba", block_size=32, mamba_cache_mode="align")],
    hash_block_size=16,
    num_gpu_blocks=64,
)
ATTENTION_ONLY = EngineConfig(kv_cache_groups=[KVCacheGroup(kind="full_attention", block_size=16)],
                              hash_block_size=16, num_gpu_blocks=64)


def split_for(config: EngineConfig, budget: int = 8192) -> MambaAlignedSplit:
    split = MambaAlignedSplit.for_config(config, SchedulerSettings(max_num_batched_tokens=budget))
    assert split is not None
    return split


# --- the Mamba block-aligned split --------------------------------------------------------------


def test_checkpoint_position_keeps_one_token_for_logits():
    assert mamba_checkpoint_position(240, 16, False) == 224  # 239 floored to 16
    assert mamba_checkpoint_position(241, 16, False) == 240
    assert mamba_checkpoint_position(240, 32, False) == 224
    assert mamba_checkpoint_position(240, 16, True) == 224  # EAGLE drops a unit instead
    assert mamba_checkpoint_position(8, 16, False) == 0


def test_split_aligns_a_mid_prompt_chunk_end_down_to_the_mamba_block():
    split = split_for(HYBRID)
    assert split.partial_cache_hit  # hash unit 16 < Mamba block 32
    # 100 of 240 tokens: the chunk end 100 falls back to the block boundary 96.
    assert split.clip(100, start=0, num_prompt_tokens=240, num_tokens=240, shared_prefix_boundary=0) == 96


def test_split_final_chunk_with_an_internal_checkpoint_runs_to_the_prompt_end():
    # [96, 240): the checkpoint at 224 is exportable inside the chunk, so nothing clips it.
    assert split_for(HYBRID).clip(144, 96, 240, 240, 0) == 144


def test_split_without_checkpoint_blocks_stops_at_the_last_cacheable_boundary():
    split = split_for(NO_CHECKPOINT_BLOCKS)
    assert not split.has_checkpoint_blocks
    # The state at 224 (last block boundary before the logits token) must be materialised.
    assert split.clip(144, 96, 240, 240, 0) == 128
    assert split.clip(16, 224, 240, 240, 0) == 16


def test_split_stops_at_the_block_floored_shared_prefix_junction():
    # Junction 112 (full attention hit deeper than Mamba): the chunk stops at 96.
    assert split_for(HYBRID).clip(240, 0, 240, 240, shared_prefix_boundary=112) == 96


def test_split_mid_block_start_realigns_unless_the_checkpoint_covers_it():
    # Start 48 (a hash-unit hit): without checkpoint blocks it runs only to the boundary 64.
    assert split_for(NO_CHECKPOINT_BLOCKS).clip(192, 48, 240, 240, 0) == 16
    # With them, the final chunk exports its checkpoint and is not clipped.
    assert split_for(HYBRID).clip(192, 48, 240, 240, 0) == 192


def test_split_leaves_decode_alone():
    assert split_for(HYBRID).clip(1, 240, 240, 241, 0) == 1


def test_split_lets_a_block_wider_than_the_budget_advance_sub_block():
    # Budget 20 < block 32: a 20-token chunk from 0 may not align down to 0.
    assert split_for(NO_CHECKPOINT_BLOCKS, budget=20).clip(20, 0, 240, 240, 0) == 20


def test_no_split_without_an_align_mamba_group():
    assert MambaAlignedSplit.for_config(ATTENTION_ONLY, SchedulerSettings()) is None


# --- pure scheduling rules, with a block counter ----------------------------------------------


class CountingPool:
    """Counts 16-token blocks per request; fails an allocation that would exceed the pool.
    Not a cache: it always reports 0 hit tokens. Logs every call for the assertions."""

    BLOCK = 16

    def __init__(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.held: dict[int, int] = {}
        self.computed: dict[int, int] = {}
        self.steps: list[list[tuple]] = []

    def _log(self, *call) -> None:
        self.steps[-1].append(call)

    def new_step(self, step: int, ts_ns: int) -> None:
        self.steps.append([])

    def add_request(self, req, prompt_len, hash_ids, max_tokens, output_hash_ids=None) -> None:
        self.computed[req] = 0

    def get_computed_blocks(self, req: int) -> tuple[int, int]:
        return 0, 0

    def allocate_slots(self, req, num_new_tokens, num_new_computed_tokens=0, num_lookahead_tokens=0,
                       full_sequence_must_fit=False):
        # Admits by chunk whatever full_sequence_must_fit says (the vLLM differential test
        # covers whole-sequence admission).
        need = -(-(self.computed[req] + num_new_tokens) // self.BLOCK)
        others = sum(n for r, n in self.held.items() if r != req)
        ok = others + need <= self.num_gpu_blocks
        if ok:
            self.held[req] = max(self.held.get(req, 0), need)
        self._log("alloc", req, num_new_tokens, ok)
        return ok

    def end_schedule(self) -> None:
        """Nothing to release: this pool makes no copy-on-write copies."""

    def advance(self, req: int, num_tokens: int) -> None:
        self.computed[req] += num_tokens

    def free(self, req: int, status: FinishStatus = FinishStatus.FINISHED) -> None:
        self.held.pop(req, None)
        self._log("free", req)

    def preempt(self, req: int) -> None:
        self.held.pop(req, None)
        self.computed[req] = 0
        self._log("preempt", req)

    def num_free_blocks(self) -> int:
        return self.num_gpu_blocks - sum(self.held.values())


def run(requests, num_gpu_blocks=1000, **settings) -> CountingPool:
    pool = CountingPool(num_gpu_blocks)
    Scheduler(pool, ATTENTION_ONLY, SchedulerSettings(**settings)).run(requests)
    return pool


def scheduled_per_step(pool: CountingPool) -> list[list[tuple[int, int]]]:
    return [[(c[1], c[2]) for c in step if c[0] == "alloc" and c[3]] for step in pool.steps]


def test_budget_is_shared_running_first_then_fcfs_admission():
    pool = run([Arrival(0, 150, [], 2), Arrival(1, 60, [], 2)],
               max_num_batched_tokens=100)
    assert scheduled_per_step(pool) == [
        [(0, 100)],  # r0 takes the whole budget
        [(0, 50), (1, 50)],  # r0 finishes its prompt first; r1 gets the rest
        [(0, 1), (1, 10)],  # r0 decodes its second token; r1 finishes its prompt
        [(1, 1)],  # r0 finished after 2 outputs; r1 decodes
    ]
    assert [c for step in pool.steps for c in step if c[0] == "free"] == [("free", 0), ("free", 1)]


def test_long_prefill_threshold_caps_chunks_only_when_others_wait():
    pool = run([Arrival(0, 100, [], 1), Arrival(1, 100, [], 1, arrival_ns=10**12)],
               long_prefill_token_threshold=40)
    # Alone, r0 may use the whole budget; r1 arrives much later and is alone too.
    assert scheduled_per_step(pool) == [[(0, 100)], [(1, 100)]]
    pool = run([Arrival(0, 100, [], 1), Arrival(1, 100, [], 1)],
               long_prefill_token_threshold=40)
    assert scheduled_per_step(pool)[:3] == [[(0, 40), (1, 40)], [(0, 40), (1, 40)], [(0, 20), (1, 20)]]


def test_max_num_seqs_holds_back_admissions():
    pool = run([Arrival(i, 10, [], 2) for i in range(3)], max_num_seqs=2)
    assert scheduled_per_step(pool)[:3] == [[(0, 10), (1, 10)], [(0, 1), (1, 1)], [(2, 10)]]


def test_failed_allocation_preempts_the_last_running_request_and_it_resumes():
    # 4 blocks of 16: r0 (prompt 32) and r1 (prompt 32) fill the pool; r0's first decode token
    # needs a third block, so r1 (the last running) is preempted and recomputed later.
    pool = run([Arrival(0, 32, [], 3), Arrival(1, 32, [], 2)], num_gpu_blocks=4)
    calls = [c for step in pool.steps for c in step]
    assert calls[:5] == [("alloc", 0, 32, True), ("alloc", 1, 32, True),
                         ("alloc", 0, 1, False), ("preempt", 1), ("alloc", 0, 1, True)]
    # Recomputed from scratch after the preemption: its prompt and the token it had sampled.
    assert ("alloc", 1, 33, True) in calls[5:]
    assert calls[-1] == ("free", 1)


def test_no_admission_in_a_step_that_preempted():
    pool = run([Arrival(0, 32, [], 3), Arrival(1, 32, [], 2)], num_gpu_blocks=4)
    preempting_step = next(s for s in pool.steps if ("preempt", 1) in s)
    assert all(c[1] == 0 for c in preempting_step if c[0] == "alloc")


def test_resumed_request_recomputes_its_outputs_too():
    # r1 is preempted after it sampled one token, so its resumed prefill covers 32 + 1 tokens.
    pool = run([Arrival(0, 32, [], 4), Arrival(1, 31, [], 3)], num_gpu_blocks=4)
    calls = [c for step in pool.steps for c in step]
    assert ("preempt", 1) in calls
    resumed = calls[calls.index(("preempt", 1)):]
    assert next(c for c in resumed if c[0] == "alloc" and c[1] == 1 and c[3]) == ("alloc", 1, 32, True)


def test_a_pool_too_small_for_one_request_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot hold request 0"):
        run([Arrival(0, 100, [], 1)], num_gpu_blocks=3)


def test_arrivals_wait_for_the_virtual_clock():
    pool = CountingPool(1000)
    scheduler = Scheduler(pool, ATTENTION_ONLY, SchedulerSettings(step_overhead_ns=1000, ns_per_token=0))
    stats = scheduler.run([Arrival(0, 10, [], 3), Arrival(1, 10, [], 1, arrival_ns=1500)])
    # r1 arrives during step 1 (clock 1000..2000) and is admitted at step 2.
    assert scheduled_per_step(pool) == [[(0, 10)], [(0, 1)], [(0, 1), (1, 10)]]
    assert stats.steps == 3 and stats.virtual_ns == 3000


def test_each_step_releases_its_copy_on_write_retentions_so_no_block_leaks():
    """vLLM's ``schedule()`` frees the retained ends of a step's copy-on-write copies (partial
    Mamba hits) after its allocations; without that every partial hit would leak two blocks.
    The engine itself frees them, outside any cache-manager call: a ``BlocksReleased`` input."""
    from kvtrace.events import BlocksReleased
    from kvtrace.replay.vllm_backend import VllmBackend
    from kvtrace.workloads.workload import EngineShape, engine_config_for, pool_size, workload_records
    from kvtrace.workloads.synth import synthesize

    shape = EngineShape(hash_unit=32)  # a prefix_match_unit finer than the block: partial hits
    workload = synthesize("shared-prompt", 40, 0, shape.hash_block_size)
    records = list(workload_records(workload))
    config = engine_config_for(workload, shape, pool_size(workload, shape)[0])
    replayed: list = []
    with VllmBackend(config, "unfixed", replayed.append) as backend:
        Scheduler(backend, config, SchedulerSettings.from_config(config)).run(arrivals_of(records))
        assert backend.num_free_blocks() == config.num_gpu_blocks - 1  # all but the null block
    released = [r for r in replayed if isinstance(r, BlocksReleased)]
    assert released and all(r.block_ids for r in released)
