"""`kvtrace engine`'s command input (kvtrace/engine/core.py): a line without end is skipped in
bounded memory, and an engine whose requests never arrive still quits cleanly."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_runs import KVTRACE, vllm_imported, workload  # noqa: F401


# Hardening round three, R8.
def test_the_engines_stdin_reader_skips_a_line_without_end():
    import io
    import queue

    from kvtrace.engine.core import COMMAND_LINE_BYTES, END_OF_INPUT, START, read_commands

    commands: queue.Queue[str] = queue.Queue()
    complaints: list[str] = []
    endless = b"\0" * (10 * COMMAND_LINE_BYTES)
    read_commands(io.BytesIO(endless + b"start\nstart\n" + endless).read, commands,
                  complaints.append)
    assert [commands.get_nowait() for _ in range(commands.qsize())] == [START, END_OF_INPUT]
    assert complaints == [f"a line longer than {COMMAND_LINE_BYTES} bytes, skipped (send start "
                          "or quit)"] * 2


# Hardening round three, R8.
@pytest.mark.slow
def test_an_engine_reading_dev_zero_stays_small(workload):
    """stdin lines were read whole: 8.3 GB in 30 s."""
    with open("/dev/zero", "rb") as zero:
        engine = subprocess.Popen([*KVTRACE, "engine", str(workload)], stdin=zero,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "ready" in engine.stdout.readline()

        def rss() -> int:
            status = Path(f"/proc/{engine.pid}/status").read_text()
            return int(status.split("VmRSS:")[1].split()[0]) << 10

        first = rss()
        time.sleep(3)
        assert rss() - first < 64 << 20
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(60) == 0
        assert engine.stderr.read().count("a line longer than") == 1
    finally:
        engine.kill()


# Hardening round three, R11.
@pytest.mark.slow
def test_an_engine_at_a_speed_that_never_arrives_quits_cleanly(workload):
    engine = subprocess.Popen([*KVTRACE, "engine", str(workload), "--speed", "1e-300",
                               "--autostart"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        lines = [engine.stdout.readline() for _ in range(2)]
        assert "running" in lines[1], lines
        time.sleep(1)
        out, err = engine.communicate("quit\n", timeout=60)
        assert engine.returncode == 0 and "exiting (quit)" in out, err
        assert "Traceback" not in err and "OverflowError" not in err
    finally:
        engine.kill()
