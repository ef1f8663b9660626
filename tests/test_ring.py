"""Issue #32, the flight recorder: a ring directory's segments, the engine's pruning, `kvtrace
dump`, the trigger; and, on a serving `kvtrace engine`, a 20 s ring that stops growing, a dump
taken while it records that verifies in lockstep, and a trigger that catches a collapse."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from bad_traces import (
    batch_frame,
    closing_frame,
    header,
    header_frame,
    ring,
    trace,
    write_frames,
)
from click.testing import CliRunner

from kvtrace.analysis.trigger import TriggerError, TriggerWatch, parse_trigger
from kvtrace.capture.dump import Keyframe, Ring, RingError, choose, dump
from kvtrace.capture.recorder import RingFiles
from kvtrace.cli import cli
from kvtrace.errors import UnsafePathError
from kvtrace.events import BlockState, SnapshotEnded, SnapshotStarted, StepStarted
from kvtrace.ring import list_segments, parse_segment_name, segment_name
from kvtrace.traceio import count_kinds, read_records

SESSION = 10**18


def test_segment_names_sort_by_time_and_other_files_are_not_segments(tmp_path):
    names = [segment_name(SESSION + 5, 2), segment_name(SESSION, 10), segment_name(SESSION, 9)]
    for name in names + ["notes.txt", "ring-1-1.kvtrace", "incident.kvtrace"]:
        (tmp_path / name).write_bytes(b"")
    assert [(s.session, s.seq) for s in list_segments(tmp_path)] == [
        (SESSION, 9), (SESSION, 10), (SESSION + 5, 2)]
    assert parse_segment_name("ring-1-1.kvtrace") is None


def make_segments(directory: Path, ages_s: list[float], size: int = 1000) -> list[str]:
    """Segments of one session, oldest first, last written ``ages_s`` ago."""
    names = []
    for seq, age_s in enumerate(ages_s, 1):
        name = segment_name(SESSION, seq)
        (directory / name).write_bytes(b"x" * size)
        stamp = time.time() - age_s
        os.utime(directory / name, (stamp, stamp))
        names.append(name)
    return names


def test_the_engine_removes_segments_older_than_the_ring_and_never_the_one_it_writes(tmp_path):
    ring_dir = tmp_path / "ring"
    files = RingFiles(str(ring_dir), SESSION, ring_s=20, max_bytes=0)
    assert ring_dir.stat().st_mode & 0o777 == 0o700
    names = make_segments(ring_dir, [60, 30, 21, 19, 5, 0])
    (ring_dir / "mine.txt").write_text("the operator's")
    os.symlink(ring_dir / names[0], ring_dir / segment_name(SESSION - 1, 1))
    files.seq = 6  # segment 6 is being written; old as it may look, it stays
    os.utime(ring_dir / names[5], (0, 0))
    files.prune()
    left = sorted(p.name for p in ring_dir.iterdir())
    assert left == sorted([segment_name(SESSION - 1, 1), *names[3:], "mine.txt"])
    assert files.num_removed == 3


def test_the_size_cap_removes_the_oldest_first(tmp_path):
    ring_dir = tmp_path / "ring"
    files = RingFiles(str(ring_dir), SESSION, ring_s=3600, max_bytes=3500)
    names = make_segments(ring_dir, [50, 40, 30, 20, 10])
    files.seq = 5
    files.prune()
    assert sorted(p.name for p in ring_dir.iterdir()) == names[2:]  # 3000 bytes <= 3500


def test_a_ring_directory_open_to_others_is_refused_by_the_engine(tmp_path):
    ring_dir = tmp_path / "ring"
    ring_dir.mkdir(mode=0o777)
    ring_dir.chmod(0o777)
    with pytest.raises(UnsafePathError, match="open to other users"):
        RingFiles(str(ring_dir), SESSION, ring_s=20, max_bytes=0)


def test_a_dump_is_the_first_segment_whole_then_the_others_past_their_keyframes(tmp_path):
    directory = ring(tmp_path / "ring", num_segments=3)
    written = dump(directory, tmp_path / "all.kvtrace")
    reader, records = read_records(tmp_path / "all.kvtrace")
    assert [type(r) for r in records] == [SnapshotStarted, SnapshotEnded, *[StepStarted] * 9]
    assert [r.step for r in records[2:]] == [10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert reader.closing is not None and not reader.truncated
    assert reader.header.params["dumped_from"] == str(directory)
    assert written.num_records == 11 and written.older_sessions == 0
    assert [k.segment.seq for k in written.keyframes] == [1, 2, 3]
    assert written.first_ns == SESSION and written.last_ns == SESSION + 2 * 10**9 + 2 * 10**8


def test_a_keyframe_over_several_batches_is_left_out_whole(tmp_path):
    """A large pool's keyframe spans batches (the writer cuts one every batch_size records):
    the dump leaves out all of a later segment's, as kvtrace top does (ring_join)."""
    directory = tmp_path / "ring"
    directory.mkdir(mode=0o700)
    for seq in (1, 2):
        keyframe = [SnapshotStarted(0, 0, 0, 0), BlockState(1, 0, -1, 0, 0),
                    BlockState(2, 0, -1, 0, 0), SnapshotEnded(1000)]
        write_frames(directory / segment_name(SESSION, seq),
                     header_frame(header(created_ns=SESSION, source="capture")),
                     batch_frame(keyframe[:2]), batch_frame(keyframe[2:]),
                     batch_frame([StepStarted(seq, seq * 10**9)]), closing_frame(5))
    dump(directory, tmp_path / "d.kvtrace")
    _, records = read_records(tmp_path / "d.kvtrace")
    assert [type(r) for r in records] == [SnapshotStarted, BlockState, BlockState,
                                          SnapshotEnded, StepStarted, StepStarted]


