"""kvtrace's optional native core (``kvtrace._native``, built from ``csrc/``) against its
Python twins.

Each native part must do exactly what the Python code it stands in for does: the same records
from the same vLLM engine run, the same hand-over when the buffer overflows, the same frames on
disk. The records it builds follow the field order of their types in ``kvtrace.events``, read
when it is configured, or it refuses them and is off. The rest of the suite runs with the native
core on (the default where it is built).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import zlib

import msgspec
import pytest
from msgspec.structs import fields, replace
from vllm_support import prefill_chunks, seed_config, vllm_backend_class  # noqa: F401

from kvtrace import events, native
from kvtrace.events import (
    BlockStored,
    EventsDropped,
    GpuSampled,
    HashInterner,
    RequestArrived,
    StepStarted,
    TraceHeader,
)
from kvtrace.traceio import TraceWriter, encode_rows, read_records

pytestmark = pytest.mark.skipif(
    native.built is None,
    reason="kvtrace._native was not built here (no C compiler at install): only the Python "
           "twins exist, and the rest of the suite tests them")

HOT_METHODS = {
    "vllm.v1.core.kv_cache_manager.KVCacheManager": ("new_step_starts", "allocate_slots"),
    "vllm.v1.core.block_pool.BlockPool": ("_insert_block_hash", "_remove_cached_block_hashes",
                                          "get_new_blocks", "touch", "free_blocks"),
    "vllm.v1.core.single_type_kv_cache_manager.MambaManager": (
        "get_num_blocks_to_allocate", "allocate_new_blocks", "cache_blocks"),
}


def patched_kinds() -> set[str]:
    """Type names of what replaces the hot methods while probes are armed."""
    import importlib

    kinds = set()
    for qualname, methods in HOT_METHODS.items():
        module_name, class_name = qualname.rsplit(".", 1)
        owner = getattr(importlib.import_module(module_name), class_name)
        kinds |= {type(owner.__dict__[method]).__name__ for method in methods}
    return kinds


# The record types the native core builds, in the order configure() takes them.
NATIVE_RECORD_TYPES = ("StepStarted", "SlotsAllocated", "BlockStored", "BlockRemoved",
                       "HashInterned", "BlockAllocated", "BlockTouched", "BlockFreed",
                       "BlocksReleased")


def configure_core(**record_types) -> None:
    """Configure the built core as the probes do, with the record types named here instead."""
    from kvtrace.probes import wrappers

    native.built.configure(*(record_types.get(name, getattr(events, name))
                             for name in NATIVE_RECORD_TYPES),
                           wrappers._NO_REQ, wrappers._STALE_CHECKPOINT,
                           wrappers._LRU_REUSE)


@pytest.fixture
def reconfigure():
    """``configure_core``; the real record types are back after the test."""
    yield configure_core
    configure_core()


def reordered(record_type, padding=msgspec.field(default=7)) -> type:
    """``record_type`` (same name) with its fields in another order: the required ones reversed,
    then a new field ``padding``, then the ones with a default reversed (msgspec puts required
    fields first)."""
    required = [(f.name, f.type) for f in fields(record_type) if f.required]
    optional = [(f.name, f.type, f.default) for f in fields(record_type) if not f.required]
    return msgspec.defstruct(record_type.__name__,
                             required[::-1] + [("padding", int, padding)] + optional[::-1],
                             array_like=True, frozen=True)


def as_event(record):
    """``record`` as the ``kvtrace.events`` type of its name, its values taken by field name."""
    event_type = getattr(events, type(record).__name__)
    if type(record) is event_type:
        return record
    return event_type(**{name: getattr(record, name) for name in event_type.__struct_fields__})


def engine_records(workload, variant: str, monkeypatch, core) -> tuple[list, set[str]]:
    """One run of vLLM's own scheduler under a process-wide probe set; its records and what the
    hot methods were replaced by."""
    from kvtrace.probes import CacheProbes
    from kvtrace.engine.core import VllmScheduler

    monkeypatch.setattr(native, "core", core)
    engine = VllmScheduler(workload.config, workload.settings, variant)
    records: list = []
    probes = CacheProbes(records.append, HashInterner(), created_ns=0, emit_hash_bytes=True,
                         sink_many=records.extend).arm()
    try:
        kinds = patched_kinds()
        engine.run(workload.arrivals)
    finally:
        probes.disarm()
    assert probes.num_failures == 0
    return records, kinds


def comparable(records: list) -> list:
    """Records as ``kvtrace.events`` types, wall-clock stamps cleared."""
    cleared = {StepStarted: {"ts_ns": 0}, RequestArrived: {"arrival_ns": 0}}
    return [replace(r, **cleared[type(r)]) if type(r) in cleared else r
            for r in map(as_event, records)]


def assert_same_records(python: list, fast: list) -> None:
    first = next((i for i, (a, b) in enumerate(zip(python, fast)) if a != b), None)
    assert first is None, f"record {first}: Python {python[first]!r}, native {fast[first]!r}"
    assert len(python) == len(fast)


def tight_agent_workload(tmp_path, variant: str, num_requests: int, num_gpu_blocks: int):
    """Synthetic agent traffic in a small pool of the default model's geometry, hashed at 64
    tokens (a prefix_match_unit finer than the block, so partial hits copy-on-write and the
    engine releases blocks): evictions, preemptions, checkpoints published and suppressed."""
    from kvtrace.engine_config import SchedulerSettings
    from kvtrace.engine.core import EngineOptions, load_workload
    from kvtrace.workloads.workload import EngineShape, write_workload
    from kvtrace.workloads.synth import synthesize

    path = tmp_path / "workload.kvtrace"
    shape = EngineShape(num_gpu_blocks=num_gpu_blocks, hash_unit=64)
    write_workload(path, synthesize("agent", num_requests, 0, shape.hash_block_size), shape)
    workload = load_workload(EngineOptions(str(path), variant=variant, speed=0))
    config = replace(workload.config, reserve_full_sequence=False)  # admit by chunk: preempt
    return dataclasses.replace(workload, config=config,
                               settings=SchedulerSettings.from_config(config))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["unfixed", "fixed"])
def test_native_wrappers_record_exactly_what_the_python_wrappers_record(tmp_path, monkeypatch,
                                                                        variant):
    """The record types of kvtrace.events, on a larger workload, both variants."""
    workload = tight_agent_workload(tmp_path, variant, 40, 30)
    python, python_kinds = engine_records(workload, variant, monkeypatch, None)
    fast, fast_kinds = engine_records(workload, variant, monkeypatch, native.built)

    assert python_kinds == {"function"} and fast_kinds == {"FastWrapper"}
    python, fast = comparable(python), comparable(fast)
    assert_same_records(python, fast)
    kinds = {type(r).__name__ for r in python}
    assert {"BlockStored", "BlockRemoved", "CheckpointRecorded", "RequestPreempted",
            "HashesExtended", "HashInterned"} <= kinds


def test_native_records_take_their_field_order_from_their_types(tmp_path, monkeypatch,
                                                               reconfigure):
    """Every record type the native core builds, reordered and given a new field in the middle
    (SlotsAllocated: before fields it supplies, so it passes the default): the core builds the
    new types by field name, and each record it built equals the Python wrapper's."""
    drifted = {name: reordered(getattr(events, name)) for name in NATIVE_RECORD_TYPES}
    workload = tight_agent_workload(tmp_path, "unfixed", 30, 30)
    python, _ = engine_records(workload, "unfixed", monkeypatch, None)
    reconfigure(**drifted)
    fast, fast_kinds = engine_records(workload, "unfixed", monkeypatch, native.built)

    assert fast_kinds == {"FastWrapper"}
    built_natively = [r for r in fast if type(r) in drifted.values()]
    assert {type(r).__name__ for r in built_natively} == set(NATIVE_RECORD_TYPES)
    assert {r.padding for r in built_natively} == {7}
    assert_same_records(comparable(python), comparable(fast))


