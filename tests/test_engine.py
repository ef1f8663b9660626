"""``kvtrace engine``: a real engine process on vLLM 0.33's scheduler and cache.

The slow tests start real processes (each imports vLLM, ~7 s); both are started by one fixture
so that they load side by side, while this process runs the in-process replay to compare with.
"""

from __future__ import annotations

import io
import json
import os
import platform
import queue
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.engine.process import EngineProcess
from kvtrace.engine.core import END_OF_INPUT, START, read_commands
from kvtrace.workloads.workload import EngineShape, write_workload
from kvtrace.workloads.synth import synthesize

SPEED = 20
# Registers a vLLM general plugin through package metadata, as an installed package does; the
# plugin writes down the process title it saw when vLLM loaded it.
# vLLM also loads plugins in helper processes (its model-registry inspection, on a cold cache),
# so each load appends "pid title".
PLUGIN_MODULE = """
import os

def register():
    with open("/proc/self/cmdline", "rb") as cmdline:
        title = cmdline.read().split(b"\\0")[0]
    with open(os.environ["KVTRACE_TEST_PLUGIN_OUT"], "ab") as out:
        out.write(b"%d %s\\n" % (os.getpid(), title))
"""


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    """40 shared-prompt requests on a pool tight enough that unfixed and fixed differ."""
    path = tmp_path_factory.mktemp("engine") / "shared.kvtrace"
    shape = EngineShape()
    write_workload(path, synthesize("shared-prompt", 40, seed=0, hash_unit=shape.hash_block_size),
                   shape)
    return path


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "kvtrace_test_plugin.py").write_text(PLUGIN_MODULE)
    dist_info = site / "kvtrace_test_plugin-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtrace-test-plugin\n"
                                        "Version: 0\n")
    (dist_info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvtrace_test = kvtrace_test_plugin:register\n")
    return site


@pytest.fixture(scope="module")
def engines(workload, plugin_site, tmp_path_factory):
    """Two engines, started together: "run" (to drive) and "idle" (to watch and terminate)."""
    out = tmp_path_factory.mktemp("engine-out")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_site), env.get("PYTHONPATH", "")])
    env["KVTRACE_TEST_PLUGIN_OUT"] = str(out / "plugin-title")
    started = {
        "run": EngineProcess([str(workload), "--variant", "unfixed", "--speed", str(SPEED),
                              "--summary-json", str(out / "summary.json")], env),
        "idle": EngineProcess([str(workload)], {**env, "KVTRACE_TEST_PLUGIN_OUT": os.devnull}),
    }
    yield started, out
    for engine in started.values():
        engine.stop()


def thread_stat(pid: int) -> tuple[str, int]:
    """(state letter, utime + stime in clock ticks) of ``pid``'s main thread."""
    text = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[11]) + int(fields[12])


