"""`kvtrace demo --quick`: the whole loop from a fresh work directory, and Ctrl-C cleans up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def demo(workdir, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtrace", "demo", "--quick", "--workdir",
                             str(workdir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_demo_quick_runs_the_whole_loop(tmp_path):
    process = demo(tmp_path / "work")
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    assert re.search(r"\[4/7\].*\n\s+([\d,]+)/\1 effect records match \(100%\)", err), err
    assert re.search(r"hit rates: unfixed \d+\.\d+%, fixed \d+\.\d+%", err)
    for section in ("== Hit rate per run ==", "== Top pushed-out prefixes ==",
                    "== Hits lost by the unfixed variant =="):
        assert section in out
    html = (tmp_path / "work" / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') >= 2
    for name in ("workload.kvtrace", "capture.kvtrace", "demo.duckdb"):
        assert (tmp_path / "work" / name).stat().st_size > 0
    assert "kvtrace sql" in out  # the next commands to try


def test_ctrl_c_stops_the_engine(tmp_path):
    process = demo(tmp_path / "work")
    engine_pid = None
    for line in process.stderr:
        if match := re.search(r"pid (\d+), process title", line):
            engine_pid = int(match.group(1))
            break
    assert engine_pid is not None
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    assert process.returncode != 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return
        state = open(f"/proc/{engine_pid}/stat").read().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"the demo left its engine (pid {engine_pid}) running")


def test_an_unusable_workdir_is_one_error_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    process = demo(blocker / "work")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert err.splitlines()[0].startswith("kvtrace: error: cannot create the work directory")