def test_the_native_snapshot_is_its_python_twin(tmp_path, monkeypatch):
    """A start snapshot of vLLM's own scheduler mid-flight, on a pool with evictions, copy-on-
    write and keys held by several blocks, read with ``snapshot_pool`` and with its Python
    twin: the same packed rows, the same records made of them, and the same hash ids and
    prefix lengths learnt."""
    from kvtrace.engine.core import VllmScheduler
    from kvtrace.probes import CacheProbes
    from kvtrace.probes import snapshot

    workload = tight_agent_workload(tmp_path, "unfixed", 30, 30)
    engine = VllmScheduler(workload.config, workload.settings, "unfixed")
    for arrival in workload.arrivals:
        engine.add_request(arrival)
    for _ in range(40):
        engine.step()
    manager, taken = engine.scheduler.kv_cache_manager, {}
    for twin, core in (("python", None), ("native", native.built)):
        monkeypatch.setattr(native, "core", core)
        probes = CacheProbes(print, HashInterner(), emit_hash_bytes=True)
        read = snapshot.take(manager, engine.scheduler, probes)
        taken[twin] = (read.records()[1:-1], read.pool, probes._depth, dict(probes.interner.ids))
    assert {type(r).__name__ for r in taken["native"][0]} >= {"BlockState", "KeyCached",
                                                              "HashInterned"}
    keys = [r for r in taken["native"][0] if type(r) is events.KeyCached]
    assert any(len(key.block_ids) > 1 for key in keys), "a key held by several blocks"
    assert_same_records(taken["python"][0], taken["native"][0])
    assert taken["python"][1:] == taken["native"][1:]


