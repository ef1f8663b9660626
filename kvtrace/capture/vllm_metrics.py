"""vLLM's own prefix-cache counters, recorded beside a capture so that they can be reconciled
with the trace (``kvtrace.analysis.vllm_counters``, docs/vllm-counters.md).

``CounterRecorder`` scrapes the API server's ``/metrics`` (Prometheus text) every
``interval_s`` on a daemon thread and appends the counters that the reconciliation reads
(``KEPT_PREFIXES``: their ``_total`` samples, with their labels) to a sidecar file,
``<trace path>.vllm-metrics.jsonl``: one JSON object a scrape,
``{"ts_ns": wall clock when the answer was read, "samples": [{"name", "labels", "value"}]}``.
Nothing else of the answer is kept. The sidecar is made as kvtrace makes files in shared
directories (``safe_paths``): in a directory trusted for this user, mode 0600, with
``O_CREAT|O_EXCL|O_NOFOLLOW``; a link or anything but a regular file at its name is refused.

Stdlib and kvtrace's capture helpers only: it runs beside the engine, in ``kvtrace capture``.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kvtrace.capture.safe_paths import open_trusted_dir, replace_file
from kvtrace.errors import KvtraceError, UnsafePathError
from kvtrace.files import cannot_write

# The sidecar's name is the trace's plus this (kvtrace.analysis.vllm_counters reads it; analysis
# may not import capture, so each module has the name and a test holds them equal).
SIDECAR_SUFFIX = ".vllm-metrics.jsonl"
# The counters kept: vLLM's prefix-cache queries and hits (tokens), its preemptions and its
# finished requests, per engine (label ``engine``) and, for the last, per finish reason.
KEPT_PREFIXES = ("vllm:prefix_cache_", "vllm:num_preemptions", "vllm:request_success")
QUERIES = "vllm:prefix_cache_queries_total"  # the one counter a vLLM /metrics must have
TIMEOUT_S = 2.0
MAX_ANSWER_BYTES = 16 << 20  # a /metrics page is tens to hundreds of KB
DEFAULT_PORT = 8000  # vllm serve's --port default

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class MetricsError(KvtraceError):
    """vLLM's /metrics cannot be scraped, or is not vLLM's."""

    default_hint = ("Give the API server's metrics endpoint, e.g. http://127.0.0.1:8000/metrics "
                    "(vllm serve's --host and --port); vLLM serves it unless started with "
                    "--disable-log-stats.")


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text page (exposition format 0.0.4) as (name, labels,
    value); comments, ``# HELP`` and ``# TYPE`` lines are skipped. A line that is not a sample
    raises ``MetricsError`` naming it."""
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _SAMPLE.fullmatch(line)
        try:
            if match is None:
                raise ValueError
            labels = _labels(match.group(2) or "")
            samples.append((match.group(1), labels, float(match.group(3))))
        except ValueError:
            raise MetricsError(f"line {number} of the metrics page is not a Prometheus sample: "
                               f"{line[:200]!r}") from None
    return samples


def _labels(text: str) -> dict[str, str]:
    labels, position = {}, 0
    while position < len(text.rstrip()):
        match = _LABEL.match(text, position)
        if match is None or match.end() == position:
            raise ValueError(text)
        labels[match.group(1)] = re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group()],
                                        match.group(2))
        position = match.end()
    return labels


def kept(samples: list[tuple[str, dict[str, str], float]]) -> list[dict]:
    """The counters the reconciliation reads (``KEPT_PREFIXES``, ``_total``), finite values."""
    return [{"name": name, "labels": labels, "value": value} for name, labels, value in samples
            if name.startswith(KEPT_PREFIXES) and name.endswith("_total") and math.isfinite(value)]


class _HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, request, fp, code, message, headers, new_url):
        if urllib.parse.urlsplit(new_url).scheme not in ("http", "https"):
            raise MetricsError(f"{request.full_url} redirects to {new_url}, not http(s)")
        return super().redirect_request(request, fp, code, message, headers, new_url)


# No proxy (a loopback scrape must not leave the host), redirects to http(s) only.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _HttpRedirectsOnly)


