"""An engine's control socket does not outlive it: a clean exit removes it (a forked
multiprocessing child too, which ends with ``os._exit``), and a server that starts removes the
sockets of engines that were killed; a live engine's socket, a link or another file stays."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SERVE = ("from kvtrace.capture.control import start_control_server\n"
         "print(start_control_server(), flush=True)\n"
         "input()\n")
FORKED = ("import multiprocessing\n"
          "from kvtrace.capture.control import start_control_server\n"
          "def engine(): print(start_control_server(), flush=True)\n"
          "child = multiprocessing.get_context('fork').Process(target=engine)\n"
          "child.start(); child.join()\n"
          "print(child.pid, flush=True)\n")


@pytest.fixture
def runtime(tmp_path, monkeypatch) -> Path:
    """This user's private runtime directory, under ``tmp_path``."""
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(tmp_path))
    directory = tmp_path / f"kvtrace-{os.getuid()}"
    directory.mkdir(mode=0o700)
    return directory


def serve(script: str = SERVE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def socket_file(path: Path) -> Path:
    """A socket file at ``path`` that nothing listens on, as a killed engine leaves it."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
    return path


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def test_a_clean_exit_removes_the_socket(runtime):
    engine = serve()
    path = Path(engine.stdout.readline().strip())
    assert path == runtime / f"engine-{engine.pid}.sock" and path.is_socket()
    engine.communicate("\n", timeout=60)
    assert engine.returncode == 0 and not path.exists()


def test_a_forked_engine_removes_its_socket_at_its_end(runtime):
    engine = serve(FORKED)
    out, _ = engine.communicate(timeout=60)
    path, pid = out.split()
    assert Path(path) == runtime / f"engine-{pid}.sock"
    assert not Path(path).exists() and os.listdir(runtime) == []


def test_a_starting_server_removes_only_the_sockets_of_dead_engines(runtime, tmp_path):
    dead = socket_file(runtime / f"engine-{dead_pid()}.sock")
    live = socket_file(runtime / f"engine-{os.getpid()}.sock")
    elsewhere = socket_file(tmp_path / "elsewhere.sock")
    link = runtime / f"engine-{dead_pid()}.sock"
    link.symlink_to(elsewhere)
    not_a_socket = runtime / f"engine-{dead_pid()}.sock"
    not_a_socket.write_text("")
    engine = serve()
    try:
        own = Path(engine.stdout.readline().strip())
        assert not dead.exists() and not os.path.lexists(dead)
        assert live.is_socket() and link.is_symlink() and elsewhere.is_socket()
        assert not_a_socket.is_file() and own.is_socket()
    finally:
        engine.communicate("\n", timeout=60)
