"""What ``kvtrace capture`` runs beside each engine core's capture, in the controller: the live
figures a ``--trigger`` watches and the incidents it writes, the ``--metrics-port`` endpoint,
and vLLM's own counters (``--vllm-metrics``). Here, not in capture/, since it reads traces
live (analysis) and capture/ runs inside vLLM, which may import neither.

An incident is a ``kvtrace dump`` of the ring from ``keep_s`` before the moment the trigger
fired to ``keep_s`` after: it is written once that much time has passed, or at once when the
capture ends first, with what the ring holds then.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

import click

from kvtrace.cli.common import wall_clock
from kvtrace.errors import KvtraceError

UPDATE_BUDGET_S = 0.2  # catching up on a busy engine's records, per status tick


@dataclass
class _Beside:
    """One engine core's companions."""

    target: Any
    path: str  # its trace, or its ring directory
    ring: bool
    live: Any = None  # analysis.live.LiveSource, once its source has a header
    watch: Any = None  # analysis.trigger.TriggerWatch
    pending: list[int] = field(default_factory=list)  # wall ns each unwritten incident fired
    metrics: Any = None


class Alongside:
    def __init__(self, *, trigger: str | None, keep_s: float, incident_dir: str,
                 window_s: float, metrics_host: str, metrics_port: int | None,
                 vllm_metrics: str | None) -> None:
        from kvtrace.analysis.trigger import parse_trigger

        self.trigger = parse_trigger(trigger) if trigger else None
        self.keep_ns = int(keep_s * 1e9)
        self.incident_dir = incident_dir
        self.window_s = window_s
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self.vllm_metrics = vllm_metrics
        self.counters = None  # capture.vllm_metrics.CounterRecorder: one for all engine cores
        self.beside: list[_Beside] = []

    def start_counters(self, trace_path: str) -> None:
        """Record vLLM's counters beside ``trace_path`` (the capture's ``-o``, before any
        rank's suffix: the API server's /metrics counts every rank), before arming."""
        if self.vllm_metrics is not None:
            from kvtrace.capture.vllm_metrics import CounterRecorder

            self.counters = CounterRecorder(self.vllm_metrics, trace_path).start()

    def start(self, target, path: str, ring: bool) -> None:
        """Start what goes beside ``target``'s capture, which writes ``path``."""
        from kvtrace.analysis.trigger import TriggerWatch

        beside = _Beside(target, path, ring)
        self.beside.append(beside)
        if self.trigger is not None:
            beside.watch = TriggerWatch(self.trigger)
            _private_dir(self.incident_dir)
            self._follow(beside)
        if self.metrics_port is not None:
            from kvtrace.analysis.metrics_http import MetricsServer

            # The trigger's live figures when there are (``tick`` updates them), else the
            # server follows the capture itself.
            port = self.metrics_port + len(self.beside) - 1 if self.metrics_port else 0
            beside.metrics = MetricsServer(beside.live or path, self.metrics_host, port)
            click.echo(f"kvtrace: pid {target.pid}: live figures at {beside.metrics.url}",
                       err=True)

    def tick(self) -> None:
        """Follow each capture's records, fire the trigger, write the incidents now due."""
        for beside in self.beside:
            if beside.watch is None:
                continue
            figures = self._update(beside)
            if figures is not None and figures.ts_s is not None and beside.watch.update(figures):
                fired_ns = beside.live.tail.header.created_ns + int(figures.ts_s * 1e9)
                beside.pending.append(fired_ns)
                click.echo(f"kvtrace: pid {beside.target.pid}: trigger '{self.trigger.text}' "
                           f"fired at {wall_clock(fired_ns)}; the incident follows in "
                           f"{self.keep_ns / 1e9:g} s", err=True)
            while beside.pending and time.time_ns() >= beside.pending[0] + self.keep_ns:
                self._write_incident(beside, beside.pending.pop(0))

    def _follow(self, beside: _Beside):
        """``beside``'s live figures, made at the first call its capture's file is there."""
        from kvtrace.analysis.live import LiveSource
        from kvtrace.analysis.trace_tail import NothingToTailError

        if beside.live is None:
            try:
                beside.live = LiveSource(beside.path, owners=(0, os.geteuid(),
                                                              beside.target.uid),
                                         window_s=self.window_s)
            except NothingToTailError:
                pass  # the engine's next step writes it
        return beside.live

    def _update(self, beside: _Beside):
        from kvtrace.analysis.trace_tail import NothingToTailError

        live = self._follow(beside)
        if live is None:
            return None
        try:
            deadline = time.monotonic() + UPDATE_BUDGET_S
            while live.update(max_batches=64) and time.monotonic() < deadline:
                pass
        except NothingToTailError:
            return None
        return live.figures()

    def _write_incident(self, beside: _Beside, fired_ns: int) -> None:
        from kvtrace.capture.dump import dump

        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(fired_ns / 1e9))
        rank = f"-{beside.target.rank_suffix}" if beside.target.rank_suffix else ""
        path = os.path.join(self.incident_dir, f"incident-{stamp}{rank}.kvtrace")
        try:
            written = dump(beside.path, path, since_ns=fired_ns - self.keep_ns,
                           until_ns=fired_ns + self.keep_ns)
        except KvtraceError as error:  # the capture goes on; the next firing may do better
            click.echo(f"kvtrace: pid {beside.target.pid}: the incident of {wall_clock(fired_ns)} "
                       f"could not be written: {error}", err=True)
            return
        click.echo(f"kvtrace: pid {beside.target.pid}: incident of {wall_clock(fired_ns)}: "
                   f"{written.num_records:,} records from {wall_clock(written.first_ns)} to "
                   f"{wall_clock(written.last_ns)} -> {path}", err=True)

    def close(self) -> None:
        """The capture ended: write the incidents still waiting with what the rings hold, and
        stop serving."""
        for beside in self.beside:
            for fired_ns in beside.pending:
                self._write_incident(beside, fired_ns)
            beside.pending.clear()
            for companion in (beside.metrics, beside.live):
                if companion is not None:
                    companion.close()
        if self.counters is not None:
            self.counters.close()
            click.echo(f"kvtrace: vLLM's counters: {self.counters.scrapes:,} scrapes, "
                       f"{self.counters.failures:,} failed -> {self.counters.path}", err=True)


def _private_dir(path: str) -> None:
    """Make the incidents' directory (0700) if missing; refuse one that is not a directory of
    this user's closed to others' writes, or a link."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise KvtraceError(f"cannot make --incident-dir {path}: {error.strerror}",
                           "Give a directory this user can create.") from None
    info = os.lstat(path)
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid()
            or stat.S_IMODE(info.st_mode) & 0o022):
        raise KvtraceError(f"--incident-dir {path} is not a directory of this user's that "
                           "only it can write", "Give a new path, or fix its owner and mode.")
