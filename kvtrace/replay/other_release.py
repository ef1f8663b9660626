"""Replaying a variant on another vLLM release than this process runs: which release a variant
runs on, and handing it to a worker process (``release_worker``).

Each variant runs on one release's code (``release_version_for``): a ``vllm-X`` variant on
release X; in lockstep, every other variant on the release the trace was recorded on, so that a
capture is re-issued against the same code that made it; otherwise on this process's vLLM. A
variant whose release is not this process's runs in a worker, ``python -m
kvtrace.replay.release_worker`` (isolated: ``kvtrace.children``), started with the release's
directory first on ``PYTHONPATH`` (``kvtrace.vllm_releases``). The worker runs the same
``replay`` on that one variant, writing its trace where the parent staged it, and hands back the
result (or the ``KvtraceError`` it raised; a full disk is one too) in a file: vLLM logs to
stdout, which the parent keeps for a failure.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvtrace.children import python_child
from kvtrace.engine_config import KEEP
from kvtrace.errors import ConfigError, KvtraceError, error_class
from kvtrace.events import TraceHeader
from kvtrace.probes.signatures import SUPPORTED_VLLM_VERSIONS

if TYPE_CHECKING:
    from kvtrace.replay.options import ReplayOptions
    from kvtrace.replay.results import ReplayResult

KEEP_MARK = "keep the source's"  # Overrides' KEEP, which does not survive a pickle


def release_version_for(variant, header: TraceHeader, mode: str, backend: str) -> str:
    """The version of the vLLM release ``variant`` (a ``Variant``) runs on, e.g. ``"0.33.0"``."""
    from kvtrace.vllm_release_table import BY_VERSION
    from kvtrace.vllm_releases import is_installed, running_vllm_version

    if variant.release is not None:
        if backend != "vllm":
            raise ConfigError(f"variant {variant.name} runs vLLM {variant.release}'s own code, "
                              f"which the {backend} backend does not have",
                              "Use --backend vllm for the vllm-X variants.")
        return variant.release
    recorded = header.vllm_version
    if mode != "lockstep" or backend != "vllm" or not recorded:
        return running_vllm_version()
    if recorded not in SUPPORTED_VLLM_VERSIONS:
        raise ConfigError(
            f"the trace was recorded on vLLM {recorded}, which kvtrace cannot run (it supports "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}), and lockstep re-issues its calls on the "
            "same release's code", "Replay it without --lockstep (rescheduled), on any release.")
    if not is_installed(recorded):
        raise ConfigError(
            f"the trace was recorded on vLLM {recorded}, and lockstep re-issues its calls on the "
            f"same release's code, which is not installed beside this vLLM "
            f"{running_vllm_version()}",
            f"Install it: kvtrace vllm install {recorded} (downloads about "
            f"{BY_VERSION[recorded].wheel_mb} MB).")
    return recorded


@dataclasses.dataclass(frozen=True)
class Job:
    """What a worker runs, the replay's pid (it dies with it), the ``-o`` directory the
    operator gave (its messages name it) and what it removes should the replay die first."""

    options: ReplayOptions
    parent: int
    outdir: str
    leftovers: tuple[str, ...]


def run_variant(release: str, options: ReplayOptions, variant: str, outdir: str,
                verify: bool) -> ReplayResult:
    """``replay`` of ``variant`` alone on ``release``, in a worker; its trace goes into
    ``outdir``, the directory staged for it when traces are written, which the worker removes
    should this process die meanwhile. ``verify``: compare it with the captured effects there."""
    from kvtrace.vllm_releases import environment

    env = environment(release)  # refuses a release that is not installed, before any work
    job = dataclasses.replace(options, outdir=outdir, variants=(variant,), verify=verify,
                              lockstep=options.lockstep or options.verify)
    if job.overrides.retention_interval is KEEP:
        job = dataclasses.replace(job, overrides=dataclasses.replace(
            job.overrides, retention_interval=KEEP_MARK))
    with tempfile.TemporaryDirectory(prefix="kvtrace-release-worker-") as work:
        staged = (outdir,) if options.write_traces else ()
        Path(work, "job.pickle").write_bytes(pickle.dumps(
            Job(job, os.getpid(), options.outdir, (work, *staged))))
        command, env = python_child("kvtrace.replay.release_worker", work, env=env)
        worker = subprocess.run(command, env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, check=False)
        result_path = Path(work, "result.pickle")
        if not result_path.exists():
            said = (worker.stderr.strip() or worker.stdout.strip()).splitlines()[-1:]
            raise KvtraceError(f"the worker running vLLM {release} for variant {variant} "
                               f"failed (exit status {worker.returncode})"
                               + (f": {said[0]}" if said else ""),
                               "Run the same replay with the release on PYTHONPATH to see it: "
                               f"PYTHONPATH={env.get('PYTHONPATH', '')} kvtrace -vv replay ...")
        outcome = pickle.loads(result_path.read_bytes())
    if outcome[0] == "error":
        _, name, message, hint = outcome
        raise error_class(name)(message, hint=hint)
    return outcome[1]
