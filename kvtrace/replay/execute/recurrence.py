"""The KDA recurrence on a torch device, as execute mode runs it: the device and the kernel
(fla's ``chunk_kda`` on CUDA when it agrees with the torch reference, else the reference), runs
over hash units in bounded batches (``Recurrence``), the true state after any prefix, memoised
(``TrueStates``), and the time of measured sections (``Timer``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import torch

from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.replay.execute import TORCH_DEVICES
from kvtrace.replay.execute.inputs import TAIL_DOMAIN, UnitInputs
from kvtrace.replay.execute.kda import TorchKernel, fla_kernel

# Inputs derived at once, per batch of units: CPU caches, GPU launches.
MAX_INPUT_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 25}
FLA_DIM_MULTIPLE = 16  # fla's Triton kernels tile head dims by 16
TRUE_STATE_BUDGET = 256 << 20  # bytes of memoised true states on CPU


def resolve_device(name: str) -> torch.device:
    if name not in TORCH_DEVICES:
        raise ConfigError(f"unknown --device {name!r}", f"Use one of {', '.join(TORCH_DEVICES)}.")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA device here "
                          f"(torch {torch.__version__})",
                          "Run with --device cpu (or auto), or install a CUDA build of torch.")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Timer:
    """Sums the time of measured sections: CUDA events on a GPU (read once, at the end),
    the wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._started: Any = None

    def start(self) -> None:
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._started, end))
        else:
            self.seconds += time.perf_counter() - self._started

    def total(self) -> float:
        if self._events:
            torch.cuda.synchronize()
            self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events.clear()
        return self.seconds


class Recurrence:
    """Runs the KDA recurrence over hash units: inputs derived from the ids, the kernel over
    them, in batches of bounded size."""

    def __init__(self, inputs: UnitInputs, kernel) -> None:
        self.inputs = inputs
        self.kernel = kernel
        per_unit = inputs.unit * inputs.rows * inputs.width
        self.batch_units = max(1, MAX_INPUT_ELEMENTS[inputs.device.type] // per_unit)

    def run(self, state: torch.Tensor, hash_ids: list[int]) -> torch.Tensor:
        for start in range(0, len(hash_ids), self.batch_units):
            state = self.kernel(state, *self.inputs(hash_ids[start:start + self.batch_units]))
        return state

    def run_tail(self, state: torch.Tensor, req: int, num_tokens: int) -> torch.Tensor:
        """``num_tokens`` (< one unit) past a prompt's last full unit: no hash id names them,
        so their inputs come from the request number."""
        k, v, g, beta = self.inputs([req], TAIL_DOMAIN)
        return self.kernel(state, k[:, :num_tokens], v[:, :num_tokens], g[:, :num_tokens],
                           beta[:, :num_tokens])


class TrueStates:
    """The state after each hash unit's prefix, computed from scratch (zeros, then the
    recurrence over the prefix's units) and memoised per unit within a byte budget (least
    recently used first out). States at every ``every_units``-th unit (Mamba block
    boundaries, where hits land) are memoised along the way."""

    def __init__(self, recurrence: Recurrence, zeros: torch.Tensor, every_units: int,
                 budget_bytes: int = TRUE_STATE_BUDGET) -> None:
        self.recurrence = recurrence
        self.zeros = zeros
        self.every_units = max(1, every_units)
        self.capacity = max(1, budget_bytes // (zeros.numel() * zeros.element_size()))
        self.parent: dict[int, int | None] = {}
        self.index: dict[int, int] = {}  # hash id -> its unit's index in the chain
        self.memo: OrderedDict[int, torch.Tensor] = OrderedDict()

    def learn(self, chain: list[int], start: int) -> None:
        """Record the chain links of ``chain[start:]`` (a request's units as they arrive)."""
        for i in range(start, len(chain)):
            self.parent[chain[i]] = chain[i - 1] if i else None
            self.index[chain[i]] = i

    def state(self, hash_id: int) -> torch.Tensor:
        path = []
        node: int | None = hash_id
        while node is not None and node not in self.memo:
            path.append(node)
            node = self.parent[node]
        if node is None:
            state = self.zeros
        else:
            state = self.memo[node]
            self.memo.move_to_end(node)
        path.reverse()
        start = 0
        for end, unit in enumerate(path, 1):
            if end == len(path) or (self.index[unit] + 1) % self.every_units == 0:
                state = self.recurrence.run(state, path[start:end])
                self._keep(unit, state)
                start = end
        return state

    def _keep(self, hash_id: int, state: torch.Tensor) -> None:
        self.memo[hash_id] = state
        while len(self.memo) > self.capacity:
            self.memo.popitem(last=False)


def choose_kernel(device: torch.device, chunk_size: int, key_dim: int,
                  value_dim: int) -> tuple[Any, str]:
    """fla's ``chunk_kda`` on CUDA where importable and the head dims suit it, checked
    against the torch reference on small inputs of the run's head dims first; else the
    torch chunkwise recurrence, with a note that says why."""
    reference = TorchKernel(chunk_size)
    if device.type != "cuda":
        return reference, ""
    fla = fla_kernel()
    if fla is None:
        return reference, "flash-linear-attention (fla) is not importable"
    dims = (key_dim, value_dim)
    if any(dim % FLA_DIM_MULTIPLE for dim in dims):
        return reference, f"fla needs head dims in multiples of {FLA_DIM_MULTIPLE}: {dims}"
    try:
        check_kernel(fla, reference, device, *dims)
    except KvtraceError:
        raise
    except Exception as error:  # fla could not run here (Triton, driver): say so
        return reference, f"fla failed on small inputs: {type(error).__name__}: {error}"
    return fla, ""


def check_kernel(kernel, reference, device: torch.device, key_dim: int = 64,
                 value_dim: int = 64, rows: int = 4, num_tokens: int = 100) -> float:
    """Compare ``kernel`` with ``reference`` on small random inputs; raise when they differ."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.rand(*shape, generator=generator).to(device)

    k = torch.nn.functional.normalize(rand(rows, num_tokens, key_dim) * 2 - 1, dim=-1)
    v = rand(rows, num_tokens, value_dim) * 2 - 1
    g = -0.05 * rand(rows, num_tokens, key_dim)
    beta = 0.1 + 0.8 * rand(rows, num_tokens)
    state = rand(rows, key_dim, value_dim) - 0.5
    expected = reference(state, k, v, g, beta)
    got = kernel(state, k, v, g, beta)
    error = ((got - expected).abs().amax() / expected.abs().amax()).item()
    if not error <= 1e-2:
        raise KvtraceError(f"{kernel.name} disagrees with the torch reference recurrence "
                           f"(relative error {error:.3g})",
                           "Run with --device cpu, or report the fla version you have.")
    return error
