"""Issue #32, live figures: following a trace as it is written (a file, a ring directory), the
figures `kvtrace top` shows against the offline queries over the same records, memory bounded
over hours, the feed rate, and the Prometheus endpoint."""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from kvtrace.analysis import stream
from kvtrace.analysis.database import open_database
from kvtrace.analysis.live import Figures, HotPrefix, LiveFigures, LiveSource
from kvtrace.analysis.load import load_traces
from kvtrace.analysis.metrics_http import CONTENT_TYPE, MetricsServer, exposition
from kvtrace.analysis.queries import run_query
from kvtrace.analysis.trace_tail import NothingToTailError, TraceTail
from kvtrace.cli import cli
from kvtrace.errors import KvtraceError, TraceFormatError, UnsafePathError
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockState,
    BlockStored,
    BlockTouched,
    ComputedBlocksFound,
    FreeQueueState,
    KeyCached,
    RemoveReason,
    RequestArrived,
    RequestFinished,
    SlotsAllocated,
    SnapshotEnded,
    SnapshotStarted,
    StepStarted,
    StoreKind,
)
from kvtrace.ring import segment_name
from kvtrace.ring_join import records_from
from kvtrace.traceio import HeaderCutError, TraceReader, TraceWriter, read_records

SESSION = 10**18


def replayed(directory: Path, requests: int) -> Path:
    """An agent workload replayed under `unfixed` (model backend): lookups, evictions, transient
    checkpoints and pushouts, in a trace that ends with some still cached."""
    runner = CliRunner()
    workload = directory / "agent.kvtrace"
    for argv in (["synth", "--preset", "agent", "--requests", str(requests), "-o", str(workload)],
                 ["replay", str(workload), "--variant", "unfixed", "--backend", "model",
                  "-o", str(directory / "runs")]):
        result = runner.invoke(cli, argv)
        assert result.exit_code == 0, result.output
    return directory / "runs" / "agent.unfixed.kvtrace"


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Path:
    return replayed(tmp_path_factory.mktemp("agent"), 300)


@pytest.fixture(scope="module")
def agent_records(agent) -> tuple:
    """The agent trace's header and records, typed as a live capture writes them (records read
    back from columns hold their bools as ints, which row batches refuse)."""
    reader, records = read_records(agent)
    return reader.header, [msgspec.convert(msgspec.to_builtins(record), type(record),
                                           strict=False) for record in records]


@pytest.fixture(scope="module")
def agent_db(agent, tmp_path_factory):
    db = tmp_path_factory.mktemp("agent-db") / "agent.duckdb"
    load_traces([agent], db)
    connection = open_database(db)
    yield connection
    connection.close()


@pytest.fixture(params=["C core", "Python twins"])
def twin(request, monkeypatch):
    if request.param == "C core":
        if stream.core is None:
            pytest.skip("kvtrace's C core is not built here (no C compiler at install)")
    else:
        monkeypatch.setattr(stream, "core", None)
    return request.param


def fed(path: Path, **options) -> LiveFigures:
    """A whole trace fed to LiveFigures, batch by batch."""
    reader = TraceReader(str(path))
    live = LiveFigures(reader.header, str(path), **options)
    for batch in reader.batches():
        live.feed(batch)
    return live


def records_of(batches) -> list:
    return [record for batch in batches for record in batch.records()]


# --- TraceReader.new_batches and TraceTail on a growing file ---------------------------------


def test_a_growing_trace_is_read_frame_by_frame_and_resumed_where_it_stopped(agent, tmp_path):
    """Appended at arbitrary byte offsets (mid-frame, mid-header), the tail hands over exactly
    the records of the whole frames written, each once, in order, numbered as one stream."""
    data = agent.read_bytes()
    _, everything = read_records(agent)
    path = tmp_path / "growing.kvtrace"
    path.write_bytes(data[:5])  # not even the magic bytes yet
    tail = TraceTail(path)
    assert tail.header is None and isinstance(tail.waiting, HeaderCutError)
    assert tail.poll() == []
    got, seqs = [], []
    header_end = 12 + 8 + int.from_bytes(data[12:16], "little")  # preamble, frame head, body
    cuts = [40, header_end - 1, header_end, header_end + 7, 50_000, 300_000, 300_001,
            len(data) - 3, len(data)]
    written = 5
    for cut in cuts:
        with open(path, "ab") as file:
            file.write(data[written:cut])
        written = cut
        batches = tail.poll()
        seqs += [(batch.first_seq, len(batch)) for batch in batches]
        got += records_of(batches)
        if tail.header is None:  # still cut inside the header
            assert got == [] and cut < header_end
            continue
        assert got == list(TraceReader(str(path)))  # every whole frame written so far
        assert tail.num_records == len(got)
    assert got == everything and tail.header is not None and tail.complete
    assert [first for first, _ in seqs] == [sum(n for _, n in seqs[:i]) for i in range(len(seqs))]
    tail.close()


