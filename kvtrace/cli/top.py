"""``kvtrace top``: the prefix cache of a trace being written, live, in the terminal."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import click

from kvtrace.cli.capture import METHODS, PID, parse_duration

RING = "10m"  # the ring `kvtrace top --pid` has its capture keep
SPARKS = "▁▂▃▄▅▆▇█"
NO_VALUE = "-"
CAUGHT_UP_SHARE = 0.5  # of --interval, reading what was written before the screen is redrawn
START_WAIT_S = 300.0  # for --pid's capture to write its first segment (an attach takes a while)


@click.command("top")
@click.argument("source", required=False, type=click.Path())
@click.option("--pid", type=PID,
              help="Capture this vLLM engine (or the API server above it) into a private ring "
                   f"directory ({RING}) and show it; the capture stops when top does.")
@click.option("--method", type=click.Choice(METHODS), default=None,
              help="With --pid: how the capture gets its hook into the engine (as `kvtrace "
                   "capture --method`; default auto).")
@click.option("--interval", type=click.FloatRange(min=0.1, max=3600), default=1.0,
              show_default=True, help="Seconds between redraws.")
@click.option("--window", default="60s", show_default=True,
              help="Trace time the hit rate \"now\" and pushouts per minute cover (30s, 5m).")
@click.option("--once", is_flag=True,
              help="Print one frame of what is there now to stdout and exit (for scripts).")
@click.option("--metrics-port", type=click.IntRange(min=0, max=65535),
              help="Also serve the figures for Prometheus at http://HOST:PORT/metrics (0: any "
                   "free port, printed on stderr).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="With --metrics-port: the address to serve on.")
def command(source: str | None, pid: int | None, method: str | None, interval: float,
            window: str, once: bool, metrics_port: int | None, metrics_host: str) -> None:
    """Show a trace as it is written: the first-admission hit rate now and over the last
    minutes, transient checkpoints' share of the pool, checkpoint pushouts per minute, the hot
    prefixes evicted most and the missed tokens by cause. Refreshed every --interval; q or
    Ctrl-C quits.

    SOURCE is a trace being written (kvtrace capture -o) or a ring directory (kvtrace capture
    --ring --dir). With --pid, top runs that capture itself.

    \b
    Examples:
        kvtrace top prod.kvtrace
        kvtrace top /var/lib/kvtrace/ring --metrics-port 9464
        kvtrace top --pid $(pgrep -f "vllm serve" | head -1)
        kvtrace top prod.kvtrace --once
    """
    if (source is None) == (pid is None):
        raise click.UsageError("give SOURCE or --pid (one of them)")
    if method is not None and pid is None:
        raise click.UsageError("--method goes with --pid")
    if metrics_port is None and metrics_host != "127.0.0.1":
        raise click.UsageError("--metrics-host goes with --metrics-port")
    window_s = parse_duration(window, "--window")
    with contextlib.ExitStack() as stack:
        owners = None
        if pid is not None:
            capture = stack.enter_context(_Capture(pid, method or "auto"))
            source, owners = capture.wait_for_ring(), capture.owners
        from kvtrace.analysis.live import LiveSource

        live = LiveSource(source, owners=owners, window_s=window_s)
        stack.callback(live.close)
        if metrics_port is not None:
            from kvtrace.analysis.metrics_http import MetricsServer

            server = stack.enter_context(MetricsServer(live, metrics_host, metrics_port))
            click.echo(f"kvtrace top: serving {server.url}", err=True)
        if once:
            if pid is not None:
                time.sleep(interval)
            _catch_up(live, None)
            if live.tail.header is None:
                raise live.tail.waiting
            _print_frame(live, source)
            return
        _show(live, source, interval, capture if pid is not None else None)


def _catch_up(live, seconds: float | None) -> bool:
    """Feed what was written, for at most ``seconds``; whether it caught up."""
    end = None if seconds is None else time.monotonic() + seconds
    while live.update(max_batches=16):
        if end is not None and time.monotonic() > end:
            return False
    return True


def _print_frame(live, source: str) -> None:
    from rich.console import Console

    from kvtrace.cli.common import stdout_failures

    with stdout_failures():
        Console(highlight=False, soft_wrap=True).print(  # whole lines, for scripts
            frame(live.figures(), source, _status(live, True)))


def _show(live, source: str, interval: float, capture) -> None:
    from rich.console import Console
    from rich.live import Live

    console = Console(highlight=False)
    with _keys() as keys, Live(console=console, screen=True, auto_refresh=False,
                               redirect_stderr=False) as display:
        while True:
            caught_up = _catch_up(live, interval * CAUGHT_UP_SHARE)
            if capture is not None:
                capture.check()
            display.update(frame(live.figures(), source, _status(live, caught_up)),
                           refresh=True)
            if keys(interval) in ("q", "Q"):
                return


def _status(live, caught_up: bool) -> str:
    tail = live.tail
    if tail.header is None:
        return "waiting for the trace's header"
    said = ("complete: its writer closed it" if tail.complete
            else "following" if caught_up else "catching up")
    if tail.gaps:
        said += f"; {tail.gaps} segment(s) pruned before they were read"
    return said


@contextlib.contextmanager
def _keys():
    """A function that waits up to a timeout for a key press and returns it (None: none):
    the terminal in cbreak mode meanwhile (Ctrl-C still interrupts), or a plain wait when stdin
    is not a terminal."""
    import select

    stdin = sys.stdin
    if stdin is None or not stdin.isatty():
        yield lambda timeout: time.sleep(timeout)
        return
    import termios
    import tty

    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def key(timeout: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace") if ready else None

    try:
        yield key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


# --- the frame ----------------------------------------------------------------------------------


def percent(value: float | None) -> str:
    return NO_VALUE if value is None else f"{value:.1%}"


def per_minute(value: float | None) -> str:
    return NO_VALUE if value is None else f"{value:.1f}/min"


def span(seconds: float) -> str:
    """A window's length: 60 s, 5 min, 2 h."""
    if seconds < 120:
        return f"{seconds:g} s"
    return f"{seconds / 60:g} min" if seconds < 7200 else f"{seconds / 3600:g} h"