BAD_RECORD_TYPES = {
    "renamed": ("BlockStored", msgspec.defstruct(
        "BlockStored", [("block_id", int), ("hash_id", int), ("group", int), ("num_tokens", int),
                        ("store_kind", int), ("req", int)]), ValueError,
        "BlockStored has no field kind"),
    "a required field more": ("StepStarted", msgspec.defstruct(
        "StepStarted", [("step", int), ("ts_ns", int), ("rank", int)]), ValueError,
        "StepStarted.rank is required and the native core does not supply it"),
    "a default made per record": ("SlotsAllocated", reordered(
        events.SlotsAllocated, msgspec.field(default_factory=int)), ValueError,
        "SlotsAllocated.padding .* default_factory"),
    "keyword-only": ("HashInterned", msgspec.defstruct(
        "HashInterned", [("hash_id", int), ("hash_bytes", bytes)], kw_only=True), ValueError,
        "HashInterned.hash_id is keyword-only"),
    "another record type": ("BlockAllocated", events.BlockTouched, TypeError,
                            "is not the record type BlockAllocated"),
    "not a Struct": ("BlockFreed", type("BlockFreed", (), {}), TypeError,
                     "BlockFreed is not a msgspec Struct"),
}


@pytest.mark.parametrize("case", BAD_RECORD_TYPES)
def test_native_core_refuses_record_types_it_cannot_build_by_name(case, reconfigure):
    """And a refusal changes nothing: the record types it had are the ones it builds."""
    name, record_type, error, message = BAD_RECORD_TYPES[case]
    with pytest.raises(error, match=message):  # with a type it could build, not taken either
        reconfigure(**{"HashInterned": reordered(events.HashInterned), name: record_type})
    from kvtrace.probes import CacheProbes

    probes = CacheProbes(print, HashInterner(), emit_hash_bytes=True)
    assert native.built.intern_hashes(probes, [b"a", b"b"], 0, 2, 16) == [0, 1]
    assert probes._records == [events.HashInterned(0, b"a"), events.HashInterned(1, b"b")]
    assert probes._depth == {0: 16, 1: 32}


def test_a_refused_configuration_turns_the_native_core_off(monkeypatch):
    """What the probes call: never raises (it runs inside vLLM), and says why the core is off."""
    from kvtrace.probes import wrappers

    monkeypatch.setattr(native, "core", native.built)
    monkeypatch.setattr(native, "problem", None)
    renamed = BAD_RECORD_TYPES["renamed"][1]
    native.configure(*(renamed if name == "BlockStored" else getattr(events, name)
                       for name in NATIVE_RECORD_TYPES),
                     wrappers._NO_REQ, wrappers._STALE_CHECKPOINT, wrappers._LRU_REUSE)
    assert native.core is None
    assert native.problem.startswith("kvtrace's native core is off: BlockStored has no field kind")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_stop_while_the_core_is_configured_is_not_swallowed(stop, monkeypatch):
    """A signal handler's exception raised while msgspec reads a record type's fields (a
    controller's SIGTERM at start-up, or the engine's own) reaches the caller as it is, and the
    core stays on: it was replaced by "is not a msgspec Struct", the core turned off and
    `kvtrace capture` went on capturing after its SIGTERM."""
    import msgspec.structs

    from kvtrace.probes import wrappers  # imported (and configured) before fields is replaced

    real_fields = msgspec.structs.fields

    def stopped_in(record_type):
        if record_type is events.BlockStored:
            raise stop
        return real_fields(record_type)

    monkeypatch.setattr(msgspec.structs, "fields", stopped_in)
    monkeypatch.setattr(native, "core", native.built)
    monkeypatch.setattr(native, "problem", None)
    with pytest.raises(stop):
        native.configure(*(getattr(events, name) for name in NATIVE_RECORD_TYPES),
                         wrappers._NO_REQ, wrappers._STALE_CHECKPOINT, wrappers._LRU_REUSE)
    assert native.core is native.built and native.problem is None