@pytest.mark.slow
def test_engine_process_runs_the_workload_through_vllms_scheduler_as_replay_does(engines, workload, tmp_path):
    started, out = engines
    engine = started["run"]
    ready = engine.expect("kvtrace engine: pid ")
    pid = engine.process.pid
    assert ready.startswith(f"kvtrace engine: pid {pid} ready (variant unfixed, 40 requests,")
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")
    # vLLM loaded the plugin from package metadata, after the title was set.
    loads = dict(line.split(b" ", 1) for line in (out / "plugin-title").read_bytes().splitlines())
    assert loads[str(pid).encode()].startswith(b"VLLM::EngineCore")

    # The same workload and variant through `kvtrace replay`, in this process.
    summary_path = tmp_path / "replay.json"
    result = CliRunner().invoke(cli, ["replay", str(workload), "--variant", "unfixed",
                                      "--variant", "fixed", "-o", str(tmp_path / "runs"),
                                      "--summary-json", str(summary_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    replayed = json.loads(summary_path.read_text())["variants"]
    assert replayed["unfixed"]["hit_tokens"] != replayed["fixed"]["hit_tokens"]  # variant shows

    engine.send("start")
    engine.expect("kvtrace engine: running 40 requests")
    done = engine.expect("kvtrace engine: done (", timeout=60)
    summary = json.loads((out / "summary.json").read_text())
    expected = replayed["unfixed"]
    # vLLM's scheduler (the engine) and kvtrace's model of it (replay) schedule alike
    # (tests/test_scheduler_vs_vllm.py), so vLLM's own figures equal replay's.
    for key in ("requests", "prompt_tokens", "hit_tokens", "hit_rate", "preemptions"):
        assert summary[key] == expected[key], key
    assert expected["hit_tokens"] > 0
    assert done == f"kvtrace engine: done (40 requests, hit rate {expected['hit_rate']:.4f})"
    # Accelerated real time: each step waited for its virtual start time / speed.
    last_step_starts_s = summary["virtual_s"] - 0.1
    assert last_step_starts_s / SPEED <= summary["wall_s"] < summary["virtual_s"] / SPEED + 5

    engine.send("start")
    assert engine.expect("kvtrace engine: the workload already ran")
    engine.send("quit")
    assert engine.process.wait(timeout=30) == 0
    assert engine.expect("kvtrace engine: exiting (quit)", timeout=5)


@pytest.mark.slow
def test_idle_engine_blocks_its_main_thread_and_exits_on_sigterm(engines):
    engine = engines[0]["idle"]
    engine.expect("kvtrace engine: pid ")
    pid = engine.process.pid
    time.sleep(0.3)  # let start-up threads settle
    state, ticks = thread_stat(pid)
    time.sleep(1.0)
    later_state, later_ticks = thread_stat(pid)
    assert (state, later_state) == ("S", "S")
    assert later_ticks == ticks  # not one clock tick of CPU in a second of idling
    if platform.machine() == "x86_64":
        syscall = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()[0]
        assert syscall == "202"  # futex: the lock under queue.get()

    engine.process.send_signal(signal.SIGTERM)
    assert engine.process.wait(timeout=30) == 0
    assert engine.expect("kvtrace engine: exiting (SIGTERM)", timeout=5)


def test_stdin_reader_queues_commands_and_quits_at_end_of_input():
    commands: queue.Queue[str] = queue.Queue()
    complaints: list[str] = []
    read_commands(io.BytesIO(b"start\n\n  START \nbogus\n").read, commands, complaints.append)
    assert [commands.get_nowait() for _ in range(commands.qsize())] == [START, START, END_OF_INPUT]
    assert complaints == ["unknown command 'bogus' (send start or quit)"]


@pytest.mark.parametrize("args, message", [
    (["missing.kvtrace"], "no such trace"),
    (["{workload}", "--variant", "bogus"], "bogus"),
    (["{workload}", "--retention", "often"], "--retention 'often'"),
    (["{workload}", "--num-gpu-blocks", "1"], "leaves no usable block"),
])
def test_bad_input_is_one_error_and_a_hint(args, message, workload, tmp_path):
    args = [a.format(workload=workload) for a in args]
    handler = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(cli, ["engine", *args], catch_exceptions=False)
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert len(lines) == 2 and lines[0].startswith("kvtrace: error: ") and message in lines[0]
    assert lines[1].startswith("kvtrace: hint: ")
    assert signal.getsignal(signal.SIGTERM) is handler  # restored


@pytest.mark.slow
def test_a_process_wide_capture_sees_every_call_of_the_engines_cache(workload, capsys):
    """The engine arms no probes of its own, so a capture's catch-all probes see its cache:
    the figures counted from the captured records equal the engine's own. (In-process, with
    the engine's own loop: vLLM is imported once here.)"""
    from kvtrace.events import HashInterner, RequestArrived
    from kvtrace.probes import CacheProbes
    from kvtrace.replay.summary import ReplaySummary
    from kvtrace.engine.core import Engine, EngineOptions, load_workload

    options = EngineOptions(str(workload), variant="unfixed", speed=0)
    engine = Engine(options, load_workload(options))
    records: list = []
    # The engine's request ids are its workload's request numbers.
    probes = CacheProbes(records.append, HashInterner(), req_number=int).arm()
    # As with --autostart < /dev/null: the end of input, heard mid-run, ends it only after.
    engine.commands.put(START)
    engine.commands.put(END_OF_INPUT)
    try:
        before_s = time.time()
        assert engine.serve() == END_OF_INPUT
    finally:
        probes.disarm()
    captured = ReplaySummary(None)
    for record in records:
        captured(record)
    figures = captured.to_dict()
    for key in ("requests", "prompt_tokens", "hit_tokens", "preemptions"):
        assert figures[key] == engine.summary[key], key
    assert engine.summary["hit_tokens"] > 0
    assert probes.num_failures == 0
    # Arrivals carry the wall clock, as vLLM's front end stamps requests.
    arrival_s = [r.arrival_ns / 1e9 for r in records if isinstance(r, RequestArrived)]
    assert len(arrival_s) == 40
    assert all(before_s - probes.created_ns / 1e9 - 1 <= s <= time.time() for s in arrival_s)
    assert "done (40 requests" in capsys.readouterr().out
