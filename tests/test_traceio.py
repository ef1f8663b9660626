"""The trace format: round trips, truncation recovery, corruption, evolution, versions."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import msgspec
import pytest
from trace_samples import frame_ends, one_of_each_kind, sample_header

from kvtrace.traceio import batches
from kvtrace.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from kvtrace.events import (
    BlocksCached,
    BlocksReleased,
    RECORD_TYPES,
    BlockTouched,
    HashInterner,
    Record,
    RequestArrived,
    SlotsAllocated,
    StepStarted,
    TraceHeader,
)
from kvtrace.traceio import TraceReader, TraceWriter, read_records, write_trace

GOLDEN = Path(__file__).parent / "data"


def write(path: Path, records, batch_size: int = 4, header: TraceHeader | None = None,
          rows: bool = False) -> Path:
    with TraceWriter(path, header or sample_header(), batch_size=batch_size, rows=rows) as writer:
        writer.write_many(records)
    return path


@pytest.mark.parametrize("rows", [False, True], ids=["columns", "rows"])
def test_every_record_kind_round_trips(tmp_path, rows):
    records = one_of_each_kind()
    assert {type(r) for r in records} == set(RECORD_TYPES), "a new kind needs a sample"
    reader, decoded = read_records(write(tmp_path / "t.kvtrace", records, batch_size=1000, rows=rows))
    assert decoded == records
    assert [type(r) for r in decoded] == [type(r) for r in records]
    assert reader.header == sample_header()
    assert reader.closing.num_records == len(records)
    assert reader.closing.counts == {r.__struct_config__.tag: 1 for r in records}
    assert not reader.truncated


@pytest.mark.parametrize("rows", [False, True], ids=["columns", "rows"])
def test_order_is_kept_across_interleaved_kinds_and_batches(tmp_path, rows):
    rng = random.Random(1)
    samples = one_of_each_kind()
    records = [rng.choice(samples) for _ in range(1000)]
    _, decoded = read_records(write(tmp_path / "t.kvtrace", records, batch_size=37, rows=rows))
    assert decoded == records


@pytest.mark.parametrize("value", [0, 127, 128, -129, 2**15, -(2**31) - 1, 2**63 - 1, -(2**63)])
def test_int_columns_choose_a_width_that_holds_every_value(tmp_path, value):
    records = [StepStarted(step=1, ts_ns=value), StepStarted(step=2, ts_ns=0)]
    _, decoded = read_records(write(tmp_path / "t.kvtrace", records))
    assert decoded == records


@pytest.mark.parametrize("rows", [False, True], ids=["columns", "rows"])
def test_truncation_at_every_offset_recovers_each_complete_frame(tmp_path, rows):
    records = one_of_each_kind()
    data = write(tmp_path / "full.kvtrace", records, batch_size=3, rows=rows).read_bytes()
    ends = frame_ends(data)
    header_end, batch_ends = ends[0], ends[1:-1]
    cut_path = tmp_path / "cut.kvtrace"
    for cut in range(len(data)):
        cut_path.write_bytes(data[:cut])
        if cut < header_end:
            with pytest.raises(TraceFormatError):
                TraceReader(str(cut_path))
            continue
        reader = TraceReader(str(cut_path))
        recovered = list(reader)
        complete_batches = sum(end <= cut for end in batch_ends)
        assert recovered == records[: 3 * complete_batches], f"cut at {cut}"
        assert reader.truncated and reader.closing is None, f"cut at {cut}"
    reader = TraceReader(str(write(tmp_path / "again.kvtrace", records, batch_size=3, rows=rows)))
    assert list(reader) == records and not reader.truncated


@pytest.mark.parametrize("rows", [False, True], ids=["columns", "rows"])
def test_random_corruption_raises_trace_format_error_or_recovers(tmp_path, rows):
    records = one_of_each_kind() * 5
    data = write(tmp_path / "t.kvtrace", records, batch_size=8, rows=rows).read_bytes()
    rng = random.Random(20261129)
    damaged_path = tmp_path / "damaged.kvtrace"
    outcomes = {"error": 0, "recovered": 0}
    for _ in range(1500):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        damaged_path.write_bytes(bytes(damaged[: rng.choice([len(damaged), rng.randrange(len(damaged))])]))
        try:
            recovered = list(TraceReader(str(damaged_path)))
        except TraceFormatError as error:
            assert str(damaged_path) in str(error)
            outcomes["error"] += 1
        else:
            # Whatever a reader accepts must be a prefix of what was written.
            assert recovered == records[: len(recovered)]
            outcomes["recovered"] += 1
    assert outcomes["error"] > 100 and outcomes["recovered"] > 10, outcomes


class FutureKind(Record, tag="future_kind"):
    family = "effect"
    block_id: int
    weight: int


class BlockTouchedV2(Record, tag="block_touched"):
    """A newer writer's BlockTouched with a field added at the end."""

    block_id: int
    req: int
    latency_ns: int = 0


class RequestArrivedV0(Record, tag="request_arrived"):
    """An older writer's RequestArrived, before the trailing defaulted fields existed."""

    req: int
    prompt_len: int
    hash_ids: list[int]
    max_tokens: int


