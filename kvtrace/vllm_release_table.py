"""The vLLM releases kvtrace supports, one row each, oldest first: where a release is added.

The last row is the project's own vLLM, the one ``scripts/bootstrap`` installs into ``.venv``;
the others are installed beside it on demand (``kvtrace.vllm_releases``). Everything else
reads these rows: the probes' supported releases (``probes.signatures``, whose
``EXPECTED_SIGNATURES`` and ``SINCE`` are the one other thing a release may need: what its
wrapped methods lack or add), the ``vllm-X`` replay variants and ``upstream``'s wording
(``replay.variants``), ``kvtrace vllm`` and the set-up script.

Standard library only, and runnable by path: ``scripts/bootstrap`` reads the project's
requirement with the Python it builds the venv with, before kvtrace or any venv exists
(``python3 -I kvtrace/vllm_release_table.py requirement``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    """A package installed beside a release, where the range the release declares excludes the
    project's version and a version inside it works with the project's other packages."""

    requirement: str  # a pip requirement line
    download_mb: int


@dataclass(frozen=True)
class Release:
    """One supported vLLM release (a wheel with #56794's checkpoint path)."""

    version: str  # ``vllm.__version__``, and the wheel's version on PyPI
    wheel_mb: int  # the wheel's download
    checkpoints: str  # what its ``MambaManager`` does with internal checkpoints, in words
    pins: tuple[Pin, ...] = ()

    @property
    def requirement(self) -> str:
        return f"vllm=={self.version}"

    @property
    def download_mb(self) -> int:
        """The wheel and its pins."""
        return self.wheel_mb + sum(pin.download_mb for pin in self.pins)


# From the wheels (shared reference, vllm-releases.md). 0.31.0 declares transformers < 5.18,
# whose versions need huggingface-hub < 2 (and more) where the project has 2.x: it runs with
# the project's transformers, pinned nothing.
RELEASES: tuple[Release, ...] = (
    Release("0.30.0", 315, "a checkpoint reserved on every chunk, #56794's gate"),
    Release("0.31.0", 321, "prefill_end reservation, #56794's gate but the prompt's checkpoint"),
    Release("0.32.0", 327, "prefill_end reservation, generalised gate",
            (Pin("transformers==5.19.0", 13),)),  # it declares transformers < 5.20
    Release("0.33.0", 336, "prefill_end reservation, generalised gate"),
)
PROJECT_RELEASE = RELEASES[-1]  # the newest: the project's own vLLM
BY_VERSION = {release.version: release for release in RELEASES}
SUPPORTED_VLLM_VERSIONS = tuple(BY_VERSION)  # oldest first
INSTALLED_MB = 800  # a release's directory, installed


if __name__ == "__main__":  # scripts/bootstrap: the project's vLLM requirement line
    if sys.argv[1:] != ["requirement"]:
        sys.exit(f"usage: {sys.argv[0]} requirement")
    print(PROJECT_RELEASE.requirement)
