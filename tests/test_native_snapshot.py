"""The model backend's C core starting from a capture's start snapshot (``csrc/model_restore.c``)
against its pure-Python twin and vLLM's own cache (the ``vllm`` backend).

Captures armed mid-flight on vLLM 0.33's own ``Scheduler`` and ``KVCacheManager`` (``kvtrace
engine``'s, in-process, as ``test_snapshot.py`` makes them), on four geometries (four and seven
KV-cache groups, a pool under pressure, a hash unit finer than the Mamba block, dense
retention), each under another engine variant; three of them again on vLLM's
``AsyncScheduler`` (``kvtrace engine --async-scheduling``: the snapshot holds a step in flight,
its requests' tokens in flight and output placeholders). From each snapshot, with requests in
flight running and waiting (preempted ones among them), the three caches must report the same
records, record for record:

* rescheduled by the scheduler model, under every modelled variant;
* in lockstep, re-issuing the captured calls (under the engine's own variant);
* as ``kvtrace replay`` runs them: counting the summary without records, and writing the
  replay trace (the C core counts and writes from the snapshot on).

A snapshot the C core could not hold (a block outside the pool, an index outside a request's
blocks...) is a ``SnapshotError`` from the core, never a crash, even without the checks
``replay`` makes first.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import msgspec
import pytest
from test_model_backend import TWINS, first_divergence
from test_snapshot import capture_steps, serving

from kvtrace.engine.core import EngineOptions, load_workload
from kvtrace.engine_config import Overrides, derive
from kvtrace.events import BlocksCached
from kvtrace.replay.backend import open_backend, started
from kvtrace.replay.lockstep import replay_lockstep
from kvtrace.replay.model import NativeModelBackend, native
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.replay.scheduler import Scheduler
from kvtrace.replay.snapshot import SnapshotError, snapshot_of
from kvtrace.replay.source import Source, read_source
from kvtrace.replay.variants import MODELLED_VARIANTS
from kvtrace.traceio import TraceReader
from kvtrace.workloads.synth import synthesize
from kvtrace.workloads.workload import EngineShape, write_workload

pytestmark = pytest.mark.skipif(not native.built, reason="the C core is not built here")

BACKENDS = ("vllm", *TWINS)
ARM_AFTER = 300  # steps: the engine is busy, the pool full, requests run and wait
CAPTURE_STEPS = 400


def _holds_producer_tail_and_preempted(engine) -> bool:
    """A Mamba manager holds a producer's partial tail, and a preempted request waits."""
    scheduler = engine.scheduler
    return (any(getattr(manager, "_producer_partial_tail_reqs", None)
                for manager in scheduler.kv_cache_manager.coordinator.single_type_managers)
            and any(request.status.name == "PREEMPTED" for request in scheduler.waiting))


# name: (model, EngineShape overrides, the engine's variant, what must hold at the arm)
SYNC_CAPTURES = {
    "nemotron-h-8b": ("nemotron-h-8b", {}, "unfixed", None),
    "qwen3-next-small-pool": ("qwen3-next-80b-a3b", {"num_gpu_blocks": 120}, "fixed", None),
    "kimi-linear-fine-hash": ("kimi-linear-48b-a3b",
                              {"hash_unit": 64, "allow_unreal_geometry": True}, "naive",
                              _holds_producer_tail_and_preempted),
    "kimi-k3-dense-retention": ("kimi-k3", {"retention_interval": None}, "upstream", None),
}
# The same engines on vLLM's AsyncScheduler (the engine core's batch queue): "NAME-async".
ASYNC_CAPTURES = ("nemotron-h-8b", "qwen3-next-small-pool", "kimi-linear-fine-hash")
CAPTURES = {**SYNC_CAPTURES, **{f"{name}-async": SYNC_CAPTURES[name] for name in ASYNC_CAPTURES}}


@dataclass(frozen=True)
class Capture:
    variant: str  # the engine's
    source: Source
    config: object
    settings: object
    captured: list  # the trace's records, for lockstep

    @property
    def snapshot(self):
        return self.source.snapshot


