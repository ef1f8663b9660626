"""The release worker's own rules, in process: what it removes when its replay dies first.

The end-to-end check (a SIGKILLed replay, a real worker on another vLLM release) is
tests/test_child_processes.py; it caught the race below only now and then (about one run in
seven on a loaded machine). A replay dies a thread at a time: the worker hears of it (its write
to the replay's pipe fails, or the kernel's parent-death SIGTERM comes as the thread that
started it exits) while ``getppid`` still names the replay. Here that is made to happen every
time."""

from __future__ import annotations

import pickle
import signal

import pytest

from kvtrace.replay import release_worker
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.other_release import Job

PARENT = 4242


@pytest.fixture
def staged_job(tmp_path, monkeypatch):
    """A job whose replay staged a directory for it, run by ``main`` with its signal handler
    put back after."""
    staged = tmp_path / ".big.vllm-0.30.0.kvtrace.x.partial"
    staged.mkdir()
    (staged / "big.vllm-0.30.0.kvtrace").write_bytes(b"records")
    job = Job(ReplayOptions(source="big.kvtrace", outdir=str(tmp_path)), PARENT, str(tmp_path), (str(staged),))
    (tmp_path / "job.pickle").write_bytes(pickle.dumps(job))
    monkeypatch.setattr(release_worker, "die_with_parent", lambda parent, signum: True)
    previous = signal.getsignal(signal.SIGTERM)
    yield tmp_path, staged
    signal.signal(signal.SIGTERM, previous)


def parent_dies_after(monkeypatch, calls: int) -> None:
    """``os.getppid`` names the replay for ``calls`` calls, then init (the hand-over)."""
    answers = iter([PARENT] * calls)
    monkeypatch.setattr(release_worker.os, "getppid", lambda: next(answers, 1))


def broken_pipe(job, work):
    raise BrokenPipeError("the replay's pipe")


def test_a_worker_whose_run_broke_as_its_replay_died_removes_what_was_staged(
        staged_job, monkeypatch):
    work, staged = staged_job
    monkeypatch.setattr(release_worker, "_run", broken_pipe)
    parent_dies_after(monkeypatch, 5)  # still the replay's child when the write fails
    with pytest.raises(BrokenPipeError):
        release_worker.main(str(work))
    assert not staged.exists()


def test_a_worker_whose_replay_lives_leaves_its_staging_to_it(staged_job, monkeypatch):
    work, staged = staged_job
    monkeypatch.setattr(release_worker, "_run", broken_pipe)
    monkeypatch.setattr(release_worker, "ORPHANING_GRACE_S", 0.05)
    monkeypatch.setattr(release_worker.os, "getppid", lambda: PARENT)
    with pytest.raises(BrokenPipeError):
        release_worker.main(str(work))
    assert staged.exists()  # the replay, alive, discards or publishes it itself


def test_a_worker_told_to_stop_as_its_replay_dies_removes_what_was_staged(
        staged_job, monkeypatch):
    """The parent-death SIGTERM comes when the thread that started the worker exits; the
    other threads of the dying replay still hold it, so ``getppid`` names the replay."""
    work, staged = staged_job
    job = pickle.loads((work / "job.pickle").read_bytes())
    parent_dies_after(monkeypatch, 5)

    def exit_now(status):
        raise SystemExit(status)

    monkeypatch.setattr(release_worker.os, "_exit", exit_now)
    with pytest.raises(SystemExit) as stopped:
        release_worker._stop(job, signal.SIGTERM)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert not staged.exists()
