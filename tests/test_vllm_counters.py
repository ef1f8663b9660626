"""vLLM's own prefix-cache counters recorded beside a capture (``CounterRecorder``: the
Prometheus parser, the scrapes, the sidecar made safely), loaded (``load_vllm_counters``) and
reconciled with the trace (``vllm_counter_reconciliation.sql``): by hand on a made-up capture,
and on a real ``vllm serve`` whose small pool makes allocations fail, so that lookups are
retried."""

from __future__ import annotations

import bisect
import http.server
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from real_server import VllmServe, missing
from test_capture_live import kvtrace, wait_for_stderr_line

from kvtrace.analysis import vllm_counters
from kvtrace.analysis.database import open_database
from kvtrace.analysis.load import load_traces
from kvtrace.analysis.queries import run_query
from kvtrace.analysis.vllm_counters import (
    CountersError,
    load_vllm_counters,
    read_sidecar,
    reconciliation_lines,
)
from kvtrace.capture import vllm_metrics
from kvtrace.capture.vllm_metrics import (
    CounterRecorder,
    MetricsError,
    discover_metrics_url,
    kept,
    parse_metrics,
)
from kvtrace.errors import UnsafePathError
from kvtrace.events import (
    ComputedBlocksFound,
    EngineConfig,
    FreeQueueState,
    KVCacheGroup,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    RequestQueue,
    RequestState,
    SlotsAllocated,
    SnapshotEnded,
    SnapshotStarted,
    StepStarted,
    TraceHeader,
)
from kvtrace.traceio import write_trace

QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
ENGINE = {"engine": "0", "model_name": "m"}


# --- the Prometheus text format --------------------------------------------------------------

PAGE = r"""# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="/m/a \"q\", {b}\\c\nd"} 1234.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 5.5e+02 1712345678000
vllm:num_preemptions_total{engine="0",model_name="m"} 3
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m",} 7
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} NaN
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9
process_cpu_seconds_total 12.5
"""


def test_the_parser_reads_names_labels_escapes_and_values():
    samples = parse_metrics(PAGE)
    assert samples[0] == (QUERIES, {"engine": "0", "model_name": '/m/a "q", {b}\\c\nd'}, 1234.0)
    assert samples[2] == (HITS, ENGINE, 550.0)  # a sample's own timestamp is not its value
    assert samples[4][1] == {"engine": "0", "finished_reason": "stop", "model_name": "m"}
    assert samples[6][1]["le"] == "+Inf" and samples[7] == ("process_cpu_seconds_total", {}, 12.5)
    assert len(samples) == 8


def test_only_the_counters_the_reconciliation_reads_are_kept():
    names = [(sample["name"], sample["value"]) for sample in kept(parse_metrics(PAGE))]
    assert names == [(QUERIES, 1234.0), (HITS, 550.0), ("vllm:num_preemptions_total", 3.0),
                     ("vllm:request_success_total", 7.0)]  # not _created, NaN, others


@pytest.mark.parametrize("line", ['vllm:x_total{engine="0" 1', 'vllm:x_total{engine=0} 1',
                                  "vllm:x_total", "vllm:x_total one", 'vllm:x_total{="a"} 1'])
def test_a_line_that_is_no_sample_is_named(line):
    with pytest.raises(MetricsError, match="line 2 of the metrics page"):
        parse_metrics(f"# TYPE x counter\n{line}\n")


# --- the recorder against a local metrics endpoint -------------------------------------------

