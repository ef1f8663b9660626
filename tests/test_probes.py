"""kvtrace's probes on the real vLLM 0.33.0 classes: arming, isolation, failure safety, and
the records a capture (no variant installed) writes."""

from __future__ import annotations

import pytest

from kvtrace.events import (
    BlockFreed,
    BlocksReleased,
    CheckpointSuppressed,
    FinishStatus,
    HashesExtended,
    HashInterned,
    HashInterner,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    SlotsAllocated,
)
from kvtrace.probes import CacheProbes, ProbeSignatureError, probe_targets
from kvtrace.probes import probe_state, wrappers
from kvtrace.probes.signatures import EXPECTED_SIGNATURES
from vllm_support import (  # noqa: F401 (vllm_backend_class is a fixture)
    SEED_HASH_IDS, prefill_chunks, run_mixed_workload, seed_config, vllm_backend_class)


def class_functions():
    return {(owner, name): owner.__dict__[name] for owner, name, _ in probe_targets()}


def test_arm_and_disarm_restore_the_exact_original_functions(vllm_backend_class):
    originals = class_functions()
    assert len(originals) == len(EXPECTED_SIGNATURES)
    first = vllm_backend_class(seed_config(0), "fixed", lambda r: None)
    second = vllm_backend_class(seed_config(0), "unfixed", lambda r: None)
    patched = {key: key[0].__dict__[key[1]] for key in originals}
    assert all(patched[key] is not function for key, function in originals.items())
    first.close()
    assert all(key[0].__dict__[key[1]] is patched[key] for key in originals)  # second still armed
    second.close()
    assert all(key[0].__dict__[key[1]] is function for key, function in originals.items())


def test_each_backend_reports_only_its_own_cache(vllm_backend_class):
    mine, theirs = [], []
    first = vllm_backend_class(seed_config(0), "fixed", mine.append)
    second = vllm_backend_class(seed_config(0), "fixed", theirs.append)
    first.add_request(0, 240, SEED_HASH_IDS, 4)
    prefill_chunks(first, 0, [128, 112])
    second.close()
    assert mine and not theirs
    first.close()


def test_a_raising_sink_never_changes_what_the_cache_does(vllm_backend_class):
    def broken_sink(record):
        raise RuntimeError("sink down")

    def run(sink):
        backend = vllm_backend_class(seed_config(0, num_gpu_blocks=40), "fixed", sink)
        lookups = []
        original = backend.get_computed_blocks

        def recording_lookup(req):
            lookups.append(original(req))
            return lookups[-1]

        backend.get_computed_blocks = recording_lookup
        run_mixed_workload(backend)
        state = (lookups, backend.num_free_blocks(),
                 [block.block_hash for block in backend.manager.block_pool.blocks],
                 backend.probes.num_failures if backend.probes else 0)
        backend.close()
        return state

    *unprobed, _ = run(None)
    *probed, failures = run(broken_sink)
    assert probed == unprobed
    assert failures > 100


def test_a_signature_mismatch_refuses_before_patching_anything(vllm_backend_class,
                                                               monkeypatch):
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    originals = class_functions()

    def cache_blocks(self, request, num_tokens):  # a future vLLM's shape
        return None

    monkeypatch.setattr(MambaManager, "cache_blocks", cache_blocks)
    with pytest.raises(ProbeSignatureError) as error:
        CacheProbes(print, HashInterner()).arm()
    assert "MambaManager.cache_blocks" in str(error.value)
    assert "0.33.0" in str(error.value)
    for (owner, name), function in originals.items():
        if name != "cache_blocks" or owner is not MambaManager:
            assert owner.__dict__[name] is function