def test_a_poll_takes_at_most_max_batches_and_the_next_goes_on(agent, tmp_path):
    tail = TraceTail(agent)
    first = tail.poll(max_batches=2)
    rest = tail.poll()
    assert len(first) == 2 and records_of(first + rest) == read_records(agent)[1]


def test_the_writer_of_a_live_capture_is_followed_as_it_flushes(tmp_path, agent_records):
    header, records = agent_records
    path = tmp_path / "live.kvtrace"
    writer = TraceWriter(path, header, rows=True, batch_size=1000)
    tail = TraceTail(path)
    got = []
    for start in range(0, len(records), 20_000):
        writer.write_many(records[start:start + 20_000])
        writer.flush()
        got += records_of(tail.poll())
        assert got == records[:start + 20_000] and not tail.complete
    writer.close()
    assert tail.poll() == [] and tail.complete


# --- TraceTail on a ring directory ------------------------------------------------------------


def keyframe(ts_ns: int) -> list:
    """A keyframe whose state would change the figures if it were not skipped: a key cached on
    two blocks, one block held, a request in flight."""
    return [SnapshotStarted(ts_ns, 99, 0, 1), FreeQueueState([3, 2]),
            BlockState(2, 0, 777, 0, 384), BlockState(5, 1, -1, 0, 0),
            KeyCached(777, 0, 384, [2, 3]), SnapshotEnded(1000)]


def write_segment(directory: Path, seq: int, header, records: list, *, closed: bool = True,
                  with_keyframe: bool = True) -> TraceWriter:
    """Segment ``seq`` of the session: a keyframe that spans two frames, then ``records``."""
    header = msgspec.structs.replace(header, created_ns=SESSION, source="capture")
    writer = TraceWriter(directory / segment_name(SESSION, seq), header, rows=True,
                         batch_size=500)
    if with_keyframe:
        frame = keyframe(seq)
        writer.write_many(frame[:3])
        writer.flush_batch()
        writer.write_many(frame[3:])
    writer.write_many(records)
    writer.flush()
    if closed:
        writer.close()
    return writer