def test_native_wrappers_never_raise_into_vllm_and_count_the_failure(vllm_backend_class):
    """A sink that raises: the engine's answers are unchanged and the failure is counted."""
    from kvtrace.probes import CacheProbes

    def broken_sink(records):
        raise RuntimeError("sink broke")

    answers = []
    for armed in (False, True):
        with vllm_backend_class(seed_config(0), "fixed", None) as backend:
            probes = CacheProbes(print, HashInterner(), sink_many=broken_sink)
            if armed:
                probes.arm()
            try:
                backend.add_request(1, 240, list(range(15)), 8)
                prefill_chunks(backend, 1, [128, 112])
                answers.append(backend.num_free_blocks())
                assert patched_kinds() == ({"FastWrapper"} if armed else {"function"})
            finally:
                probes.disarm()
    assert answers[0] == answers[1]
    assert probes.num_failures >= 1  # each step's hand-over failed, and said so


def test_step_buffer_batches_and_overflows_as_its_python_twin(monkeypatch):
    """Capacity 5, batches of 3 records, steps of 2, 2, 3 records, a drain, then 1, 1, 4
    (worked out by hand below)."""
    from kvtrace.capture import hook

    monkeypatch.setattr(hook.time, "time_ns", lambda: 7)  # the drop marker's stamp
    steps = [[StepStarted(i, i)] * size for i, size in enumerate([2, 2, 3, 1, 1, 4])]
    outcomes = []
    for step_buffer in (hook.StepBuffer, native.built.StepBuffer):
        session = hook.CaptureSession(hook.CaptureOptions(path="unused", buffer_capacity=5))
        session._steps = buffer = step_buffer(encode_rows, 5, session._overflow, 3, 60.0)
        drained = []
        for i, records in enumerate(steps):
            buffer(records)
            if i == 2:  # the writer takes what is there
                drained = buffer.chunks[:]
                del buffer.chunks[:]
                buffer.num_drained = buffer.num_buffered
        outcomes.append((drained, list(buffer.chunks), buffer.num_buffered,
                         buffer.num_enqueued, buffer.unmarked_drops, session.num_dropped))
    assert outcomes[0] == outcomes[1]
    drained, chunks, num_buffered, num_enqueued, unmarked, dropped = outcomes[0]
    # Steps 0 and 1 fit (4 of 5) and make a batch of 4 >= 3; step 2 keeps 1 and drops 2.
    assert drained == [(4, encode_rows(steps[0] + steps[1])), (1, encode_rows(steps[2][:1]))]
    # After the drain, step 3 comes behind a marker of those 2; step 4 waits for a batch until
    # step 5 overflows (room for 2 of 4: 5 - 3 held) and sends it ahead.
    assert chunks == [(1, encode_rows([EventsDropped(2, 7)])), (1, encode_rows(steps[3])),
                      (1, encode_rows(steps[4])), (2, encode_rows(steps[5][:2]))]
    assert (dropped, unmarked) == (4, 2)
    assert (num_enqueued, num_buffered) == (2 + 2 + 1 + 1 + 1 + 2, 10)


def test_step_buffer_encodes_what_waited_too_long(monkeypatch):
    """A trickle (an idle engine) is encoded once its oldest record has waited max_delay_s."""
    from kvtrace.capture import hook

    for step_buffer in (hook.StepBuffer, native.built.StepBuffer):
        buffer = step_buffer(encode_rows, 100, print, 1000, 0.05)
        buffer([StepStarted(1, 1)])
        assert buffer.chunks == []
        time.sleep(0.06)
        buffer([StepStarted(2, 2)])
        assert buffer.chunks == [(2, encode_rows([StepStarted(1, 1), StepStarted(2, 2)]))]