def test_the_last_keyframe_at_or_before_the_start_begins_the_dump():
    keyframes = [Keyframe(parse_segment_name(segment_name(SESSION, seq)), seq * 100)
                 for seq in (1, 2, 3, 4)]
    seqs = lambda chosen: [k.segment.seq for k in chosen]  # noqa: E731
    assert seqs(choose(keyframes, 250, None)) == [2, 3, 4]
    assert seqs(choose(keyframes, 200, None)) == [2, 3, 4]
    assert seqs(choose(keyframes, 50, None)) == [1, 2, 3, 4]  # older than the ring: all of it
    assert seqs(choose(keyframes, 150, 399)) == [1, 2, 3]
    assert seqs(choose(keyframes, None, None)) == [1, 2, 3, 4]


def test_a_restarted_ring_dumps_its_newest_capture_only(tmp_path):
    directory = ring(tmp_path / "ring", num_segments=2)
    trace(directory / segment_name(SESSION + 10**12, 1),
          [SnapshotStarted(0, 0, 0, 0), SnapshotEnded(1), StepStarted(0, 5)],
          header(created_ns=SESSION + 10**12, source="capture"))
    written = dump(directory, tmp_path / "new.kvtrace")
    assert written.older_sessions == 1 and written.num_records == 3
    result = CliRunner().invoke(cli, ["dump", str(directory), "-o", str(tmp_path / "c.kvtrace")])
    assert result.exit_code == 0 and "1 earlier capture(s)" in result.stderr


def test_a_segment_being_written_is_read_to_its_last_whole_frame(tmp_path):
    directory = ring(tmp_path / "ring", num_segments=2)
    newest = max(directory.iterdir())
    data = newest.read_bytes()
    newest.write_bytes(data[:-20])  # its closing frame not yet written: cut mid-frame
    written = dump(directory, tmp_path / "d.kvtrace")
    assert written.num_records == 8
    assert count_kinds(tmp_path / "d.kvtrace")["step_started"] == 6


