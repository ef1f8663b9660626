"""`kvtrace demo --quick`: the whole loop from a fresh work directory, its report opened in
headless Chromium, and Ctrl-C cleans up."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata

import pytest

import browser

pytestmark = pytest.mark.slow


def demo(workdir, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtrace", "demo", "--quick", "--workdir",
                             str(workdir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    """One `kvtrace demo --quick` for the tests below: its work directory, stdout, stderr."""
    work = tmp_path_factory.mktemp("demo") / "work"
    process = demo(work)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    return work, out, err


def test_demo_quick_runs_the_whole_loop(quick_demo):
    work, out, err = quick_demo
    assert re.search(r"\[4/7\].*\n\s+([\d,]+)/\1 effect records match \(100%\)", err), err
    # Mid-flight, as production: requests ran when it armed and still ran when it stopped.
    armed, stopped = map(int, re.search(r"(\d+) requests in flight when it armed, (\d+) when it "
                                        r"stopped", err).groups())
    assert armed > 0 and stopped > 0, err
    # The engine it names is the one installed: the project's release, read from its table.
    assert f"vLLM {metadata.version('vllm')}'s scheduler and cache" in err, err
    # Under pressure, as production: the captured engine evicted by LRU reuse.
    causes = out.split("== Eviction causes ==")[1]
    assert re.search(r"^\s*0\s+capture\s+LRU_REUSE", causes, re.M), out
    assert re.search(r"hit rates: unfixed \d+\.\d+%, fixed \d+\.\d+%", err)
    for section in ("== Verdict ==", "== Hit rate per run ==", "== Top pushed-out prefixes ==",
                    "== Hits lost by the unfixed variant =="):
        assert section in out
    # The replays of the Nemotron-H workload price their own model: no default, no --model.
    assert "Priced as nemotron-h-8b (the replays' own figures) on an NVIDIA H200 SXM" in out
    page = (work / "report.html").read_text()
    assert 'id="verdict"' in page and page.count('class="plot kvtrace-plot"') >= 4
    for name in ("workload.kvtrace", "capture.kvtrace", "demo.duckdb"):
        assert (work / name).stat().st_size > 0
    assert "kvtrace sql" in out  # the next commands to try


CHROMIUM_MISSING = (f"no Chromium at {browser.CHROMIUM} (Debian: apt-get install chromium; "
                    "scripts/bootstrap installs it where it runs as root with apt)")


@pytest.mark.skipif(not os.access(browser.CHROMIUM, os.X_OK), reason=CHROMIUM_MISSING)
def test_the_demo_report_renders_in_chromium(quick_demo, tmp_path):
    """The demo's report as a person opens it, in a browser with no network: no console error,
    nothing fetched from outside the file, the verdict on top, every plot drawn (and the sweep
    section's, on the demo's database with a sweep added)."""
    from kvtrace.analysis.load import load_sweep
    from kvtrace.analysis.report import report_database

    from test_sql_queries import hand_sweep

    work, _, _ = quick_demo
    with_sweep = tmp_path / "sweep.duckdb"
    shutil.copyfile(work / "demo.duckdb", with_sweep)
    load_sweep(hand_sweep(), with_sweep)
    report_database(str(with_sweep), str(tmp_path / "sweep.html"))
    with browser.Chromium() as chromium:
        for page_path, shot in ((work / "report.html", "demo.png"),
                                (tmp_path / "sweep.html", "sweep.png")):
            page = chromium.open(page_path)
            page.wait_until("document.querySelectorAll('.kvtrace-plot:not([data-rendered])')"
                            ".length === 0")
            plots = page.evaluate("""Array.from(document.querySelectorAll('.kvtrace-plot'),
                div => [div.id, div.querySelectorAll('svg.main-svg').length,
                        div.getBoundingClientRect().height,
                        div.querySelectorAll('.trace').length])""")
            figures = page.evaluate("Object.keys(JSON.parse(document.getElementById("
                                    "'kvtrace-figures').textContent))")
            assert sorted(p[0] for p in plots) == sorted(figures) and len(figures) >= 4
            assert all(svgs and height > 100 and traces for _, svgs, height, traces in plots), \
                plots
            verdict = page.evaluate("document.getElementById('verdict').innerText")
            assert verdict.startswith("Verdict") and "unfixed -> fixed" in verdict
            assert page.evaluate("document.getElementById('verdict').getBoundingClientRect()"
                                 ".top") < 200  # on top, under the title
            page.screenshot(tmp_path / shot)
            assert (tmp_path / shot).read_bytes().startswith(b"\x89PNG")
            assert page.console_errors() == []
            assert page.foreign_requests() == []
        assert "plot-sweep-0" in figures  # the second page's sweep curves drew


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