def duration(seconds: float | None) -> str:
    """Trace time as H:MM:SS."""
    if seconds is None:
        return NO_VALUE
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def sparkline(history) -> str:
    """One character per interval, its hit rate from 0 (lowest) to 100% (highest); a dot for
    an interval without a first admission."""
    return "".join("·" if point.hit_rate is None
                   else SPARKS[min(int(point.hit_rate * len(SPARKS)), len(SPARKS) - 1)]
                   for point in history)


def frame(figures, source: str, status: str):
    """The screen for ``figures`` (a rich renderable); every figure it shows is formatted by the
    functions above, so that a test can find them."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from kvtrace.cli.common import terminal_safe

    f = figures
    window = span(f.window_s)
    lines = [
        Text(f"kvtrace top  {terminal_safe(source)}", style="bold"),
        Text(status),
        Text(f"trace time {duration(f.ts_s)}; records {f.records:,}; "
             f"first admissions {f.lookups:,}"),
        Text(""),
        Text(f"hit rate, first admissions: last {window} {percent(f.hit_rate)}; "
             f"since start {percent(f.hit_tokens / f.query_tokens if f.query_tokens else None)}"),
        Text(f"  per {span(f.interval_s)}, last {len(f.hit_rate_history)}: "
             f"{sparkline(f.hit_rate_history)}  now {percent(_last_rate(f.hit_rate_history))}"),
        Text(f"transient checkpoints: {f.transient_checkpoints:,} blocks, "
             f"{percent(f.checkpoint_share)} of the pool"
             + (f" ({f.pool_blocks:,} blocks)" if f.pool_blocks is not None else "")),
        Text(f"checkpoint pushouts: {per_minute(f.pushouts_per_min)} over the last {window}; "
             f"{f.pushouts:,} in all"),
        Text(""),
    ]
    hot = Table(title="hot prefixes evicted most", title_justify="left", box=None,
                show_edge=False, pad_edge=False)
    for column in ("hash id", "evictions", "pushouts", "tokens"):
        hot.add_column(column, justify="right")
    for prefix in f.hot_evicted:
        hot.add_row(str(prefix.hash_id), f"{prefix.evictions:,}", f"{prefix.pushouts:,}",
                    f"{prefix.depth_tokens:,}")
    misses = Table(title="missed tokens by cause, first admissions", title_justify="left",
                   box=None, show_edge=False, pad_edge=False)
    misses.add_column("cause")
    misses.add_column("tokens", justify="right")
    misses.add_column("of prompts", justify="right")
    for cause, tokens in sorted(f.misses_by_cause.items(), key=lambda item: -item[1]):
        if tokens:
            misses.add_row(cause, f"{tokens:,}",
                           percent(tokens / f.query_tokens if f.query_tokens else None))
    return Group(*lines, hot, Text(""), misses)


def _last_rate(history) -> float | None:
    return history[-1].hit_rate if history else None


# --- --pid: a capture of our own ------------------------------------------------------------------


class _Capture:
    """``kvtrace capture --pid P --ring 10m`` into a fresh private directory (0700), as a child
    process that dies with this one; stopped on exit as Ctrl-C stops it (SIGINT, then waited
    for), and its directory removed."""

    def __init__(self, pid: int, method: str) -> None:
        import shutil
        import tempfile

        self.directory = tempfile.mkdtemp(prefix="kvtrace-top-")
        self.owners = (0, os.geteuid())
        try:
            self._give_to_engine_user(pid)
            self._start(pid, method)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def _give_to_engine_user(self, pid: int) -> None:
        """As root, hand the directory to the engine's user, who writes the ring there (it is
        then that user's, still 0700: root reads it)."""
        if os.geteuid() != 0:
            return
        try:
            engine_uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return  # no such process: the capture says so
        if engine_uid != 0:
            os.chown(self.directory, engine_uid, -1)
            self.owners = (0, engine_uid)

    def _start(self, pid: int, method: str) -> None:
        import collections
        import functools
        import signal
        import subprocess
        import threading

        from kvtrace.children import die_with_parent, python_child

        argv, env = python_child("kvtrace", "capture", "--pid", str(pid), "--method", method,
                                 "--ring", RING, "--dir", os.path.join(self.directory, "ring"))
        click.echo(f"kvtrace top: starting kvtrace capture --pid {pid} --ring {RING} "
                   f"(into {self.directory})", err=True)
        self.process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM))
        self.said: collections.deque[str] = collections.deque(maxlen=20)
        self._pump = threading.Thread(target=self._read_output, daemon=True)
        self._pump.start()

    def _read_output(self) -> None:
        for line in self.process.stdout:
            self.said.append(line.rstrip("\n"))

    def wait_for_ring(self) -> str:
        """The ring directory once it holds a segment (of the first rank, for several)."""
        from kvtrace.ring import list_segments

        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            self.check()
            for name in sorted(os.listdir(self.directory)):
                path = os.path.join(self.directory, name)
                with contextlib.suppress(OSError):
                    if name.startswith("ring") and list_segments(path):
                        return path
            time.sleep(0.2)
        from kvtrace.errors import KvtraceError

        raise KvtraceError(f"kvtrace capture wrote no ring segment within {START_WAIT_S:.0f} s",
                           "Run `kvtrace -v capture --pid PID --ring 10m --dir DIR` to see "
                           "where it stops.")

    def check(self) -> None:
        """Raise if the capture ended (it runs until top stops it)."""
        code = self.process.poll()
        if code is None:
            return
        self._pump.join(timeout=1)
        from kvtrace.cli.common import terminal_safe
        from kvtrace.errors import KvtraceError

        errors = [line for line in self.said if line.startswith("kvtrace: error: ")]
        said = errors[-1].removeprefix("kvtrace: error: ") if errors else (
            self.said[-1] if self.said else "")
        raise KvtraceError(f"kvtrace capture exited (status {code})"
                           + (f": {terminal_safe(said)}" if said else ""),
                           "Run the same capture alone to see why: kvtrace capture --pid PID "
                           "--ring 10m --dir DIR.")

    def stop(self) -> None:
        import shutil
        import signal
        import subprocess

        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> _Capture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