@pytest.mark.parametrize("plant", ["open", "link", "dir link"])
def test_a_ring_another_user_could_have_changed_is_refused_unread(tmp_path, plant):
    directory = ring(tmp_path / "ring", num_segments=2)
    target = directory
    if plant == "open":
        directory.chmod(0o777)
    elif plant == "link":
        secret = tmp_path / "secret.kvtrace"
        os.rename(min(directory.iterdir()), secret)
        os.symlink(secret, directory / segment_name(SESSION, 1))
    else:
        target = tmp_path / "alias"
        os.symlink(directory, target)
    with pytest.raises((UnsafePathError, RingError)):
        dump(target, tmp_path / "out.kvtrace")
    assert not (tmp_path / "out.kvtrace").exists()


def test_a_directory_without_segments_says_so(tmp_path):
    (tmp_path / "ring").mkdir(mode=0o700)
    with pytest.raises(RingError, match="holds no segment yet"):
        Ring(tmp_path / "ring").keyframes()


@pytest.mark.parametrize("text, expected", [
    ("hit_rate < 0.2 for 60s", ("hit_rate", "<", 0.2, 60.0)),
    ("checkpoint_share>=.5 for 2m", ("checkpoint_share", ">=", 0.5, 120.0)),
    ("pushouts_per_min > 100", ("pushouts_per_min", ">", 100.0, 0.0)),
])
def test_triggers_parse(text, expected):
    trigger = parse_trigger(text)
    assert (trigger.figure, trigger.op, trigger.threshold, trigger.hold_s) == expected


@pytest.mark.parametrize("text", ["hit_rate < x", "tokens < 3", "hit_rate = 0.2",
                                  "hit_rate < 0.2 for 1d", ""])
def test_a_trigger_that_does_not_parse_says_how_to_write_one(text):
    with pytest.raises(TriggerError) as error:
        parse_trigger(text)
    assert "hit_rate < 0.2 for 60s" in error.value.hint


class Figures:
    def __init__(self, ts_s, hit_rate):
        self.ts_s, self.hit_rate = ts_s, hit_rate


def test_a_trigger_fires_once_the_condition_held_long_enough_then_waits_for_it_to_clear():
    watch = TriggerWatch(parse_trigger("hit_rate < 0.2 for 10s"))
    series = [(0, 0.5), (1, 0.1), (6, 0.1), (10, None), (11, 0.1), (20, 0.15), (21, 0.1),
              (30, 0.05), (31, 0.6), (32, 0.1), (42, 0.1)]
    fired = [ts for ts, rate in series if watch.update(Figures(ts, rate))]
    # None (no lookup) breaks the hold at 10; held again from 11, it fires at 21, not again at
    # 30; cleared at 31, held from 32, it fires again at 42.
    assert fired == [21, 42] and watch.num_fired == 2


# --- a ring on a serving engine -------------------------------------------------------------

RING_S, KEYFRAME_S, KEEP_S = 20, 1, 9
SWITCH = 300  # the collapse: requests from this one on share nothing


def collapsing_workload(path: Path) -> Path:
    """Shared prompts on Kimi-K3's cache (a hit rate near 60%), then, from request ``SWITCH``
    on, prompts that share nothing (near 0%): 600 requests over about 146 virtual seconds."""
    import dataclasses

    from kvtrace.workloads.synth import synthesize
    from kvtrace.workloads.workload import EngineShape, write_workload

    shape = EngineShape(model="kimi-k3")
    workload = synthesize("shared-prompt", 600, 0, shape.hash_block_size)
    unique = iter(range(10**12, 10**13))
    workload.requests[SWITCH:] = [dataclasses.replace(
        request, hash_ids=[next(unique) for _ in request.hash_ids],
        output_hash_ids=[next(unique) for _ in request.output_hash_ids])
        for request in workload.requests[SWITCH:]]
    write_workload(path, workload, shape)
    return path


