"""Issue #32, `kvtrace top`: the frame it prints (--once) and, in a real terminal (tmux), the
screen it keeps redrawing while a trace grows, each figure equal to what LiveFigures computes
for the records the screen says it has read; its Prometheus endpoint; and --pid, where it runs
the capture itself and stops it on the way out."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_live import agent, agent_records, parse_exposition, scrape  # noqa: F401

from kvtrace.analysis.live import Figures, LiveFigures
from kvtrace.cli import cli
from kvtrace.cli.top import per_minute, percent, sparkline
from kvtrace.traceio import TraceReader, TraceWriter

TMUX = shutil.which("tmux")


def shown(figures: Figures) -> list[str]:
    """What the screen must show for ``figures``, as top formats them."""
    since_start = figures.hit_tokens / figures.query_tokens if figures.query_tokens else None
    return [f"records {figures.records:,};", f"first admissions {figures.lookups:,}",
             f"last 60 s {percent(figures.hit_rate)};", f"since start {percent(since_start)}",
             f": {sparkline(figures.hit_rate_history)}  now "
             f"{percent(figures.hit_rate_history[-1].hit_rate)}",
             f"transient checkpoints: {figures.transient_checkpoints:,} blocks, "
             f"{percent(figures.checkpoint_share)} of the pool ({figures.pool_blocks:,} blocks)",
             f"checkpoint pushouts: {per_minute(figures.pushouts_per_min)} over the last 60 s; "
             f"{figures.pushouts:,} in all"]


def rows_shown(figures: Figures) -> list[re.Pattern]:
    """The rows of the two tables: the hot prefixes, the missed tokens by cause."""
    rows = [re.compile(rf"(?m)^\s*{p.hash_id}\s+{p.evictions:,}\s+{p.pushouts:,}\s+"
                       rf"{p.depth_tokens:,}\s*$") for p in figures.hot_evicted]
    rows += [re.compile(rf"(?m)^{cause}\s+{tokens:,}\s+"
                        rf"{re.escape(percent(tokens / figures.query_tokens))}\s*$")
             for cause, tokens in figures.misses_by_cause.items() if tokens]
    return rows


def missing_from(screen: str, figures: Figures) -> list[str]:
    return ([text for text in shown(figures) if text not in screen]
            + [row.pattern for row in rows_shown(figures) if not row.search(screen)])


def figures_after(path: Path, num_records: int) -> Figures:
    """LiveFigures of the first ``num_records`` records of the trace at ``path`` (a whole
    number of its frames: what top read)."""
    reader = TraceReader(str(path))
    live = LiveFigures(reader.header, str(path))
    for batch in reader.batches():
        if live.records == num_records:
            break
        live.feed(batch)
    assert live.records == num_records, "top read a part of a frame"
    return live.figures()


def test_once_prints_what_live_figures_say(agent):  # noqa: F811
    result = CliRunner().invoke(cli, ["top", str(agent), "--once"])
    assert result.exit_code == 0, result.output
    reader = TraceReader(str(agent))
    live = LiveFigures(reader.header, str(agent))
    for batch in reader.batches():
        live.feed(batch)
    figures = live.figures()
    assert figures.hot_evicted and figures.pushouts and figures.misses_by_cause["cold"]
    assert missing_from(result.stdout, figures) == []
    assert "complete: its writer closed it" in result.stdout


@pytest.mark.parametrize("argv, message", [
    ([], "give SOURCE or --pid"), (["x.kvtrace", "--pid", "1"], "give SOURCE or --pid"),
    (["x.kvtrace", "--method", "ptrace"], "--method goes with --pid"),
    (["x.kvtrace", "--metrics-host", "0.0.0.0"], "--metrics-host goes with --metrics-port"),
    (["x.kvtrace", "--window", "0s"], "not a positive duration"),
])
def test_usage_errors(argv, message):
    result = CliRunner().invoke(cli, ["top", *argv])
    assert result.exit_code == 2 and message in result.stderr


def test_once_on_a_trace_not_yet_begun_is_one_error(tmp_path):
    (tmp_path / "new.kvtrace").write_bytes(b"")
    result = CliRunner().invoke(cli, ["top", str(tmp_path / "new.kvtrace"), "--once"])
    assert result.exit_code == 1
    assert result.stderr.startswith("kvtrace: error: ") and "is empty" in result.stderr


def test_once_serves_metrics_while_it_runs(agent):  # noqa: F811
    result = CliRunner().invoke(cli, ["top", str(agent), "--once", "--metrics-port", "0"])
    assert result.exit_code == 0, result.output
    assert re.search(r"kvtrace top: serving http://127\.0\.0\.1:\d+/metrics", result.stderr)


# --- in a real terminal ------------------------------------------------------------------------


class Terminal:
    """A tmux server of the test's own, one session running ``command`` in a 150x60 window;
    its exit status goes to ``status``."""

    def __init__(self, directory: Path, command: list[str]) -> None:
        self.socket = f"kvtrace-test-{os.getpid()}-{time.monotonic_ns()}"
        self.status = directory / "status"
        shell = " ".join(map(_quoted, command)) + f"; echo $? > {_quoted(str(self.status))}"
        self.tmux("new-session", "-d", "-s", "top", "-x", "150", "-y", "60", shell)

    def tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True,
                              check=True, env={**os.environ, "TERM": "xterm-256color"}).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def exit_status(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status.exists() and self.status.read_text().strip():
                return int(self.status.read_text())
            time.sleep(0.1)
        raise AssertionError(f"top did not exit; its screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True)


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def records_on(screen: str) -> int | None:
    match = re.search(r"records ([\d,]+);", screen)
    return int(match.group(1).replace(",", "")) if match else None


@pytest.mark.slow
@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_the_screen_follows_a_growing_trace(agent_records, tmp_path):  # noqa: F811
    """A writer grows a trace in chunks while top shows it in tmux: every screen read back
    whole shows exactly the figures LiveFigures computes for the records it says it has read;
    they change as records arrive; the last shows the whole trace, complete; the endpoint
    serves the same figures; q quits with status 0."""
    header, records = agent_records
    path = tmp_path / "growing.kvtrace"
    writer = TraceWriter(path, header, rows=True, batch_size=1000)
    writer.flush()
    port = free_port()
    terminal = Terminal(tmp_path, [sys.executable, "-m", "kvtrace", "top", str(path),
                                   "--interval", "1", "--metrics-port", str(port)])

    def grow() -> None:
        for start in range(0, len(records), 8000):
            writer.write_many(records[start:start + 8000])
            writer.flush()
            time.sleep(0.4)
        writer.close()

    grower = threading.Thread(target=grow)
    try:
        grower.start()
        matched: dict[int, str] = {}
        mismatched: list[tuple[int, list[str]]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            screen = terminal.screen()
            shown_records = records_on(screen)
            if shown_records and shown_records not in matched:
                # The headline figures (the tables' rows: test_once_prints_what_live_figures_say)
                missing = [text for text in shown(figures_after(path, shown_records))
                           if text not in screen]
                if missing:  # a screen caught mid-redraw, or wrong figures: read it again
                    mismatched.append((shown_records, missing))
                else:
                    matched[shown_records] = screen
            if shown_records == len(records) in matched and \
                    "complete: its writer closed it" in screen:
                break
            time.sleep(0.05)
        grower.join()
        assert len(records) in matched, (mismatched[-3:], terminal.screen())
        assert len(matched) >= 3 and len(mismatched) <= len(matched), mismatched
        first, last = min(matched), max(matched)
        assert figures_after(path, first) != figures_after(path, last)
        families = parse_exposition(scrape(f"http://127.0.0.1:{port}/metrics")[1])
        whole = figures_after(path, len(records))
        assert families["kvtrace_records_total"][1][""] == len(records)
        assert families["kvtrace_pushouts_total"][1][""] == whole.pushouts
        terminal.tmux("send-keys", "-t", "top", "q")
        assert terminal.exit_status() == 0
    finally:
        grower.join()
        terminal.close()


# --- --pid: top's own capture ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_pid_runs_a_capture_and_stops_it_on_the_way_out(tmp_path):
    """On a serving `kvtrace engine`: `top --pid --once` prints the capture's figures and leaves
    neither its directory nor an armed engine behind; shown live in tmux, a SIGTERM to top stops
    the capture as Ctrl-C would (exit 143), removes its directory, and the engine is disarmed."""
    from test_midflight import documents_workload, serving_engine

    engine = serving_engine(documents_workload(tmp_path / "w.kvtrace", "kimi-k3"))
    try:
        once = subprocess.run([sys.executable, "-m", "kvtrace", "top", "--pid",
                               str(engine.pid), "--once", "--interval", "3"],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert once.returncode == 0, once.stderr
        assert (records_on(once.stdout) or 0) > 0 and "first admissions" in once.stdout
        directory = re.search(r"\(into (\S+)\)", once.stderr).group(1)
        assert not os.path.exists(directory)
        assert_not_capturing(engine.pid)

        pid_file = tmp_path / "top.pid"
        terminal = Terminal(tmp_path, ["sh", "-c", f'echo $$ > {_quoted(str(pid_file))}; exec '
                                       f'{_quoted(sys.executable)} -m kvtrace top --pid '
                                       f'{engine.pid} --interval 0.5 2> {tmp_path}/stderr'])
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (records_on(terminal.screen()) or 0):
                time.sleep(0.2)
            assert records_on(terminal.screen()), terminal.screen()
            directory = re.search(r"\(into (\S+)\)",
                                  (tmp_path / "stderr").read_text()).group(1)
            assert os.path.isdir(directory)
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
            assert terminal.exit_status() == 128 + signal.SIGTERM
            assert "stopped by SIGTERM" in (tmp_path / "stderr").read_text()
            assert not os.path.exists(directory)
            assert_not_capturing(engine.pid)
        finally:
            terminal.close()
    finally:
        engine.stop()


def assert_not_capturing(pid: int) -> None:
    stop = subprocess.run([sys.executable, "-m", "kvtrace", "capture", "--stop", str(pid)],
                          capture_output=True, text=True, timeout=60)
    assert "was not capturing" in stop.stdout + stop.stderr, stop.stdout + stop.stderr
