"""Ray for the commands that fan out on it (``kvtrace sweep --ray``, ``kvtrace load --ray``):
importing it with a clear error where it is missing, starting or joining an instance without
letting a stop land inside ``ray.init``, and shutting down what was started here.

Imports: the standard library and kvtrace's errors and children only; Ray inside functions.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvtrace.children import defer_stop, descendants, stop_signals_deferred, stops_heard
from kvtrace.errors import KvtraceError


def import_ray() -> Any:
    """The ``ray`` module, or the error that says how to install it."""
    try:
        import ray
    except ImportError:
        raise KvtraceError("--ray needs Ray, which is not installed",
                           "pip install 'kvtrace[ray]', or drop --ray to use local processes."
                           ) from None
    return ray


RAY_START_GRACE = 30.0  # seconds a stop heard while Ray starts waits for the start to end


def connect_to_ray(ray: Any, address: str, jobs: int, done_with_ray: threading.Event) -> None:
    """``ray.init`` for ``address``, in a thread of its own while this one holds the stop
    signals until it returns. Ray's driver takes SIGTERM for itself in the main thread
    (``sys.exit(15)``, its instance left running a minute), and a stop raised inside
    ``ray.init`` leaves its core worker half-built: the process then died of SIGSEGV (a timer
    of that worker) or SIGABRT (absl's SIGTERM hook arms a 3 s alarm that aborts), after
    saying "stopped by SIGTERM". A stop waits for the start up to ``RAY_START_GRACE``
    seconds, or until a second stop. The starting thread lives until ``done_with_ray`` is
    set: the processes of a local instance die with the thread that started them
    (PR_SET_PDEATHSIG)."""
    if threading.current_thread() is not threading.main_thread():
        _ray_init(ray, address, jobs)  # Ray leaves the stop handlers alone there
        return
    failure: list[BaseException] = []
    started = threading.Event()

    def start_and_hold() -> None:
        try:
            _ray_init(ray, address, jobs)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            failure.append(error)
        finally:
            started.set()
        done_with_ray.wait()

    alarm = signal.getsignal(signal.SIGALRM)
    with stop_signals_deferred(), _ray_thread_warning_muted():
        threading.Thread(target=start_and_hold, name="kvtrace-ray", daemon=True).start()
        heard_at = None
        while not started.wait(0.1) and stops_heard() < 2 and (
                heard_at is None or time.monotonic() - heard_at < RAY_START_GRACE):
            if stops_heard() and heard_at is None:
                heard_at = time.monotonic()
        signal.signal(signal.SIGTERM, defer_stop)  # unhooks absl, then its alarm is undone
        signal.alarm(0)
        if alarm is not None:  # None: not set from Python, nothing to put back
            signal.signal(signal.SIGALRM, alarm)
    if failure:
        raise failure[0]


def _ray_init(ray: Any, address: str, jobs: int) -> None:
    try:
        if address == "local":
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
        else:
            _check_listening(address)
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise KvtraceError(f"cannot connect to Ray at {address}: {error}",
                           "Start a cluster (ray start --head), give its address, or use "
                           "--ray local.") from None


@contextlib.contextmanager
def _ray_thread_warning_muted() -> Iterator[None]:
    """Ray warns that it set no SIGTERM handler outside the main thread: by design here."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SIGTERM handler is not set")

    logger = logging.getLogger("ray._private.worker")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def shut_down_ray(ray: Any) -> None:
    """``ray.shutdown()``, then SIGKILL for what it left of the processes this one started:
    an instance stopped while it started (SIGTERM inside ``ray.init``) left its dashboard and
    runtime-env agents running, orphaned, for minutes. The processes are held by pidfd from
    before the shutdown, so that no pid reused meanwhile is hit."""
    handles = []
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):  # gone already
            handles.append(os.pidfd_open(pid))
    try:
        ray.shutdown()
    finally:
        for handle in handles:
            with contextlib.suppress(OSError):  # gone as it should be
                signal.pidfd_send_signal(handle, signal.SIGKILL)
            os.close(handle)


def _check_listening(address: str) -> None:
    """Ray retries a ``HOST:PORT`` (or ``ray://HOST:PORT``, its client) where nothing listens
    for a minute or more: try it first, briefly."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or "://" in host:
        return  # auto, or a form Ray itself refuses at once
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, OverflowError) as error:
        raise ConnectionError(f"nothing answers there ({error})") from None