@pytest.fixture
def extra_record_types(monkeypatch):
    for record_type in (FutureKind, BlockTouchedV2, RequestArrivedV0):
        monkeypatch.setitem(batches._FIELD_CODECS, record_type, batches._field_codecs(record_type))


@pytest.mark.parametrize("rows", [False, True], ids=["columns", "rows"])
def test_unknown_kinds_are_skipped_and_counted(tmp_path, extra_record_types, rows):
    records = [StepStarted(1, 2), FutureKind(3, 4), BlockTouched(5, 6), FutureKind(7, 8)]
    reader, decoded = read_records(write(tmp_path / "t.kvtrace", records, rows=rows))
    assert decoded == [StepStarted(1, 2), BlockTouched(5, 6)]
    assert reader.unknown_kinds == {"future_kind": 2}
    assert reader.num_records == 4 and not reader.truncated


@pytest.mark.parametrize("rows", [False, True], ids=["columns", "rows"])
def test_schema_evolution_new_trailing_fields_and_defaults(tmp_path, extra_record_types, rows):
    records = [BlockTouchedV2(5, 6, 999), RequestArrivedV0(0, 40, [1, 2], 8)]
    _, decoded = read_records(write(tmp_path / "t.kvtrace", records, rows=rows))
    assert decoded == [
        BlockTouched(5, 6),  # the unknown trailing field is ignored
        RequestArrived(0, 40, [1, 2], 8, arrival_ns=0, salt_id=0, request_id=""),  # defaults
    ]


def test_newer_major_version_is_refused_with_upgrade_hint(tmp_path):
    path = write(tmp_path / "t.kvtrace", one_of_each_kind())
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 8, 2)
    path.write_bytes(bytes(data))
    with pytest.raises(TraceVersionError) as caught:
        TraceReader(str(path))
    assert "v2" in str(caught.value) and "upgrade" in caught.value.hint.lower()


def test_newer_minor_version_still_reads(tmp_path):
    path = write(tmp_path / "t.kvtrace", one_of_each_kind())
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 10, 7)
    path.write_bytes(bytes(data))
    assert list(TraceReader(str(path))) == one_of_each_kind()


def test_golden_v1_trace_decodes():
    """Written by format 1.0: every kind of 1.0 (``blocks_released`` came in 1.1, the start
    snapshot's ``state`` kinds in 1.2, ``blocks_cached`` in 1.3), a later field (1.3's
    ``num_in_flight_tokens``) read as its default."""
    reader, decoded = read_records(GOLDEN / "golden-v1.kvtrace")
    assert reader.header == sample_header(format_minor=0)
    assert decoded == [
        msgspec.structs.replace(r, num_in_flight_tokens=0) if isinstance(r, SlotsAllocated)
        else r for r in one_of_each_kind()
        if not isinstance(r, (BlocksReleased, BlocksCached)) and r.family != "state"]
    assert reader.closing is not None and not reader.truncated


@pytest.mark.parametrize(
    "content, message",
    [(b"", "empty"), (b"garbage bytes here", "not a kvtrace trace"), (b"KVTRA", "before its header")],
)
def test_unreadable_files_raise_trace_format_error(tmp_path, content, message):
    path = tmp_path / "bad.kvtrace"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message):
        TraceReader(str(path))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(TraceNotFoundError):
        TraceReader(str(tmp_path / "nope.kvtrace"))
    with pytest.raises(TraceNotFoundError):
        TraceReader(str(tmp_path))


def test_atomic_writer_publishes_only_on_clean_close(tmp_path):
    path = tmp_path / "out.kvtrace"
    with pytest.raises(RuntimeError):
        with TraceWriter(path, sample_header(), atomic=True) as writer:
            writer.write(StepStarted(1, 1))
            raise RuntimeError("replay failed")
    assert list(tmp_path.iterdir()) == []
    write_trace(path, sample_header(), [StepStarted(1, 1)])
    assert [p.name for p in tmp_path.iterdir()] == ["out.kvtrace"]


def test_reader_streams_in_constant_memory(tmp_path):
    """Batches are decoded one at a time: a reader never holds more than one batch."""
    path = write(tmp_path / "t.kvtrace", [StepStarted(i, i) for i in range(10_000)], batch_size=100)
    reader = TraceReader(str(path))
    sizes = [len(batch) for batch in reader.batches()]
    assert sizes == [100] * 100


def test_writer_works_from_a_background_thread(tmp_path):
    import threading

    path = tmp_path / "t.kvtrace"
    records = [StepStarted(i, i) for i in range(5000)]

    def produce():
        with TraceWriter(path, sample_header(), batch_size=64) as writer:
            for record in records:
                writer.write(record)

    thread = threading.Thread(target=produce)
    thread.start()
    thread.join()
    assert read_records(path)[1] == records


def test_hash_interner_gives_dense_ids_in_order_of_first_appearance():
    interner = HashInterner()
    assert [interner.intern(h) for h in (b"a", b"b", b"a", b"c")] == [
        (0, True), (1, True), (0, False), (2, True)]
    assert len(interner) == 3


def test_header_is_map_encoded_so_fields_can_be_added():
    encoded = msgspec.msgpack.encode(sample_header())
    assert isinstance(msgspec.msgpack.decode(encoded), dict)
