"""What a replay is asked to run (``ReplayOptions``) and the variants it runs by default.

Below the run driver (``run``), so that what hands a replay to another process
(``other_release``) names its options without importing the driver back.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.engine_config import Overrides
from kvtrace.replay.execute import ExecuteOptions

DEFAULT_VARIANTS = ("unfixed", "fixed")
# The variant a live engine runs when its trace says nothing else: the installed vLLM.
CAPTURED_VARIANT = "upstream"


@dataclass(frozen=True)
class ReplayOptions:
    source: str
    outdir: str
    variants: tuple[str, ...] = ()  # empty: DEFAULT_VARIANTS, or the engine's with --verify
    backend: str = "vllm"
    overrides: Overrides = Overrides()
    lockstep: bool = False
    verify: bool = False
    write_traces: bool = True  # False: summaries only; outdir is not used
    execute: ExecuteOptions | None = None  # --execute: re-execute the recurrent state
    model: str | None = None  # --model: what prices the lookups; None: the one the source names
    # From a source's start snapshot (``Source.start``); never with a cache the snapshot cannot
    # describe (another pool or retention), nor in lockstep without one.
    warm_start: bool = True