def scrape(url: str, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """One GET of ``url``: its kept counters. ``MetricsError`` when it cannot be read or holds
    no ``vllm:prefix_cache_queries_total``."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as answer:
            body = answer.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as error:
        raise MetricsError(f"{url} answered HTTP {error.code} {error.reason}") from None
    except (OSError, ValueError, http.client.HTTPException) as error:  # refused, timed out, TLS
        reason = getattr(error, "reason", None) or error
        raise MetricsError(f"cannot scrape {url}: {reason}") from None
    if len(body) > MAX_ANSWER_BYTES:
        raise MetricsError(f"{url} answered more than {MAX_ANSWER_BYTES >> 20} MiB")
    samples = kept(parse_metrics(body.decode("utf-8", errors="replace")))
    if not any(sample["name"] == QUERIES for sample in samples):
        raise MetricsError(f"{url} has no {QUERIES}: not vLLM's metrics endpoint")
    return samples


def sidecar_path(trace_path: str | os.PathLike) -> str:
    return os.fspath(trace_path) + SIDECAR_SUFFIX


def _create_sidecar(path: str) -> int:
    """The sidecar, new and open for appending: in a directory trusted for this user, mode
    0600, never through a link. A previous capture's sidecar (a regular file) is replaced;
    anything else at its name (a link, a FIFO, a directory) is refused and left alone."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        dir_fd = open_trusted_dir(directory, os.geteuid())
    except FileNotFoundError:
        raise KvtraceError(f"cannot write {path}: {directory} does not exist",
                           "Pick an -o path in a directory that exists.") from None
    try:
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise UnsafePathError(f"{path} exists and is not a regular file (mode {mode:o}); "
                                  "kvtrace will not write vLLM's counters there")
        try:
            return replace_file(name, dir_fd)
        except OSError as error:
            raise cannot_write(path, error) from None
    finally:
        os.close(dir_fd)


class CounterRecorder:
    """Records vLLM's counters at ``url`` beside the trace at ``trace_path`` every
    ``interval_s`` until ``close``. ``start`` scrapes once in the caller's thread and raises
    ``MetricsError`` (with a hint) if that fails, before any file is made; after that a failed
    scrape (or write) is counted in ``failures`` (``last_error`` says why) and retried at the
    next interval, never raised."""

    def __init__(self, url: str, trace_path: str | os.PathLike, interval_s: float = 1.0) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise MetricsError(f"{url!r} is not an http(s) URL; kvtrace scrapes vLLM's "
                               "metrics over http or https only")
        if not interval_s > 0:
            raise MetricsError(f"the scrape interval must be positive, not {interval_s}",
                               "Scrape every second or so (interval_s=1.0).")
        self.url, self.interval_s = url, interval_s
        self.path = sidecar_path(trace_path)
        self.scrapes = self.failures = 0
        self.last_error: str | None = None
        self._fd = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtrace-vllm-metrics",
                                        daemon=True)

    def start(self) -> CounterRecorder:
        first = scrape(self.url)
        self._fd = _create_sidecar(self.path)
        try:
            self._write(first)
        except OSError as error:
            self.close()
            raise cannot_write(self.path, error) from None
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write(scrape(self.url))
            except Exception as error:  # a daemon that must not die: counted, retried
                self.failures += 1
                self.last_error = str(error)

    def _write(self, samples: list[dict]) -> None:
        line = json.dumps({"ts_ns": time.time_ns(), "samples": samples},
                          separators=(",", ":")).encode() + b"\n"
        while line:
            line = line[os.write(self._fd, line):]
        self.scrapes += 1

    def close(self) -> None:
        """Stop scraping and close the sidecar (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def discover_metrics_url(pid: int) -> str | None:
    """The metrics URL of the vLLM API server ``pid`` (``vllm serve`` or
    ``python -m vllm.entrypoints.openai.api_server``), read from its command line: ``--host``
    (all interfaces: loopback), ``--port`` (default 8000), https with ``--ssl-certfile``. None
    when ``pid`` is not one, or its command line does not say (``--uds``, or a ``--config``
    file without ``--port``)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    is_server = "vllm.entrypoints.openai.api_server" in args or any(
        os.path.basename(arg) == "vllm" and args[index + 1:index + 2] == ["serve"]
        for index, arg in enumerate(args))
    options: dict[str, str] = {}
    for index, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name.startswith("--"):
            options[name] = value if equals else (args[index + 1] if index + 1 < len(args)
                                                  else "")
    if not is_server or "--uds" in options or ("--config" in options and "--port" not in options):
        return None
    host = options.get("--host") or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    port = options.get("--port", str(DEFAULT_PORT))
    if not port.isdigit():
        return None
    scheme = "https" if options.get("--ssl-certfile") else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}/metrics"