def test_a_ring_is_followed_segment_after_segment_past_their_keyframes(agent, agent_records,
                                                                       tmp_path):
    """Four segments of one session, the third still being written when the tail starts: the
    tail gives the records of every segment in order, less the keyframes of the second one on
    (each spans two frames), numbered as one stream; a segment removed once read is no
    trouble; the figures equal the whole trace's."""
    header, records = agent_records
    parts = [records[i * len(records) // 4:(i + 1) * len(records) // 4] for i in range(4)]
    ring = tmp_path / "ring"
    ring.mkdir(mode=0o700)
    write_segment(ring, 1, header, parts[0], with_keyframe=False)
    write_segment(ring, 2, header, parts[1])
    half = len(parts[2]) // 2
    third = write_segment(ring, 3, header, parts[2][:half], closed=False)
    tail = TraceTail(ring)
    batches = tail.poll()
    assert records_of(batches) == parts[0] + parts[1] + parts[2][:half]
    assert tail.path == str(ring / segment_name(SESSION, 3))
    (ring / segment_name(SESSION, 1)).unlink()  # the engine pruned it: it was read already
    third.write_many(parts[2][half:])
    third.close()
    write_segment(ring, 4, header, parts[3])
    batches += tail.poll()
    assert records_of(batches) == records and tail.gaps == 0
    assert [b.first_seq for b in batches] == [sum(map(len, batches[:i]))
                                             for i in range(len(batches))]
    live = LiveFigures(tail.header, str(ring))
    for batch in batches:
        live.feed(batch)
    assert live.figures() == fed(agent).figures()
    tail.close()


def test_a_segment_pruned_before_it_was_reached_is_a_gap_not_an_error(agent_records, tmp_path):
    header, records = agent_records
    ring = tmp_path / "ring"
    ring.mkdir(mode=0o700)
    for seq in (1, 2, 3):
        write_segment(ring, seq, header, records[seq * 100:seq * 100 + 100])
    tail = TraceTail(ring)
    (ring / segment_name(SESSION, 2)).unlink()
    got = records_of(tail.poll())  # the first segment read keeps its keyframe
    assert got == keyframe(1) + records[100:200] + records[300:400] and tail.gaps == 1


def test_records_from_keeps_the_rest_of_a_batch_renumbered(agent):
    batch = next(TraceReader(str(agent)).batches())
    whole = list(batch.records())
    for start in (0, 1, 37, len(batch) - 1):
        rest = records_from(batch, start)
        assert list(rest.records()) == whole[start:] and rest.first_seq == start
        assert len(rest.kinds) == len(batch) - start
    assert records_from(batch, len(batch)) is None


# --- what the tail refuses --------------------------------------------------------------------


def test_bad_sources_are_one_error_with_a_hint(agent, tmp_path):
    (tmp_path / "garbage.kvtrace").write_bytes(os.urandom(64))
    with pytest.raises(TraceFormatError, match="not a kvtrace trace"):
        TraceTail(tmp_path / "garbage.kvtrace")
    data = bytearray(agent.read_bytes())
    data[2000] ^= 0xFF  # inside the first batch frame
    (tmp_path / "corrupt.kvtrace").write_bytes(bytes(data))
    tail = TraceTail(tmp_path / "corrupt.kvtrace")
    with pytest.raises(TraceFormatError, match="byte offset"):
        tail.poll()
    with pytest.raises(NothingToTailError, match="no such trace") as missing:
        TraceTail(tmp_path / "missing.kvtrace")
    assert isinstance(missing.value, KvtraceError) and missing.value.hint
    (tmp_path / "ring").mkdir(mode=0o700)
    with pytest.raises(NothingToTailError, match="holds no ring segment yet") as empty:
        TraceTail(tmp_path / "ring")
    assert "kvtrace capture --ring" in empty.value.hint


@pytest.mark.parametrize("kind", ["link", "fifo", "open ring", "link in a ring", "owner"])
def test_what_another_user_could_have_planted_is_refused_unread(agent, tmp_path, kind):
    target = tmp_path / "t.kvtrace"
    if kind == "link":
        os.symlink(agent, target)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind in ("open ring", "link in a ring"):
        target = tmp_path / "ring"
        target.mkdir(mode=0o700)
        if kind == "open ring":
            write_segment(target, 1, TraceReader(str(agent)).header, [])
            target.chmod(0o777)
        else:
            os.symlink(agent, target / segment_name(SESSION, 1))
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        target.write_bytes(agent.read_bytes())
        os.chown(target, 4242, -1)
    with pytest.raises(UnsafePathError) as refused:
        TraceTail(target)
    assert refused.value.hint
    if kind == "owner":  # unless the caller trusts that user (top --pid: the engine's)
        assert TraceTail(target, owners=(0, 4242)).header is not None


# --- the figures against the offline analysis ---------------------------------------------------


def assert_offline(figures: Figures, connection) -> None:
    """Every whole-trace figure equals what the shipped queries and tables say."""
    result = run_query(connection, "counter_reconciliation")
    (counters,) = [dict(zip(result.columns, row)) for row in result.rows]
    assert (figures.lookups, figures.query_tokens, figures.hit_tokens) == (
        counters["admitted_first_lookups"], counters["query_tokens"], counters["hit_tokens"])
    assert figures.hit_rate == pytest.approx(counters["hit_rate"])
    assert figures.pushouts == len(run_query(connection, "checkpoint_pushouts").rows)
    hot = connection.execute("""
        SELECT hash_id, count(*), count(*) FILTER (WHERE transient_cached >= 1),
               max(num_tokens)
        FROM cache_entries WHERE removed_reason = 'LRU_REUSE' AND hits >= 2
        GROUP BY hash_id ORDER BY 2 DESC, 1 LIMIT 10""").fetchall()
    assert [tuple(msgspec.structs.astuple(p)) for p in figures.hot_evicted] == hot
    misses = dict(connection.execute("SELECT cause::VARCHAR, sum(tokens) FROM miss_attribution "
                                     "WHERE lookup = 1 GROUP BY cause").fetchall())
    assert {c: t for c, t in figures.misses_by_cause.items() if t} == \
        {c: t for c, t in misses.items() if t}
    assert figures.hit_tokens + sum(figures.misses_by_cause.values()) == figures.query_tokens
    occupancy = run_query(connection, "cache_occupancy")
    last = dict(zip(occupancy.columns, occupancy.rows[-1]))
    assert (figures.transient_checkpoints, figures.pool_blocks) == (
        last["transient_checkpoint"], last["pool_blocks"])
    assert figures.checkpoint_share == figures.transient_checkpoints / figures.pool_blocks
    (newest,) = connection.execute("SELECT max(ts_ns) FROM step_started").fetchone()
    assert round(figures.ts_s * 1e9) == newest


def test_a_whole_trace_gives_the_offline_figures(agent, agent_db, twin):
    figures = fed(agent, window_s=1e9).figures()
    assert figures.pushouts and figures.transient_checkpoints and figures.hot_evicted
    assert figures.misses_by_cause["checkpoint_pushout"]
    assert_offline(figures, agent_db)


def test_a_capture_with_a_start_snapshot_gives_the_offline_figures(tmp_path, twin):
    """tests/test_snapshot_analysis.py's mid-flight capture: a key cached at the start, hit
    three times, then evicted (a hot eviction, no pushout); requests in flight whose lookups
    count as the view counts them."""
    from test_snapshot_analysis import HEADER, S, records

    from kvtrace.traceio import write_trace

    path = tmp_path / "capture.kvtrace"
    write_trace(path, HEADER, records())
    figures = fed(path, window_s=1e9).figures()
    assert figures.lookups == 4 and figures.pushouts == 0
    assert figures.hot_evicted == [HotPrefix(S, 2, 0, 16)]
    load_traces([path], tmp_path / "capture.duckdb")
    connection = open_database(tmp_path / "capture.duckdb")
    try:
        assert_offline(figures, connection)
    finally:
        connection.close()


def test_the_windows_are_the_offline_rates_of_the_last_minutes(agent, agent_db):
    """Hit rate and pushouts over the last 20 s of trace time, and the hit rate per 30 s, as
    SQL computes them from the lookups' and the pushouts' steps."""
    figures = fed(agent, window_s=20, interval_s=30, history=4).figures()
    newest = round(figures.ts_s * 1e9)
    since = newest - 20 * 10**9
    hit, query = agent_db.execute("""
        SELECT sum(l.num_hit_tokens), sum(l.num_query_tokens)
        FROM lookups l JOIN step_started s ON s.run = l.run AND s.step = l.step
        WHERE l.admission = 1 AND s.ts_ns > ?""", [since]).fetchone()
    assert query and figures.hit_rate == pytest.approx(hit / query)
    intervals = {index: (count, hit / query) for index, count, hit, query in agent_db.execute("""
        SELECT s.ts_ns // 30000000000, count(*), sum(l.num_hit_tokens), sum(l.num_query_tokens)
        FROM lookups l JOIN step_started s ON s.run = l.run AND s.step = l.step
        WHERE l.admission = 1 GROUP BY 1""").fetchall()}
    last = newest // (30 * 10**9)
    assert [(p.start_s, p.lookups, p.hit_rate) for p in figures.hit_rate_history] == [
        (index * 30.0, *intervals.get(index, (0, None))) for index in range(last - 3, last + 1)]
    assert sum(p.lookups for p in figures.hit_rate_history) > 0
    step_ns = dict(agent_db.execute("SELECT step, ts_ns FROM step_started").fetchall())
    pushouts = run_query(agent_db, "checkpoint_pushouts")
    evicted = pushouts.columns.index("evicted_step")
    recent = sum(step_ns[row[evicted]] > since for row in pushouts.rows)
    assert recent and figures.pushouts_per_min == pytest.approx(recent * 60 / 20)


# --- memory over hours, and speed ------------------------------------------------------------


def long_stream(steps: int) -> list:
    """A step a second: a request hits block 1's prefix, stores a prefix of its own on a block
    that two more requests hit, and evicts the one stored ten steps before (so every step one
    hot prefix of its own is evicted); prefix 1 on block 1 is evicted and re-stored every
    tenth step, the most evicted of all."""
    records = [StepStarted(0, 0), BlockAllocated(1, -1), BlockStored(1, 1, 0, 16,
                                                                       StoreKind.FULL, -1)]
    for step in range(1, steps):
        block = 2 + step % 10
        records += [StepStarted(step, step * 10**9), RequestArrived(step, 32, [1, step], 1),
                    ComputedBlocksFound(step, 16, 0),
                    SlotsAllocated(step, 16, 0, 16, 0, 0, 32, True), BlockTouched(1, step)]
        if step > 10:
            records.append(BlockRemoved(block, 1000 + step - 10, 0, 32, RemoveReason.LRU_REUSE))
        records += [BlockAllocated(block, step),
                    BlockStored(block, 1000 + step, 0, 32, StoreKind.FULL, step),
                    BlockTouched(block, step), BlockTouched(block, step),
                    RequestFinished(step, 0), BlockFreed(block, 0, True), BlockFreed(1, 0, True)]
        if step % 10 == 0:
            records += [BlockRemoved(1, 1, 0, 16, RemoveReason.LRU_REUSE),
                        BlockStored(1, 1, 0, 16, StoreKind.FULL, step)]
    return records


def test_memory_stays_bounded_over_hours(tmp_path):
    """Three hours of trace time: the windows keep the last minute's steps and the history's
    intervals, the hot-prefix table at most its cap (the most evicted prefix exact), and the
    per-request state nothing of finished requests."""
    from test_snapshot_analysis import HEADER

    from kvtrace.traceio import write_trace

    steps = 3 * 3600
    path = tmp_path / "long.kvtrace"
    config = msgspec.structs.replace(HEADER.config, num_gpu_blocks=13)
    write_trace(path, msgspec.structs.replace(HEADER, config=config), long_stream(steps))
    live = fed(path, max_prefixes=64, history=5)
    figures = live.figures()
    assert len(live._window) <= 61 and len(live._intervals) <= 5
    assert len(live._hot) <= 64 and len(live._blocks) <= 12
    assert not live._pending and not live._admissions and len(live._open) <= 11
    assert figures.hot_evicted[0] == HotPrefix(1, (steps - 1) // 10, 0, 16)
    assert figures.lookups == steps - 1 and figures.hit_rate == 0.5
    assert [p.lookups for p in figures.hit_rate_history] == [60] * 5


@pytest.mark.slow
def test_feeding_keeps_up_with_a_capture(tmp_path):
    """The feed rate on a long replay, printed (docs: kvtrace top); well above what a capture
    writes. Fails if it falls below a floor that no regression should cross."""
    path = replayed(tmp_path, 4000)
    reader = TraceReader(str(path))
    batches = list(reader.batches())
    live = LiveFigures(reader.header, str(path))
    started = time.perf_counter()
    for batch in batches:
        live.feed(batch)
    elapsed = time.perf_counter() - started
    rate = sum(map(len, batches)) / elapsed
    print(f"\nLiveFigures.feed: {sum(map(len, batches)):,} records in {elapsed:.2f} s, "
          f"{rate:,.0f} records/s (C core: {stream.core is not None})")
    assert rate > 300_000


# --- the metrics endpoint -------------------------------------------------------------------------


SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
                    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*\})? (\S+)')


def parse_exposition(text: str) -> dict[str, tuple[str, dict[str, float]]]:
    """The text format 0.0.4, strictly: every family a HELP then a TYPE line, then its
    samples; counters named ``_total``; names prefixed ``kvtrace_``. Returns name -> (type,
    {labels: value}); checked against prometheus_client's own parser too."""
    from prometheus_client.parser import text_string_to_metric_families

    assert text.endswith("\n")
    families: dict[str, tuple[str, dict[str, float]]] = {}
    current = None
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in families and lines[number + 1].startswith(f"# TYPE {name} ")
            current = None
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge") and name.startswith("kvtrace_")
            assert name.endswith("_total") == (kind == "counter")
            families[name] = (kind, {})
            current = name
        else:
            match = SAMPLE.fullmatch(line)
            assert match and match.group(1) == current, line
            families[current][1][match.group(2) or ""] = float(match.group(3))
    parsed = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if not sample.labels}
    assert {name: str(float(v)) for name, v in parsed.items()} == {
        name: str(values[""]) for name, (_, values) in families.items() if "" in values}
    return families