def first_admission_hits(trace_path: Path) -> list[tuple[int, int, int]]:
    """(arrival ns, prompt tokens, hit tokens) of each request that arrived in the trace, at
    its first lookup, in arrival order."""
    from kvtrace.events import ComputedBlocksFound, RequestArrived

    arrived, hits = {}, {}
    for record in read_records(trace_path)[1]:
        if type(record) is RequestArrived:
            arrived[record.req] = (record.arrival_ns, record.prompt_len)
        elif type(record) is ComputedBlocksFound and record.req in arrived:
            hits.setdefault(record.req, record.num_hit_tokens)
    return sorted((*arrived[req], hit) for req, hit in hits.items())


def rate(rows) -> float:
    return sum(hit for _, _, hit in rows) / max(1, sum(prompt for _, prompt, _ in rows))


def ring_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("ring-*.kvtrace")
               if path.exists())


@pytest.mark.slow
def test_a_ring_on_a_serving_engine_stays_bounded_dumps_and_catches_a_collapse(tmp_path):
    """Issue #32, must show: on `kvtrace engine` serving for 90 s with a 20 s ring, the ring
    holds the last 20 s (plus the segment being written) and no more; a dump taken while it
    records verifies in lockstep at 100%; the trigger fires on shared prompts switching to
    unique ones, and its incident holds the collapse and verifies too."""
    from test_capture_live import kvtrace, lockstep_verify
    from test_midflight import serving_engine

    from kvtrace.capture import control
    from kvtrace.capture.messages import StatusRequest

    import socket
    import urllib.request

    workload = collapsing_workload(tmp_path / "w.kvtrace")
    speed = 146 / 84  # the workload's arrivals over 84 s of wall time
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ring_dir, incidents = tmp_path / "ring", tmp_path / "incidents"
    engine = serving_engine(workload, "--speed", f"{speed:.4f}")
    try:
        started = time.monotonic()
        time.sleep(6)  # a warm cache: the trigger watches a collapse, not the cold start
        capture = kvtrace("capture", "--pid", str(engine.pid), "--ring", f"{RING_S}s",
                          "--keyframe-every", f"{KEYFRAME_S}s", "--dir", str(ring_dir),
                          "--duration", "80s", "--trigger", "hit_rate < 0.2 for 2s",
                          "--live-window", "4s", "--keep-around", f"{KEEP_S}s",
                          "--incident-dir", str(incidents), "--metrics-port", str(port))
        samples = []  # (seconds into the capture, bytes written so far, bytes in the ring)
        dumped = None
        while capture.poll() is None:
            time.sleep(0.5)
            try:
                status = control.request(engine.pid, StatusRequest())
            except Exception:  # noqa: BLE001 - the capture ends meanwhile
                continue
            if status.armed and status.started_ns:
                samples.append((time.time() - status.started_ns / 1e9, status.bytes,
                                ring_bytes(ring_dir)))
            if dumped is None and samples and samples[-1][0] > 30:
                dumped = CliRunner().invoke(cli, ["dump", str(ring_dir), "--last", "10s",
                                                  "-o", str(tmp_path / "mid.kvtrace")])
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as page:
                    scraped = dict(line.rsplit(" ", 1) for line in page.read().decode()
                                   .splitlines() if line.startswith("kvtrace_") and "{" not in line)
        out, err = capture.communicate(timeout=60)
        assert capture.returncode == 0, err
        assert time.monotonic() - started > 85  # it served throughout
        assert engine.process.poll() is None
    finally:
        engine.stop()
    # Bounded: past its first 20 s, the ring holds what the engine wrote in the last 20 s and
    # the segment being written (a keyframe interval), up to the pruning's lag; never all of it.
    full = [sample for sample in samples if sample[0] > RING_S + 5]
    assert len(full) > 80, samples
    for elapsed, written, in_ring in full:
        written_before = [w for t, w, _ in samples if t <= elapsed - RING_S - 3 * KEYFRAME_S]
        assert in_ring <= written - max(written_before), (elapsed, samples)
    assert full[-1][2] < full[-1][1] / 2
    assert len(list(ring_dir.glob("ring-*"))) <= RING_S // KEYFRAME_S + 3
    # The live figures were served while it recorded.
    assert scraped["kvtrace_up"] == "1" and float(scraped["kvtrace_first_admissions_total"]) > 50
    # A dump taken while the ring recorded replays in lockstep at 100%.
    assert dumped.exit_code == 0, dumped.output
    fidelity = lockstep_verify(tmp_path / "mid.kvtrace", tmp_path / "mid-fidelity")
    assert fidelity["matched"] == fidelity["total"] > 1000, fidelity
    # The trigger fired once, at the collapse; the incident holds both sides of it.
    written = sorted(incidents.glob("incident-*.kvtrace"))
    assert len(written) == 1 and err.count("trigger 'hit_rate < 0.2 for 2s' fired") == 1, err
    rows = first_admission_hits(written[0])
    assert rate(rows[:len(rows) // 4]) > 0.3 and rate(rows[-len(rows) // 4:]) < 0.05, rows
    assert read_records(written[0])[0].header.params["ring_s"] == f"{RING_S:g}"
    fidelity = lockstep_verify(written[0], tmp_path / "incident-fidelity")
    assert fidelity["matched"] == fidelity["total"] > 1000, fidelity


@pytest.mark.slow
def test_a_restarted_controller_resumes_the_ring(tmp_path):
    """A recorder's controller that stops and starts again (a service restarted) arms a new
    capture into the same directory: the earlier capture's segments stay until they age out
    of the ring, and a dump takes the newest capture's."""
    from test_capture_live import kvtrace
    from test_midflight import documents_workload, serving_engine

    workload = documents_workload(tmp_path / "w.kvtrace", "kimi-k3", num_requests=1200)
    ring_dir = tmp_path / "ring"
    engine = serving_engine(workload)
    try:
        time.sleep(2)
        sessions = []
        for seconds in (4, 10):
            capture = kvtrace("capture", "--pid", str(engine.pid), "--ring", "6s",
                              "--keyframe-every", "1s", "--dir", str(ring_dir),
                              "--duration", f"{seconds}s")
            time.sleep(2.5)
            sessions.append({segment.session for segment in list_segments(ring_dir)})
            out, err = capture.communicate(timeout=60)
            assert capture.returncode == 0, err
        written = dump(ring_dir, tmp_path / "d.kvtrace")
    finally:
        engine.stop()
    first, = sessions[0]
    assert sessions[1] == {first, max(sessions[1])} and max(sessions[1]) > first
    # By the end of the second capture the first one's segments, last written over 6 s
    # before, have left the ring.
    assert {segment.session for segment in list_segments(ring_dir)} == {max(sessions[1])}
    assert written.older_sessions == 0 and count_kinds(tmp_path / "d.kvtrace")[
        "snapshot_started"] == 1


def test_metrics_without_a_trigger_follow_the_capture(tmp_path):
    """`capture -o T --metrics-port N` with no trigger: the endpoint follows the trace itself
    (nothing else updates figures that only a trigger would read)."""
    import types
    import urllib.request

    from kvtrace.cli.recorder import Alongside

    path = trace(tmp_path / "t.kvtrace", [StepStarted(step, step * 10**6) for step in range(7)],
                 header(source="capture"))
    alongside = Alongside(trigger=None, keep_s=0, incident_dir=str(tmp_path / "i"),
                          window_s=60, metrics_host="127.0.0.1", metrics_port=0,
                          vllm_metrics=None)
    target = types.SimpleNamespace(pid=os.getpid(), uid=os.getuid(), rank_suffix="")
    alongside.start(target, str(path), ring=False)
    try:
        url = alongside.beside[0].metrics.url
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            alongside.tick()
            with urllib.request.urlopen(url) as page:
                text = page.read().decode()
            if "kvtrace_records_total 7" in text:
                break
            time.sleep(0.2)
        assert "kvtrace_records_total 7" in text, text
    finally:
        alongside.close()
    assert not (tmp_path / "i").exists()  # no trigger: no incidents directory
