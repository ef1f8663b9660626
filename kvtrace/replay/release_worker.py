"""The worker process that replays one variant on another vLLM release
(``python -m kvtrace.replay.release_worker WORKDIR``; the parent side is ``other_release``).

It runs the same ``replay`` on the variant of its job, writing its trace where the parent staged
it, and hands back the result (or the ``KvtraceError`` it raised; a full disk is one too) in a
file. A worker dies with its replay, even a SIGKILLed one: the kernel sends it SIGTERM then
(PR_SET_PDEATHSIG), and a worker whose replay is gone removes what that replay staged for it
(its job's directory, the directory its trace was going into), which nobody else would.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import sys
import time
from pathlib import Path

from kvtrace.children import die_with_parent
from kvtrace.engine_config import KEEP
from kvtrace.errors import KvtraceError
from kvtrace.files import OutputError, write_failure
from kvtrace.replay.other_release import KEEP_MARK, Job


def main(work: str) -> None:
    job: Job = pickle.loads(Path(work, "job.pickle").read_bytes())
    signal.signal(signal.SIGTERM, lambda signum, _frame: _stop(job, signum))
    if not die_with_parent(job.parent, signal.SIGTERM):
        _stop(job, signal.SIGTERM)
    try:
        _run(job, work)
    except BaseException:
        _await_orphaning(job)
        raise
    finally:  # however it ends: once its replay died, vLLM's next log line to the replay's
        _remove_if_orphaned(job)  # pipe raises BrokenPipeError, maybe before the SIGTERM


def _run(job: Job, work: str) -> None:
    from kvtrace.replay.run import replay

    options = job.options
    if options.overrides.retention_interval == KEEP_MARK:
        options = dataclasses.replace(options, overrides=dataclasses.replace(
            options.overrides, retention_interval=KEEP))
    try:
        outcome = ("ok", replay(options))
    except KvtraceError as error:
        outcome = _error(error)
    except OSError as error:
        if write_failure(error) is None:
            raise
        written = error.filename or f"the {options.variants[0]} trace in {job.outdir}"
        outcome = _error(OutputError(f"cannot write {written}: {error.strerror}"))
    result_path = os.path.join(work, "result.pickle")
    with open(os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
        pickle.dump(outcome, file)


def _error(error: KvtraceError) -> tuple:
    return "error", type(error).__name__, str(error), error.hint


def _stop(job: Job, signum: int) -> None:
    """SIGTERM, sent by the kernel when the replay died or by anyone."""
    _await_orphaning(job)
    _remove_if_orphaned(job)
    os._exit(128 + signum)


# How long a worker whose run broke waits to learn whether its replay is dying.
ORPHANING_GRACE_S = 2.0


def _await_orphaning(job: Job) -> None:
    """A replay dies a thread at a time, and the worker learns of it before the replay is
    gone: its write to the replay's pipe fails once the pipe is closed, and the kernel sends
    the parent-death SIGTERM when the thread that started the worker exits, handing the
    worker to another thread of the same, dying replay (``getppid`` still names it). The
    worker waits a moment for the replay to be gone, so that the check that follows finds it
    orphaned and removes what the replay staged (before, a SIGKILLed replay's staged
    ``.partial`` directory was left behind now and then)."""
    deadline = time.monotonic() + ORPHANING_GRACE_S
    while os.getppid() == job.parent and time.monotonic() < deadline:
        time.sleep(0.01)


def _remove_if_orphaned(job: Job) -> None:
    """A worker whose replay is gone removes what the replay staged for it."""
    if os.getppid() != job.parent:
        for path in job.leftovers:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