def scrape(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def value(families, name: str, labels: str = "") -> float:
    return families[name][1][labels]


def assert_served(families, figures: Figures) -> None:
    for name, expected in [
            ("kvtrace_records_total", figures.records), ("kvtrace_trace_time_seconds", figures.ts_s),
            ("kvtrace_first_admissions_total", figures.lookups),
            ("kvtrace_first_admission_query_tokens_total", figures.query_tokens),
            ("kvtrace_first_admission_hit_tokens_total", figures.hit_tokens),
            ("kvtrace_hit_rate", figures.hit_rate), ("kvtrace_pushouts_total", figures.pushouts),
            ("kvtrace_pushouts_per_minute", figures.pushouts_per_min),
            ("kvtrace_transient_checkpoint_blocks", figures.transient_checkpoints),
            ("kvtrace_checkpoint_share", figures.checkpoint_share)]:
        assert value(families, name) == pytest.approx(expected), name
    assert {labels: tokens for labels, tokens in families["kvtrace_missed_tokens_total"][1].items()} \
        == {f'{{cause="{cause}"}}': tokens for cause, tokens in figures.misses_by_cause.items()}


def scrape_until(url: str, name: str, expected: int, timeout: float = 30.0) -> tuple[str, str]:
    """Scrape until the sample ``name`` reads ``expected``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content_type, text = scrape(url)
        if f"{name} {expected}\n" in text:
            return content_type, text
        time.sleep(0.05)
    raise AssertionError(f"{name} never read {expected}: {text}")


def test_the_endpoint_serves_the_live_figures_of_a_growing_trace(agent_records, tmp_path):
    header, records = agent_records
    path = tmp_path / "live.kvtrace"
    writer = TraceWriter(path, header, rows=True, batch_size=2000)
    writer.write_many(records[:len(records) // 2])
    writer.flush()
    with MetricsServer(path, port=0, interval_s=0.05) as server:
        assert server.host == "127.0.0.1"
        seen = []
        for first in (True, False):
            written = len(list(TraceReader(str(path))))
            content_type, text = scrape_until(server.url, "kvtrace_records_total", written)
            assert content_type == CONTENT_TYPE
            families = parse_exposition(text)
            assert value(families, "kvtrace_up") == 1
            assert_served(families, fed(path).figures())
            seen.append(value(families, "kvtrace_first_admissions_total"))
            if first:
                writer.write_many(records[len(records) // 2:])
                writer.close()
        assert seen[0] < seen[1]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            scrape(server.url.replace("/metrics", "/"))


def test_the_endpoint_waits_for_a_ring_to_start(agent_records, tmp_path):
    ring = tmp_path / "ring"
    ring.mkdir(mode=0o700)
    with MetricsServer(ring, port=0, interval_s=0.05) as server:
        families = parse_exposition(scrape(server.url)[1])
        assert value(families, "kvtrace_up") == 0 and value(families, "kvtrace_records_total") == 0
        header, records = agent_records
        write_segment(ring, 1, header, records[:5000], with_keyframe=False)
        families = parse_exposition(scrape_until(server.url, "kvtrace_records_total", 5000)[1])
        assert value(families, "kvtrace_up") == 1
        assert value(families, "kvtrace_first_admissions_total") > 0


def test_a_port_in_use_is_one_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KvtraceError, match=f"port {port} is in use") as error:
            MetricsServer("unused.kvtrace", port=port)
        assert "another port" in error.value.hint


def test_a_source_top_updates_is_served_as_it_stands(agent):
    live = LiveSource(agent)
    with MetricsServer(live, port=0) as server:
        assert value(parse_exposition(scrape(server.url)[1]), "kvtrace_records_total") == 0
        while live.update(max_batches=4):
            pass
        assert_served(parse_exposition(scrape(server.url)[1]), fed(agent).figures())
    live.close()


def test_the_exposition_escapes_labels_and_says_nan_for_no_value():
    text = exposition(Figures(misses_by_cause={'a"b\\c\nd': 3}), up=False)
    assert 'kvtrace_missed_tokens_total{cause="a\\"b\\\\c\\nd"} 3\n' in text
    assert "kvtrace_hit_rate NaN\n" in text and "kvtrace_up 0\n" in text
    families = parse_exposition(text)
    assert families["kvtrace_hit_rate"][0] == "gauge"