def test_capture_mode_interns_hashes_and_tells_finish_from_preemption(vllm_backend_class):
    """A process-wide probe on a bare vLLM manager (no variant: what a live engine runs)."""
    records = []
    backend = vllm_backend_class(seed_config(None), "upstream", lambda r: None)
    backend.close()  # keep the manager, drop the backend's own probes
    probes = CacheProbes(records.append, HashInterner(), emit_hash_bytes=True).arm()
    try:
        backend.add_request(7, 240, SEED_HASH_IDS, 40)
        prefill_chunks(backend, 7, [128, 112])
        backend.preempt(7)
        backend.new_step(9, 9)
        backend.get_computed_blocks(7)
        backend.sync_request(7, 0, 240 + 17)  # 17 decoded tokens: one more hash unit
        assert backend.allocate_slots(7, 16)
        backend.free(7, FinishStatus.ABORTED)
    finally:
        probes.disarm()
    arrived = [r for r in records if type(r) is RequestArrived]
    assert len(arrived) == 1
    assert (arrived[0].req, arrived[0].prompt_len, arrived[0].max_tokens) == (0, 240, 40)
    assert arrived[0].hash_ids == list(range(15))  # dense ids in order of first appearance
    interned = [r.hash_id for r in records if type(r) is HashInterned]
    assert interned == list(range(16))
    assert [r.hash_ids for r in records if type(r) is HashesExtended] == [[15]]
    assert [type(r) for r in records if type(r) in (RequestPreempted, RequestFinished)] == [
        RequestPreempted, RequestFinished]
    assert [r for r in records if type(r) is RequestFinished][0].status == FinishStatus.ABORTED
    # vLLM 0.33 itself keeps the unaligned transient checkpoint at 112 request-local.
    assert [(r.position, r.num_stripped) for r in records
            if type(r) is CheckpointSuppressed] == [(112, 1)]
    slots = [r for r in records if type(r) is SlotsAllocated]
    assert [(s.num_new_tokens, s.num_computed_tokens, s.success) for s in slots][:2] == [
        (128, 0, True), (112, 128, True)]
    freed = [r for r in records if type(r) is BlockFreed]
    assert freed and all(r.ref_cnt == 0 for r in freed[-3:])


def test_only_frees_outside_the_cache_manager_are_blocks_released(vllm_backend_class):
    """The engine's own frees (vLLM's scheduler releasing copy-on-write retentions) become a
    ``BlocksReleased`` input that lockstep re-issues; frees inside ``KVCacheManager.free`` do
    not, also for a request that started before the probes were armed."""
    records = []
    backend = vllm_backend_class(seed_config(None), "upstream", lambda r: None)
    backend.close()  # keep the manager, drop the backend's own probes
    backend.add_request(1, 240, SEED_HASH_IDS, 40)
    prefill_chunks(backend, 1, [128])  # before arming: the probes never see request 1
    pool = backend.manager.block_pool
    held = pool.get_new_blocks(2)  # blocks the engine itself holds
    probes = CacheProbes(records.append, HashInterner()).arm()
    try:
        backend.free(1)
        pool.free_blocks(held)
    finally:
        probes.disarm()
    released = [r for r in records if type(r) is BlocksReleased]
    assert [r.block_ids for r in released] == [[block.block_id for block in held]]
    assert records.index(released[0]) > 0  # after the request's own BlockFreed records
    assert all(type(r) is BlockFreed for r in records[:records.index(released[0])])


def test_made_up_hash_ids_never_equal_a_later_requests_real_ones(vllm_backend_class):
    """Decode past a workload's known units gets made-up hash ids; they must not name a unit of
    a request that arrives later (a false prefix hit in replay)."""
    with vllm_backend_class(seed_config(None), "upstream", lambda r: None) as backend:
        backend.add_request(0, 32, [0, 1], 40)  # two hash units known, none for its output
        prefill_chunks(backend, 0, [32])
        for step in range(1, 17):  # decode 16 tokens: a third unit, which no workload named
            backend.new_step(step, step)
            assert backend.allocate_slots(0, 1)
            backend.advance(0, 1)
        made_up = int.from_bytes(backend.request(0).block_hashes[2], "big")
        assert made_up not in (0, 1)
        # A later request whose ids are the next dense ones, as a workload numbers them.
        backend.add_request(1, 32, [2, 3], 4)
        assert backend.get_computed_blocks(1) == (0, 0)
        assert backend.cached_block_id(made_up, 0) is not None  # the made-up unit is cached


def test_the_wrappers_use_exactly_the_probe_state_they_document():
    """``probe_state.WrappedProbeState`` is the wrapper <-> probe state protocol: every attribute
    and method a wrapper touches on its probe set is listed there, nothing listed goes unused,
    and a real ``CacheProbes`` has all of it."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(wrappers))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "probe"}
    protocol = probe_state.WrappedProbeState
    declared = set(protocol.__annotations__) | {
        name for name, member in vars(protocol).items()
        if inspect.isfunction(member) and not name.startswith("__")}
    assert used == declared
    probes = CacheProbes(print, HashInterner())
    assert [name for name in sorted(declared) if not hasattr(probes, name)] == []