class Endpoint:
    """A loopback HTTP server standing in for vLLM's /metrics: the counters grow by 100
    query tokens and 10 hits a GET; ``status`` other than 200 fails GETs; ``page`` replaces the
    page; ``location`` redirects."""

    def __init__(self) -> None:
        self.gets, self.status, self.page, self.location = 0, 200, None, None
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint.gets += 1
                if endpoint.location:
                    self.send_response(302)
                    self.send_header("Location", endpoint.location)
                    self.end_headers()
                    return
                body = (endpoint.page or (
                    f'{QUERIES}{{engine="0",model_name="m"}} {100 * endpoint.gets}\n'
                    f'{HITS}{{engine="0",model_name="m"}} {10 * endpoint.gets}\n')).encode()
                self.send_response(endpoint.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    served = Endpoint()
    yield served
    served.close()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def scrapes_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_recorder_appends_a_scrape_a_line_and_rides_out_failures(endpoint, tmp_path):
    trace = tmp_path / "t.kvtrace"
    recorder = CounterRecorder(endpoint.url, trace, interval_s=0.02).start()
    try:
        wait_for(lambda: recorder.scrapes >= 3)
        endpoint.status = 500  # failed scrapes are counted, then retried
        wait_for(lambda: recorder.failures >= 2)
        assert "HTTP 500" in recorder.last_error
        endpoint.status = 200
        scraped = recorder.scrapes
        wait_for(lambda: recorder.scrapes >= scraped + 2)
    finally:
        recorder.close()
    recorder.close()  # again: nothing left to do
    sidecar = tmp_path / "t.kvtrace.vllm-metrics.jsonl"
    assert stat.S_IMODE(sidecar.stat().st_mode) == 0o600
    scrapes = scrapes_of(sidecar)
    assert len(scrapes) == recorder.scrapes
    queries = [s["samples"][0]["value"] for s in scrapes]
    assert queries == sorted(queries) and queries[0] == 100
    assert [s["ts_ns"] for s in scrapes] == sorted(s["ts_ns"] for s in scrapes)
    assert scrapes[0]["samples"][1] == {"name": HITS, "labels": ENGINE, "value": 10.0}
    assert {key for s in scrapes for key in s} == {"ts_ns", "samples"}


def test_a_first_scrape_that_fails_is_raised_with_a_hint_before_any_file(tmp_path):
    with pytest.raises(MetricsError, match="cannot scrape http://127.0.0.1:9/metrics") as error:
        CounterRecorder("http://127.0.0.1:9/metrics", tmp_path / "t.kvtrace").start()
    assert "--port" in error.value.hint
    assert list(tmp_path.iterdir()) == []


def test_a_page_that_is_not_vllms_is_refused(endpoint, tmp_path):
    endpoint.page = "process_cpu_seconds_total 1\n"
    with pytest.raises(MetricsError, match="not vLLM's metrics endpoint"):
        CounterRecorder(endpoint.url, tmp_path / "t.kvtrace").start()


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/metrics",
                                 "127.0.0.1:8000/metrics"])
def test_only_http_urls_are_scraped(url, tmp_path):
    with pytest.raises(MetricsError, match="not an http"):
        CounterRecorder(url, tmp_path / "t.kvtrace")


def test_a_redirect_away_from_http_is_refused(endpoint, tmp_path):
    """urllib itself follows a redirect to ftp (and refuses file://)."""
    endpoint.location = "ftp://127.0.0.1:9/metrics"
    with pytest.raises(MetricsError, match="redirects to ftp://127.0.0.1:9/metrics, not http"):
        CounterRecorder(endpoint.url, tmp_path / "t.kvtrace").start()


# --- the sidecar, made in shared directories -------------------------------------------------

def test_a_link_planted_at_the_sidecars_name_is_refused_and_left_alone(endpoint, tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep")
    link = tmp_path / "t.kvtrace.vllm-metrics.jsonl"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match="is not a regular file"):
        CounterRecorder(endpoint.url, tmp_path / "t.kvtrace").start()
    assert link.is_symlink() and target.read_text() == "keep"


def test_an_earlier_captures_sidecar_is_replaced(endpoint, tmp_path):
    old = tmp_path / "t.kvtrace.vllm-metrics.jsonl"
    old.write_text("from an earlier capture\n")
    old.chmod(0o644)
    CounterRecorder(endpoint.url, tmp_path / "t.kvtrace").start().close()
    assert stat.S_IMODE(old.stat().st_mode) == 0o600
    assert [scrape["samples"][0]["value"] for scrape in scrapes_of(old)] == [100]


