"""Execute mode (``kvtrace replay --execute``): re-execute the replay's recurrent state in torch.

Beside the cache replay, a state pool holds a KDA recurrent state per block of every Mamba/KDA
group. The replay's records say which request's prefix each block holds (``BlockStored``,
``StaleKeyLeft``) and which block a prefix hit reads (``BlockTouched`` after an admission); the
state executor (``executor.StateExecutor``) writes computed states where the cache publishes
them and, on every hit, compares the state read with the state recomputed from scratch for that
prefix. The recurrence (``recurrence``) runs over deterministic inputs derived from each hash id
(``inputs``), so the state after any prefix is a pure function of that prefix. The tokens each
admission recomputes are priced in GPU time by an analytic FLOPs model of the real model
(``kvtrace.geometry.cost``, which the analysis side shares).

Only ``executor``, ``recurrence``, ``kda`` and ``inputs`` import torch; this package and
``model`` do not, so the replay driver can read the options without it.
"""

from __future__ import annotations

from dataclasses import dataclass

TORCH_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ExecuteOptions:
    """What ``--execute`` runs on. ``state_scale`` None: full size on CUDA when the pool fits in
    memory, ``model.CPU_STATE_SCALE`` on CPU. ``gpu``: a device preset (``cost.GPU_PRESETS``) or an
    effective throughput in TFLOP/s, for the GPU-time estimate. ``model``: the model (a preset
    or a config.json path) whose state shapes and FLOPs apply, at ``tensor_parallel_size``
    (``kvtrace.geometry.cost.cost_model``)."""

    device: str = "auto"
    state_scale: float | None = None
    gpu: str = "h200"
    model: str | None = None  # None: the model the source names (kvtrace synth --model)
    tensor_parallel_size: int | None = None  # None: the source's, else the preset's usual