@lru_cache(maxsize=None)
def capture(name: str, directory: Path) -> Capture:
    """The capture ``name`` of ``CAPTURES``: 60 documents served ``ARM_AFTER`` steps (then on
    until what the case needs holds), captured for ``CAPTURE_STEPS`` more."""
    model, overrides, variant, ready = CAPTURES[name]
    shape = EngineShape(model=model, **overrides)
    workload_path = directory / f"{name}.workload.kvtrace"
    write_workload(workload_path, synthesize("documents", 60, 0, shape.hash_block_size), shape)
    scheduling = Overrides(async_scheduling=name.endswith("-async"))
    engine = serving(load_workload(EngineOptions(str(workload_path), variant=variant,
                                                 overrides=scheduling)),
                     ARM_AFTER, variant)
    while ready is not None and not ready(engine):
        engine.step()
    trace = capture_steps(engine, directory / f"{name}.kvtrace", CAPTURE_STEPS)
    source = read_source(str(trace))
    config, settings = derive(source.header.config, str(trace))
    return Capture(variant, source, config, settings, list(TraceReader(str(trace))))


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    directory = tmp_path_factory.mktemp("native-snapshot")
    return lambda name: capture(name, directory)


def records_of(backend: str, case: Capture, variant: str, mode: str) -> list:
    """The records of ``backend`` ("vllm", or a twin of the model) started from the case's
    snapshot, rescheduled or in lockstep."""
    records: list = []
    if backend == "vllm":
        cache = open_backend(backend, case.config, variant, records.append, case.snapshot)
    else:
        cache = started(TWINS[backend](case.config, variant, records.append), case.snapshot)
    with cache:
        if mode == "lockstep":
            replay_lockstep(case.captured, cache)
        else:
            start = case.source.start(warm=True)
            Scheduler(cache, case.config, case.settings).run(start.arrivals, None,
                                                             start.in_flight, start.start_ns)
    return records


RUNS = [(name, mode, variant) for name, (_, _, engine_variant, _) in CAPTURES.items()
        for mode, variant in [("lockstep", engine_variant),
                              *(("reschedule", v) for v in MODELLED_VARIANTS)]]


@pytest.mark.parametrize("name,mode,variant", RUNS)
def test_the_twins_start_from_a_snapshot_as_vllm_does(captures, name, mode, variant):
    case = captures(name)
    reference = records_of("vllm", case, variant, mode)
    assert len(reference) > 1000
    if mode == "lockstep":  # the capture itself, in its effects
        assert first_divergence([r for r in case.captured if r.family in ("input", "effect")],
                                reference) is None
    for twin in TWINS:
        divergence = first_divergence(reference, records_of(twin, case, variant, mode))
        assert divergence is None, f"{twin} twin, {name}, {mode} {variant}:\n{divergence}"


def test_the_captures_hold_what_a_restore_must_carry(captures):
    """Between them, the snapshots hold everything the C core restores: requests running and
    waiting, preempted ones in both queues, every per-request field a manager keeps between
    steps, keys held by several blocks and keys beside a block's primary one, up to seven
    KV-cache groups; an async engine's step in flight (decode tokens and a prefill chunk in
    flight), whose capture goes on with ``cache_blocks`` calls."""
    statuses, fields, groups = set(), set(), set()
    num_shared_keys = num_secondary_keys = 0
    in_flight = []
    for name in CAPTURES:
        snapshot = captures(name).snapshot
        assert snapshot.running() and snapshot.waiting(), name
        assert captures(name).config.async_scheduling == name.endswith("-async")
        if name.endswith("-async"):
            assert any(isinstance(r, BlocksCached) for r in captures(name).captured), name
            assert any(r.num_in_flight_tokens for r in snapshot.requests), name
        in_flight += [r.num_in_flight_tokens for r in snapshot.requests]
        statuses |= {(r.status, r.num_preemptions > 0) for r in snapshot.requests}
        fields |= {field for table in snapshot.request_blocks for field in table.fields}
        groups.add(len(captures(name).config.kv_cache_groups))
        primary = {block.block_id: (block.hash_id, block.group) for block in snapshot.blocks}
        num_shared_keys += sum(len(key.block_ids) > 1 for key in snapshot.keys)
        num_secondary_keys += sum(primary[block] != (key.hash_id, key.group)
                                  for key in snapshot.keys for block in key.block_ids)
    assert {("RUNNING", False), ("RUNNING", True), ("WAITING", False),
            ("PREEMPTED", True)} <= statuses
    assert {"num_cached_block", "last_state_block_idx", "_num_retired_blocks",
            "_allocated_block_reqs", "_producer_partial_tail_reqs"} <= fields
    assert groups == {4, 7}
    assert num_shared_keys and num_secondary_keys
    assert 1 in in_flight and max(in_flight) > 1  # a decode token and a prefill chunk


@pytest.mark.parametrize("name", ["nemotron-h-8b", "kimi-linear-fine-hash",
                                  "nemotron-h-8b-async", "kimi-linear-fine-hash-async"])