def test_a_directory_other_users_can_write_is_refused(endpoint, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could swap the sidecar
    with pytest.raises(UnsafePathError, match="can be written by other users"):
        CounterRecorder(endpoint.url, shared / "t.kvtrace").start()
    assert list(shared.iterdir()) == []


# --- the API server's URL from its command line ----------------------------------------------

@pytest.mark.parametrize("args, url", [
    (["vllm", "serve", "m", "--port", "8123"], "http://127.0.0.1:8123/metrics"),
    (["-m", "vllm.entrypoints.openai.api_server", "--port=9000", "--host", "10.0.0.5"],
     "http://10.0.0.5:9000/metrics"),
    (["/usr/bin/vllm", "serve", "m", "--host", "0.0.0.0"], "http://127.0.0.1:8000/metrics"),
    (["vllm", "serve", "m", "--host", "::", "--ssl-certfile", "c.pem"],
     "https://[::1]:8000/metrics"),
    (["vllm", "serve", "m", "--uds", "/run/v.sock"], None),
    (["vllm", "serve", "--config", "c.yaml"], None),
    (["vllm", "bench", "--port", "8123"], None),
    (["something", "else", "--port", "8123"], None),
])
def test_the_metrics_url_is_read_off_the_api_servers_command_line(args, url):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    try:
        wait_for(lambda: Path(f"/proc/{process.pid}/cmdline").read_bytes().count(b"\0") > 3)
        assert discover_metrics_url(process.pid) == url
    finally:
        process.kill()
        process.wait()


def test_no_url_for_a_process_that_is_gone():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert discover_metrics_url(process.pid) is None


# --- loading ---------------------------------------------------------------------------------

def test_both_sides_name_the_sidecar_alike():
    assert vllm_counters.SIDECAR_SUFFIX == vllm_metrics.SIDECAR_SUFFIX
    assert vllm_counters.sidecars("/d/t.kvtrace", None) == [vllm_metrics.sidecar_path("/d/t.kvtrace")]


def scrape_line(ts_ns: int, queries: float, hits: float, engine: str = "0", **others) -> str:
    samples = [{"name": QUERIES, "labels": {"engine": engine}, "value": queries},
               {"name": HITS, "labels": {"engine": engine}, "value": hits}]
    samples += [{"name": name, "labels": {"engine": engine}, "value": value}
                for name, value in others.items()]
    return json.dumps({"ts_ns": ts_ns, "samples": samples}) + "\n"


def test_a_cut_off_last_line_is_left_out(tmp_path):
    sidecar = tmp_path / "s.jsonl"
    sidecar.write_text(scrape_line(1, 10, 1) + scrape_line(2, 20, 2) + scrape_line(3, 30, 3)[:25])
    assert [row[0] for row in read_sidecar(str(sidecar))] == [1, 1, 2, 2]
    assert read_sidecar(str(tmp_path / "none.jsonl")) is None


@pytest.mark.parametrize("line", ["{not json", '{"ts_ns": 1}', '{"ts_ns": 1, "samples": [1]}',
                                  '{"ts_ns": 1, "samples": [{"name": "x", "labels": {}, '
                                  '"value": "7"}]}',
                                  '{"ts_ns": 1, "samples": [{"name": "x", "labels": {"a": 1}, '
                                  '"value": 7}]}'])
def test_a_damaged_line_is_named(tmp_path, line):
    sidecar = tmp_path / "s.jsonl"
    sidecar.write_text(scrape_line(1, 10, 1) + line + "\n" + scrape_line(3, 30, 3))
    with pytest.raises(CountersError, match=f"{sidecar}:2: not a scrape"):
        read_sidecar(str(sidecar))


def test_a_sidecar_that_is_a_link_or_another_users_is_not_read(tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text(scrape_line(1, 10, 1))
    (tmp_path / "link.jsonl").symlink_to(real)
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        read_sidecar(str(tmp_path / "link.jsonl"))
    os.chown(real, 1234, 1234)
    if os.geteuid() == 0:
        with pytest.raises(UnsafePathError, match="not a regular file of uid 0 or root"):
            read_sidecar(str(real))
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        read_sidecar(str(tmp_path / "fifo.jsonl"))


# A made-up capture on the wall clock: created at T0, a step a second (ms are noted). Requests
# of 32 tokens; request 9 was in flight when it began, preempted once and waiting again.
T0 = 1_700_000_000 * 10**9
SECOND = 10**9
CONFIG = EngineConfig(
    kv_cache_groups=[KVCacheGroup(kind="full_attention", block_size=16),
                     KVCacheGroup(kind="mamba", block_size=16, mamba_cache_mode="align")],
    hash_block_size=16, num_gpu_blocks=7, retention_interval=0)


def lookup(req: int, hit: int, ok: bool = True) -> list:
    return [ComputedBlocksFound(req, hit, 0),
            SlotsAllocated(req, 32 - hit, 0, hit, 0, 0, 32, ok)]


def made_up_capture(title: str = "VLLM::EngineCore") -> tuple[TraceHeader, list]:
    records = [
        SnapshotStarted(0, 7, 1, 0),
        FreeQueueState([1, 2, 3, 4, 5, 6]),
        RequestState(9, RequestQueue.WAITING, "PREEMPTED", 32, [201, 202], 4, 32, 0, 1, 0),
        SnapshotEnded(1000),
        StepStarted(0, 0),                                   # 0 ms: before the window
        RequestArrived(0, 32, [101, 102], 4), *lookup(0, 0),
        StepStarted(1, 2 * SECOND),                          # 2,000 ms: request 1 waits
        RequestArrived(1, 32, [101, 103], 4), *lookup(1, 16, ok=False),
        StepStarted(2, 2 * SECOND + SECOND // 2),            # 2,500 ms: and waits
        *lookup(1, 16, ok=False),
        StepStarted(3, 3 * SECOND),                          # 3,000 ms: admitted
        *lookup(1, 16),
        *lookup(9, 16),                                      # preempted before: not counted
        StepStarted(4, 4 * SECOND),                          # 4,000 ms
        RequestPreempted(0),
        StepStarted(5, 5 * SECOND),                          # 5,000 ms: resumed, not counted
        *lookup(0, 16),
        StepStarted(6, 6 * SECOND),                          # 6,000 ms
        RequestArrived(3, 32, [104, 105], 4), *lookup(3, 0),
        StepStarted(7, 6 * SECOND + 900_000_000),            # 6,900 ms: 100 ms before a scrape
        RequestArrived(4, 32, [106, 107], 4), *lookup(4, 0),
        StepStarted(8, 8 * SECOND),                          # 8,000 ms: the last step
        RequestFinished(1, 0),
    ]
    header = TraceHeader(kvtrace_version="test", created_ns=T0, source="capture",
                         config=CONFIG, process_title=title)
    return header, records


# Between the scrapes at 1 s and 7 s a counter at admission adds requests 1, 3 and 4 (96 query
# tokens, 16 hits; request 4's 32 tokens 100 ms before the last scrape may be missing from it);
# a counter at the lookup adds request 1's two failed lookups too (64 tokens, 32 hits).
ADMISSION, LOOKUP = (96, 16), (160, 48)


def load_with_counters(traces: list[Path], db: Path):
    """``kvtrace load`` of ``traces``, each with its sidecar; a writable connection to the
    database."""
    load_traces(traces, db)
    return open_database(db, read_only=False)


def reconciled(tmp_path, scrapes: list[tuple[int, int, int]], lag_ms: str = "500",
               **others) -> dict:
    """The query's row for the made-up capture with scrapes (ms, queries, hits) beside it."""
    trace = tmp_path / "c.kvtrace"
    write_trace(trace, *made_up_capture())
    Path(vllm_metrics.sidecar_path(trace)).write_text("".join(
        scrape_line(T0 + ms * 10**6, queries, hits, **others) for ms, queries, hits in scrapes))
    connection = load_with_counters([trace], tmp_path / "c.duckdb")
    try:
        result = run_query(connection, "vllm_counter_reconciliation", {"lag_ms": lag_ms})
    finally:
        connection.close()
    (row,) = [dict(zip(result.columns, values)) for values in result.rows]
    return row


def window(added: tuple[int, int], before: tuple[int, int] = (32, 0)):
    """Scrapes at 0.2 s (inside the lag after the trace began: left out), 1 s, 4 s and 7 s,
    and at 9 s (after the last step: left out), the counters growing by ``added`` between the
    scrapes at 1 s and 7 s."""
    queries, hits = before
    return [(200, queries, hits), (1000, queries, hits), (4000, queries + 5, hits),
            (7000, queries + added[0], hits + added[1]), (9000, 10**6, 10**6)]


def test_counters_at_admission_match_kvtraces_admitted_lookups(tmp_path):
    row = reconciled(tmp_path, window(ADMISSION))
    assert (row["scrapes"], row["window_s"]) == (3, 6.0)
    assert (row["vllm_query_tokens"], row["vllm_hit_tokens"]) == ADMISSION
    assert row["vllm_hit_rate"] == 16 / 96 == row["hit_rate"]
    assert (row["admitted_lookups"], row["admitted_query_tokens"],
            row["admitted_hit_tokens"]) == (3, 96, 16)
    assert (row["retried_lookups"], row["retried_query_tokens"],
            row["retried_hit_tokens"]) == (2, 64, 32)
    assert row["edge_query_tokens"] == 32  # request 4, 100 ms before the last scrape
    assert (row["overcounted_query_tokens"], row["overcounted_hit_tokens"]) == (0, 0)
    assert (row["counting"], row["overcounted_lookups"]) == ("admission", 0)
    assert (row["preemptions"], row["finished_requests"]) == (1, 0)  # finished at 8 s: after


def test_a_scrape_that_lacks_the_last_steps_admission_still_fits(tmp_path):
    row = reconciled(tmp_path, window((ADMISSION[0] - 32, ADMISSION[1])))
    assert (row["counting"], row["overcounted_query_tokens"]) == ("admission", -32)
    row = reconciled(tmp_path, window((ADMISSION[0] - 32, ADMISSION[1])), lag_ms="50")
    assert row["counting"] == "neither" and row["edge_query_tokens"] == 0


def test_counters_at_the_lookup_count_the_retried_lookups_again(tmp_path):
    row = reconciled(tmp_path, window(LOOKUP), vllm_num_preemptions_total=0)
    assert (row["counting"], row["overcounted_lookups"]) == ("lookup", 2)
    assert (row["overcounted_query_tokens"], row["overcounted_hit_tokens"]) == (64, 32)
    assert row["vllm_hit_rate"] == 48 / 160 and row["hit_rate"] == 16 / 96


def test_counters_that_follow_neither_rule_say_so(tmp_path):
    row = reconciled(tmp_path, window((ADMISSION[0] + 10, ADMISSION[1])))
    assert (row["counting"], row["overcounted_lookups"]) == ("neither", None)


def test_without_retried_lookups_in_the_window_the_rules_agree(tmp_path):
    row = reconciled(tmp_path, [(1000, 32, 0), (1800, 32, 0)])
    assert (row["retried_lookups"], row["counting"], row["overcounted_lookups"]) == (
        0, "either", 0)


def test_preemptions_and_finished_requests_are_reconciled(tmp_path):
    name = "vllm:request_success_total"
    row = reconciled(tmp_path, window(ADMISSION), **{"vllm:num_preemptions_total": 0})
    assert row["vllm_preemptions"] == 0 and row["vllm_finished_requests"] is None
    trace = tmp_path / "c.kvtrace"
    Path(vllm_metrics.sidecar_path(trace)).write_text("".join(
        scrape_line(T0 + ms * 10**6, 0, 0, **{"vllm:num_preemptions_total": p, name: f})
        for ms, p, f in [(1000, 2, 5), (7000, 3, 5)]))
    connection = load_with_counters([trace], tmp_path / "p.duckdb")
    try:
        result = run_query(connection, "vllm_counter_reconciliation")
    finally:
        connection.close()
    row = dict(zip(result.columns, result.rows[0]))
    assert (row["vllm_preemptions"], row["preemptions"]) == (1, 1)
    assert (row["vllm_finished_requests"], row["finished_requests"]) == (0, 0)


def test_a_run_without_counters_has_its_row_with_none_of_vllms(tmp_path):
    trace = tmp_path / "c.kvtrace"
    write_trace(trace, *made_up_capture())
    connection = load_with_counters([trace], tmp_path / "c.duckdb")
    try:
        result = run_query(connection, "vllm_counter_reconciliation")
        assert reconciliation_lines(connection) == []
    finally:
        connection.close()
    row = dict(zip(result.columns, result.rows[0]))
    assert row["scrapes"] is None and row["counting"] is None
    # kvtrace's side over the whole trace: requests 0, 1, 3 and 4 admitted, 1 retried twice
    assert (row["admitted_lookups"], row["admitted_query_tokens"]) == (4, 128)
    assert (row["retried_lookups"], row["vllm_query_tokens"]) == (2, None)


def test_loading_replaces_a_runs_counters_and_makes_the_table_without_a_sidecar(tmp_path):
    trace = tmp_path / "c.kvtrace"
    write_trace(trace, *made_up_capture())
    connection = load_with_counters([trace], tmp_path / "c.duckdb")
    try:
        count = "SELECT count(*), count(DISTINCT ts_ns) FROM vllm_counters"
        assert connection.execute(count).fetchone() == (0, 0)
        Path(vllm_metrics.sidecar_path(trace)).write_text(
            "".join(scrape_line(T0 + ms, 1, 1) for ms in (1, 2, 3)))
        assert load_vllm_counters(connection, 0, str(trace)) == 3
        assert load_vllm_counters(connection, 0, str(trace)) == 3
        assert connection.execute(count).fetchone() == (6, 3)
        assert connection.execute("SELECT DISTINCT labels FROM vllm_counters").fetchall() == [
            ('{"engine": "0"}',)]
    finally:
        connection.close()


def test_a_data_parallel_ranks_trace_reads_its_engines_counters_beside_the_capture_path(
        tmp_path):
    """One recorder scrapes every engine of the API server beside ``-o prod.kvtrace``; the
    trace of rank 1 (``prod.dp1.kvtrace``) keeps engine 1's samples."""
    trace = tmp_path / "prod.dp1.kvtrace"
    write_trace(trace, *made_up_capture("VLLM::EngineCore_DP1"))
    Path(vllm_metrics.sidecar_path(tmp_path / "prod.kvtrace")).write_text(
        scrape_line(T0 + 1, 5, 1, engine="0") + scrape_line(T0 + 1, 7, 2, engine="1"))
    connection = load_with_counters([trace], tmp_path / "c.duckdb")
    try:
        assert connection.execute("SELECT name, labels, value FROM vllm_counters ORDER BY name"
                                  ).fetchall() == [(HITS, '{"engine": "1"}', 2.0),
                                                   (QUERIES, '{"engine": "1"}', 7.0)]
    finally:
        connection.close()


def test_the_reports_lines_say_which_rule_the_counters_followed(tmp_path):
    def lines(scrapes) -> list[str]:
        trace = tmp_path / "c.kvtrace"
        write_trace(trace, *made_up_capture())
        Path(vllm_metrics.sidecar_path(trace)).write_text("".join(
            scrape_line(T0 + ms * 10**6, queries, hits) for ms, queries, hits in scrapes))
        connection = load_with_counters([trace], tmp_path / "r.duckdb")
        try:
            return reconciliation_lines(connection)
        finally:
            connection.close()

    (line,) = lines(window(ADMISSION))
    assert line.startswith("run 0 (capture): vLLM's counters over 6.0 s (3 scrapes): 96 query "
                           "tokens, 16 hits (16.67%); kvtrace's 3 admitted lookups: 96 query "
                           "tokens, 16 hits (16.67%). vLLM counted each admission once")
    assert line.endswith("differ from kvtrace's by +0 query tokens and +0 hits, with 32 query "
                         "tokens uncertain at the scrapes' edges. A counter at every lookup "
                         "(vllm #43736) would have added the 2 retried lookups (64 query "
                         "tokens, 32 hits).")
    (line,) = lines(window(LOOKUP))
    assert "vLLM counted at every lookup (vllm #43736), the 2 retried lookups" in line
    assert "48 hits (30.00%)" in line and "by +64 query tokens and +32 hits" in line
    (line,) = lines(window((200, 16)))
    assert "by +104 query tokens and +0 hits" in line and "neither counting rule" in line


@pytest.mark.parametrize("flag", [[], ["--markdown"], ["--html"]])
def test_kvtrace_report_shows_the_counters_beside_the_verdict(tmp_path, flag):
    """`kvtrace load` takes the sidecar in with its trace, and the report's verdict section
    carries the reconciliation, in the terminal, in Markdown and in HTML."""
    from click.testing import CliRunner

    from kvtrace.cli import cli

    trace = tmp_path / "c.kvtrace"
    write_trace(trace, *made_up_capture())
    Path(vllm_metrics.sidecar_path(trace)).write_text("".join(
        scrape_line(T0 + ms * 10**6, queries, hits) for ms, queries, hits in window(LOOKUP)))
    runner = CliRunner()
    assert runner.invoke(cli, ["load", str(trace), "-o", str(tmp_path / "c.duckdb")]).exit_code == 0
    out = tmp_path / "r.html"
    result = runner.invoke(cli, ["report", str(tmp_path / "c.duckdb"), *flag,
                                 *([str(out)] if flag == ["--html"] else [])])
    assert result.exit_code == 0, result.output
    shown = out.read_text() if flag == ["--html"] else result.output
    assert "vLLM counted at every lookup" in shown and "the 2 retried lookups" in shown
    assert "--query vllm_counter_reconciliation" in shown or flag == ["--html"]


# --- a real vllm serve -----------------------------------------------------------------------

# A pool of 24 blocks (of 256 tokens: each request holds 5 or 6 attention blocks and one state
# block in each of three Mamba groups), four clients sending 1,024-token shared prefixes with
# their own tails: two requests fit, so the others' allocations fail and they are looked up
# again at every step until they fit, and running requests are preempted.
REAL_POOL = {"num_gpu_blocks": 24, "num_prefixes": 8, "prefix_tokens": 1024}
CAPTURE_S, SCRAPE_S, LAG_MS = 14, 0.25, 500


def scrapes_fit_the_trace(connection, name: str, events_sql: str, lag_ns: int) -> int:
    """Check that every scrape of counter ``name`` taken inside the trace holds exactly the
    events (``events_sql``: rows of wall-clock ns, weight) of the steps that started before it,
    but for those of the last ``lag_ns`` at most: the counter was 0 when the capture began
    (an idle engine) and grew step by step. Returns the longest lag a scrape showed."""
    (created, last_step), = connection.execute(
        "SELECT created_ns, created_ns + (SELECT max(ts_ns) FROM step_started) FROM runs"
    ).fetchall()
    events = connection.execute(events_sql).fetchall()
    times, totals = [t for t, _ in events], [0]
    for _, weight in events:
        totals.append(totals[-1] + weight)
    scrapes = connection.execute(
        "SELECT ts_ns, sum(value) FROM vllm_counters WHERE name = ? AND ts_ns BETWEEN ? AND ? "
        "GROUP BY ts_ns ORDER BY ts_ns", [name, created, last_step]).fetchall()
    assert len(scrapes) > CAPTURE_S / SCRAPE_S / 2, scrapes
    longest = 0
    for ts, value in scrapes:
        known = bisect.bisect_right(times, ts)  # the events of the steps started before it
        held = next((i for i in range(known, -1, -1) if totals[i] == value), None)
        assert held is not None and (held == known or times[held] > ts - lag_ns), (
            f"{name} at {(ts - created) / 1e9:.3f} s reads {value}: no step within "
            f"{lag_ns / 1e6:.0f} ms before it ends at that total")
        if held < known:
            longest = max(longest, ts - times[held])
    return longest


@pytest.mark.slow
@pytest.mark.skipif(missing() is not None, reason=missing() or "")
def test_a_real_servers_counters_count_each_admission_once(tmp_path):
    """vLLM's CPU build 0.32.0 serving with a pool too small for its four clients, its
    /metrics recorded while kvtrace captures its engine (by the API server's pid, with the URL
    read off its command line): every scrape equals, token for token, kvtrace's first
    admissions (and their hits, the preemptions, the finished requests) of the steps before it,
    so the reconciliation finds the counters at admission (vllm #48860, which 0.32 has). The
    hundreds of lookups retried after a failed allocation are not in vLLM's counters: a
    counter at the lookup (vllm #43736) would have read many times what it did."""
    server = VllmServe(plugin=True, **REAL_POOL)
    trace = tmp_path / "real.kvtrace"
    try:
        url = discover_metrics_url(server.pid)
        assert url == f"http://127.0.0.1:{server.port}/metrics"
        recorder = CounterRecorder(url, trace, interval_s=SCRAPE_S).start()
        try:
            capture = kvtrace("-v", "capture", "--pid", str(server.pid), "--duration",
                              f"{CAPTURE_S}s", "-o", str(trace))
            wait_for_stderr_line(capture, "kvtrace: capturing pid")
            time.sleep(1)  # armed on an idle engine: the first request comes after
            server.serve()
            out, err = capture.communicate(timeout=300)
            assert capture.returncode == 0, err
        finally:
            recorder.close()
    finally:
        server.stop()
    assert recorder.failures == 0, recorder.last_error
    sidecar = Path(vllm_metrics.sidecar_path(trace))
    assert stat.S_IMODE(sidecar.stat().st_mode) == 0o600

    connection = load_with_counters([trace], tmp_path / "real.duckdb")
    try:
        result = run_query(connection, "vllm_counter_reconciliation", {"lag_ms": str(LAG_MS)})
        (row,) = [dict(zip(result.columns, values)) for values in result.rows]
        lines = reconciliation_lines(connection)
        at_steps = ("SELECT r.created_ns + coalesce(s.ts_ns, 0) AS at_ns, {weight} FROM {table} e "
                    "JOIN runs r ON r.run = e.run "
                    "LEFT JOIN step_started s ON s.run = e.run AND s.step = e.step "
                    "{where} ORDER BY at_ns, e.seq")
        first = "WHERE e.admission = 1"  # kvtrace's first admissions (the lookups view)
        lag_ns = LAG_MS * 10**6
        lags = [scrapes_fit_the_trace(connection, QUERIES, at_steps.format(
                    weight="e.num_query_tokens", table="lookups", where=first), lag_ns),
                scrapes_fit_the_trace(connection, HITS, at_steps.format(
                    weight="e.num_hit_tokens", table="lookups", where=first), lag_ns),
                scrapes_fit_the_trace(connection, "vllm:num_preemptions_total", at_steps.format(
                    weight="1", table="request_preempted", where=""), lag_ns),
                scrapes_fit_the_trace(connection, "vllm:request_success_total", at_steps.format(
                    weight="1", table="request_finished", where=""), lag_ns)]
    finally:
        connection.close()
    print(f"longest lags (ms): {[round(lag / 1e6, 1) for lag in lags]}; {row}")
    assert row["counting"] == "admission" and row["overcounted_lookups"] == 0, row
    assert abs(row["overcounted_query_tokens"]) <= row["edge_query_tokens"], row
    assert row["retried_lookups"] > 100 and row["preemptions"] > 0, row
    assert row["retried_query_tokens"] > 2 * row["vllm_query_tokens"], row
    assert abs(row["vllm_hit_rate"] - row["hit_rate"]) < 0.01, row
    (line,) = lines
    assert "vLLM counted each admission once (vllm #48860)" in line