def test_native_frames_are_byte_for_byte_the_python_frames(tmp_path, monkeypatch):
    """Pre-encoded rows written through ``write_rows_frame`` (lock released) and in Python."""
    stored = [BlockStored(i, i * 7, 1, 16 * i, 0, 3) for i in range(5000)]
    sampled = [GpuSampled(1, 0, 2, 3, 4)] * 40  # a chunk of more than 15 rows: array16 header
    chunks = [(len(stored[i:i + 3]), encode_rows(stored[i:i + 3])) for i in range(0, 5000, 3)]
    chunks.append((40, encode_rows(sampled)))
    records = stored + sampled
    header = TraceHeader(kvtrace_version="test", created_ns=1, source="capture")
    monkeypatch.setattr(time, "time_ns", lambda: 2)  # the closing frame's end time
    files = {}
    for name, core in (("python", None), ("native", native.built)):
        monkeypatch.setattr(native, "core", core)
        path = tmp_path / f"{name}.kvtrace"
        with TraceWriter(str(path), header, rows=True, batch_size=2048) as writer:
            assert writer.write_encoded_rows(chunks) == len(records)
        files[name] = path.read_bytes()
    assert files["python"] == files["native"]
    reader, read = read_records(tmp_path / "native.kvtrace")
    assert read == records and not reader.truncated


def test_native_frames_checksum_as_zlib(tmp_path):
    rows = [(1, encode_rows([StepStarted(1, 2)])), (20, encode_rows([StepStarted(3, 4)] * 20))]
    path = tmp_path / "frame"
    with open(path, "wb") as out:
        assert native.built.write_rows_frame(out.fileno(), rows) == 21
    data = path.read_bytes()
    payload = b"R\xdd" + (21).to_bytes(4, "big") + rows[0][1][1:] + rows[1][1][3:]
    assert int.from_bytes(data[:4], "little") == len(payload)
    assert int.from_bytes(data[4:8], "little") == zlib.crc32(payload)
    assert data[8:] == payload


def test_native_frames_refuse_what_is_not_encoded_rows(tmp_path):
    with open(tmp_path / "frame", "wb") as out:
        for chunks in ([(2, encode_rows([StepStarted(1, 2)]))], [(1, b"\xc0")], [b"R"]):
            with pytest.raises(ValueError, match="encode_rows"):
                native.built.write_rows_frame(out.fileno(), chunks)
    assert (tmp_path / "frame").read_bytes() == b""


def test_native_frames_report_a_failed_write():
    with open("/dev/full", "wb") as full:
        with pytest.raises(OSError, match="No space left"):
            native.built.write_rows_frame(full.fileno(), [(1, encode_rows([StepStarted(1, 2)]))])


def test_kvtrace_native_0_turns_the_native_core_off():
    code = "from kvtrace import native; print(native.core is None, native.built is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "KVTRACE_NATIVE": "0"}).stdout
    assert out.split() == ["True", "True"]


UNUSABLE_CORES = {
    # As on a machine that could not compile it: the import fails.
    "not built": ("""
sys.modules["kvtrace._native"] = None
""", "object", None),
    # A schema the core cannot build by field name (a field renamed): configure() refuses it.
    "refused schema": ("""
import msgspec
from kvtrace import events
events.BlockStored = msgspec.defstruct(
    "BlockStored", [("block_id", int), ("hash_id", int), ("group", int), ("num_tokens", int),
                    ("store_kind", int), ("req", int)],
    bases=(events.Record,), tag="block_stored")
""", "ProbeState", "kvtrace's native core is off: BlockStored has no field kind, which the native "
    "core supplies. The probes run as pure Python (slower); kvtrace/events.py and "
    "csrc/kvtrace_native.h must name the same record fields."),
}


@pytest.mark.parametrize("case", [
    "not built", pytest.param("refused schema", marks=pytest.mark.slow)])
def test_without_a_usable_core_the_python_twins_capture(tmp_path, case):
    """The process goes on with the Python twins, and captures still work."""
    setup, probes_base, problem = UNUSABLE_CORES[case]
    code = f"""
import sys
{setup}
from kvtrace import native
from kvtrace.capture import hook
from kvtrace.probes import CacheProbes
from kvtrace.replay.vllm_backend import VllmBackend
sys.path.insert(0, {os.path.dirname(__file__)!r})
from vllm_support import prefill_chunks, seed_config
assert native.core is None and CacheProbes.__mro__[1].__name__ == {probes_base!r}
assert native.problem == {problem!r}, native.problem
with VllmBackend(seed_config(0), "fixed", None) as backend:
    hook.arm(hook.CaptureOptions(path={str(tmp_path / 'cap.kvtrace')!r}, gpu_interval_ms=0))
    backend.add_request(1, 240, list(range(15)), 8)
    prefill_chunks(backend, 1, [128, 112])
    print(hook.disarm()["written"])
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) > 10
    _, records = read_records(tmp_path / "cap.kvtrace")
    assert any(isinstance(r, BlockStored) for r in records)