def test_replays_that_count_or_write_start_from_the_snapshot_alike(captures, tmp_path,
                                                                   monkeypatch, name):
    """``kvtrace replay`` on the model backend takes the C core from a snapshot (an async
    engine's too, its step in flight), and its summaries (counted in C, no record made) and
    written traces (batches encoded in C) are the vllm backend's and the Python twin's."""
    case = captures(name)
    assert type(open_backend("model", case.config, "fixed", print, case.snapshot)) \
        is NativeModelBackend
    results = {}
    for backend in BACKENDS:
        with monkeypatch.context() as patch:
            if backend == "python":
                patch.setattr(native, "core", None)  # KVTRACE_NATIVE=0
            for write_traces in (False, True):
                outdir = tmp_path / backend
                result = replay(ReplayOptions(
                    source=str(case.source.path), outdir=str(outdir),
                    backend="vllm" if backend == "vllm" else "model",
                    variants=("unfixed", "fixed"), write_traces=write_traces))
                results[backend, write_traces] = [v.summary for v in result.variants]
        results[backend, "traces"] = [list(TraceReader(v.output)) for v in result.variants]
    for variant, summary in enumerate(results["vllm", False]):
        assert summary["requests"] > 0 and summary["hit_tokens"] > 0
        for key, summaries in results.items():
            if key[1] != "traces":
                assert summaries[variant] == summary, key
    for backend in TWINS:
        for reference, written in zip(results["vllm", "traces"], results[backend, "traces"]):
            assert snapshot_of(written).records() == case.snapshot.records()
            assert first_divergence(reference, written) is None, backend


def _table_of(snapshot, group_kind: str, config):
    """The first request table in a group of ``group_kind`` that holds a block."""
    return next(t for t in snapshot.request_blocks
                if config.kv_cache_groups[t.group].kind == group_kind and any(t.block_ids))


def _replace(records: list, index: int, **changes) -> None:
    records[index] = msgspec.structs.replace(records[index], **changes)


@pytest.mark.parametrize("damage, message", [
    (lambda s, c: _replace(s.blocks, 0, block_id=c.num_gpu_blocks),
     "names block {blocks}, outside the pool of {blocks}"),
    (lambda s, c: _replace(s.keys, 0, group=len(c.kv_cache_groups)),
     "names KV-cache group {groups}; the engine has {groups}"),
    (lambda s, c: s.free_queue.append(s.free_queue[0]),
     "lists block \\d+ twice in the free queue"),
    (lambda s, c: s.requests.append(s.requests[0]), "lists request \\d+ twice"),
    (lambda s, c: _replace(s.request_blocks, 0, req=10**9),
     "gives blocks to request 1000000000, which it does not list"),
    (lambda s, c: _replace(s.request_blocks, 0, block_ids=[-1]),
     "names block -1, outside the pool"),
    (lambda s, c: _table_of(s, "full_attention", c).fields.update(last_state_block_idx=[0]),
     "gives request \\d+ last_state_block_idx in KV-cache group \\d+, which keeps no such"),
    (lambda s, c: _table_of(s, "mamba", c).fields.update(_bogus=[1]),
     "gives request \\d+ _bogus in KV-cache group"),
    (lambda s, c: _table_of(s, "mamba", c).fields.update(num_cached_block=[1, 2]),
     "has num_cached_block = \\[1, 2\\] for request \\d+, not 1 values"),
    (lambda s, c: _table_of(s, "mamba", c).fields.update(last_state_block_idx=[10**6]),
     "gives request \\d+ last_state_block_idx \\[1000000\\], outside its \\d+ blocks"),
    (lambda s, c: _table_of(s, "mamba", c).fields.update(_checkpoints=[64, -1]),
     "_checkpoints \\[64, -1\\], outside its"),
    (lambda s, c: _table_of(s, "full_attention", c).fields.update(_partial_hit_reqs=[0, 0]),
     "_partial_hit_reqs \\[0, 0\\], outside its"),
])
def test_a_snapshot_the_core_cannot_hold_is_refused_not_crashed(captures, damage, message):
    """Restored without ``replay``'s checks (``snapshot_checks``, which refuse each of these
    first), the C core refuses what would take it outside its arrays, and says which record."""
    case = captures("nemotron-h-8b")
    snapshot = copy.deepcopy(case.snapshot)
    damage(snapshot, case.config)
    expected = message.format(blocks=case.config.num_gpu_blocks,
                              groups=len(case.config.kv_cache_groups))
    with pytest.raises(SnapshotError, match=expected):
        started(NativeModelBackend(case.config, "unfixed", print), snapshot)

