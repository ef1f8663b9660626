"""The presets' geometries at their usual deployment, computed once by vLLM's own code and
shipped beside the presets, so that writing a workload for a preset needs no vLLM import (tens
of seconds on a small CPU). ``tests/test_geometry.py`` recomputes each one and compares.

Regenerate after a vLLM or preset change: ``python -m kvtrace.geometry.bundled``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvtrace.geometry.presets import HF_OVERRIDES, PRESET_DIR, preset_named, preset_names
from kvtrace.geometry.result import Geometry

# The smallest tensor-parallel size whose weights leave room for a cache on one H200
# (``kvtrace geometry`` names it when TP 1 does not fit).
PRESET_TENSOR_PARALLEL = {
    "kimi-linear-48b-a3b": 1,
    "qwen3-next-80b-a3b": 2,
    "nemotron-h-8b": 1,
    "kimi-k3": 16,
}
SUFFIX = ".geometry.json"


def bundled_path(preset: str) -> Path:
    return PRESET_DIR / f"{preset}{SUFFIX}"


def geometry_for(model: str, tensor_parallel_size: int | None = None) -> Geometry:
    """The geometry of ``model`` (a preset name or a config.json path): a preset at its usual
    tensor-parallel size comes from the shipped file (one H200); anything else is computed by
    vLLM's code for this host's GPU, else an H200 (slow the first time; cached). A preset may be
    named by its Hugging Face repository too, and with vLLM's --hf-overrides
    (``presets.model_spec``), which are computed."""
    name, flag, overrides = str(model).partition(HF_OVERRIDES)
    name = preset_named(name)
    usual = PRESET_TENSOR_PARALLEL.get(name)
    if not flag and usual is not None and tensor_parallel_size in (None, usual):
        path = bundled_path(name)
        if path.is_file():
            return msgspec.json.decode(path.read_bytes(), type=Geometry)
    from kvtrace.geometry.compute import compute_geometry

    return compute_geometry(name + flag + overrides,
                            tensor_parallel_size=tensor_parallel_size or usual or 1)


def compute_bundled(preset: str) -> Geometry:
    """A preset's shipped geometry: on an H200, whatever GPU this host has."""
    from kvtrace.geometry.compute import H200_GIB, compute_geometry

    return compute_geometry(preset, tensor_parallel_size=PRESET_TENSOR_PARALLEL[preset],
                            gpu_memory_gib=H200_GIB)


def main() -> None:
    for preset in preset_names():
        bundled_path(preset).write_bytes(
            msgspec.json.format(msgspec.json.encode(compute_bundled(preset)), indent=2) + b"\n")
        print(f"wrote {bundled_path(preset)}")


if __name__ == "__main__":
    main()
