"""A Prometheus endpoint for a trace being written: ``GET /metrics`` answers the live figures
(``kvtrace.analysis.live``) in Prometheus' text exposition format 0.0.4.

``kvtrace top --metrics-port`` serves the figures it shows; ``kvtrace capture`` serves those of
the trace or ring directory it writes. The endpoint binds 127.0.0.1 unless told otherwise: the
figures hold hash ids and counts only, but they are the operator's to publish.
"""

from __future__ import annotations

import errno
import http.server
import math
import os
import socket
import threading
from collections.abc import Callable

from kvtrace.analysis.live import Figures, LiveSource
from kvtrace.analysis.trace_tail import NothingToTailError
from kvtrace.errors import KvtraceError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# (name, type, help, value): one sample each, then the missed tokens per cause
METRICS: tuple[tuple[str, str, str, Callable[[Figures], float | None]], ...] = (
    ("kvtrace_records_total", "counter", "Records read from the trace.",
     lambda f: f.records),
    ("kvtrace_trace_time_seconds", "gauge",
     "Trace time of the newest timestamped record (seconds since the trace began).",
     lambda f: f.ts_s),
    ("kvtrace_first_admissions_total", "counter",
     "Requests' first admitted prefix lookups (counter_reconciliation's admitted_first_lookups).",
     lambda f: f.lookups),
    ("kvtrace_first_admission_query_tokens_total", "counter",
     "Prompt tokens of the first admissions.", lambda f: f.query_tokens),
    ("kvtrace_first_admission_hit_tokens_total", "counter",
     "Prefix-cache hit tokens of the first admissions.", lambda f: f.hit_tokens),
    ("kvtrace_hit_rate", "gauge",
     "First-admission hit rate (hit tokens / prompt tokens) over the last window of trace time.",
     lambda f: f.hit_rate),
    ("kvtrace_hit_rate_window_seconds", "gauge", "The window kvtrace_hit_rate covers.",
     lambda f: f.window_s),
    ("kvtrace_transient_checkpoint_blocks", "gauge",
     "Blocks cached in the free queue whose newest key is a transient Mamba checkpoint.",
     lambda f: f.transient_checkpoints),
    ("kvtrace_checkpoint_share", "gauge",
     "Transient checkpoint blocks over the usable pool (num_gpu_blocks - 1).",
     lambda f: f.checkpoint_share),
    ("kvtrace_pushouts_total", "counter",
     "Checkpoint pushouts: hot prefixes LRU-evicted while transient checkpoints sat cached.",
     lambda f: f.pushouts),
    ("kvtrace_pushouts_per_minute", "gauge",
     "Checkpoint pushouts per minute over the last window of trace time.",
     lambda f: f.pushouts_per_min),
)
MISSED = ("kvtrace_missed_tokens_total", "counter",
          "Missed prompt tokens of the first admissions, by miss-attribution cause.")
UP = ("kvtrace_up", "gauge", "1 while the source is read, 0 before its header or after an error.")


def exposition(figures: Figures, up: bool) -> str:
    """``figures`` in the text exposition format 0.0.4."""
    lines: list[str] = []

    def family(name: str, kind: str, text: str, samples: list[tuple[str, float | None]]) -> None:
        lines.append(f"# HELP {name} {_escape(text, quote=False)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_value(value)}" for labels, value in samples)

    family(*UP, [("", int(up))])
    for name, kind, text, value in METRICS:
        family(name, kind, text, [("", value(figures))])
    family(*MISSED, [(f'{{cause="{_escape(cause)}"}}', tokens)
                     for cause, tokens in figures.misses_by_cause.items()])
    return "\n".join(lines) + "\n"


def _escape(text: str, quote: bool = True) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def _value(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if isinstance(value, float) else str(int(value))


class MetricsServer:
    """Serves ``GET /metrics`` for ``source`` from threads of its own until ``close``.

    ``source``: a trace being written or a ring directory, followed every ``interval_s`` (one
    that is not there yet is waited for: a capture's first segment), or a ``LiveSource`` that
    its owner updates (``kvtrace top``'s). ``port`` 0 takes a free port; ``port`` says which.
    An error reading the source stops the following (``error``) and ``kvtrace_up`` reads 0."""

    def __init__(self, source: str | os.PathLike | LiveSource, host: str = "127.0.0.1",
                 port: int = 0, *, interval_s: float = 1.0) -> None:
        self._owned = not isinstance(source, LiveSource)
        self._live: LiveSource | None = None if self._owned else source
        self._path = None if not self._owned else os.fspath(source)
        self.error: KvtraceError | None = None
        self._stop = threading.Event()
        server_class = _Server6 if ":" in host else _Server
        try:
            self._http = server_class((host, port), _Handler)
        except (OSError, OverflowError) as error:
            raise _bind_error(host, port, error) from None
        self._http.metrics = self._text
        self.host, self.port = self._http.server_address[:2]
        self._threads = [threading.Thread(target=self._http.serve_forever, args=(0.2,),
                                          name="kvtrace-metrics", daemon=True)]
        if self._owned:
            self._threads.append(threading.Thread(target=self._follow, args=(interval_s,),
                                                  name="kvtrace-metrics-tail", daemon=True))
        for thread in self._threads:
            thread.start()

    def _follow(self, interval_s: float) -> None:
        while True:
            try:
                if self._live is None:
                    self._live = LiveSource(self._path)
                while self._live.update(max_batches=64) and not self._stop.is_set():
                    pass  # catching up
            except NothingToTailError:
                pass  # not there yet
            except KvtraceError as error:
                self.error = error
                return
            if self._stop.wait(interval_s):
                return

    def _text(self) -> bytes:
        live = self._live
        up = live is not None and live.tail.header is not None and self.error is None
        return exposition(live.figures() if live is not None else Figures(), up).encode()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._stop.set()
        self._http.shutdown()
        self._http.server_close()
        for thread in self._threads:
            thread.join()
        if self._owned and self._live is not None:
            self._live.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind_error(host: str, port: int, error: Exception) -> KvtraceError:
    where = f"{host}:{port}"
    if getattr(error, "errno", None) == errno.EADDRINUSE:
        return KvtraceError(f"cannot serve metrics on {where}: port {port} is in use",
                            f"Give another port, or stop what listens on port {port} "
                            f"(ss -ltnp 'sport = :{port}' names it).")
    if isinstance(error, OverflowError):
        return KvtraceError(f"cannot serve metrics on {where}: no such port",
                            "Give a port from 1 to 65535 (0: any free one).")
    reason = getattr(error, "strerror", None) or str(error)
    return KvtraceError(f"cannot serve metrics on {where}: {reason}",
                        "Give an address of this host (127.0.0.1 by default), and a port from "
                        "1024 up unless running as root.")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    metrics: Callable[[], bytes]


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "kvtrace"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.partition("?")[0] != "/metrics":
            self._answer(404, b"kvtrace serves /metrics only\n", "text/plain; charset=utf-8")
            return
        self._answer(200, self.server.metrics(), CONTENT_TYPE)

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        """Quiet: a scrape every few seconds is no news."""
