"""``StateExecutor``: a record consumer that re-executes the replay's recurrent state.

It reads the records a replay backend produces (beside ``ReplaySummary``), and needs nothing
from the backend itself. What it tracks, per Mamba/KDA group block, is the block's *content*
(the state its bytes hold), apart from its *keys* (the hashes a lookup finds it by):

- ``BlockStored`` in a Mamba group: the block holds the state of the storing request's prefix
  at ``num_tokens`` (hash ids are chained, so the prefix is the request's first
  ``num_tokens / hash_unit`` units). A store of a hash just re-keyed off another block of the
  group (``BlockRemoved`` REKEY, then ``BlockStored`` elsewhere: ``move_block_hashes``, the
  copy-on-write of a prompt-tail block) copies that block's content instead.
- ``StaleKeyLeft``: the block will hold the state at ``state_num_tokens`` while a key for
  ``key_num_tokens`` stays on it: the content changes, the key does not (``naive``).
- ``BlockTouched`` of a Mamba-group block during an admission (the ``SlotsAllocated`` after a
  ``ComputedBlocksFound``) is a hit that reads the block: its content is compared with the true
  state of the requesting prefix at the hit depth, recomputed from scratch over the prefix's
  units (memoised per unit, ``TrueStates``).

Each admission then prefills its tokens beyond the hit: the recurrence runs over exactly those
tokens, continuing from the state *read* at the hit, so a wrong state propagates into whatever
the request publishes later, as it would on a GPU. That run is the measured prefill; it is
advanced lazily, to each position a store needs, and to the prompt's end when the prefill
completes. Effects of one cache call are applied when the next input record arrives (a call's
stores are not in position order: a checkpoint at 1008 follows the block at 1024).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace.engine_config import check_pool_memory
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import (
    BlockRemoved,
    BlockStored,
    BlockTouched,
    ComputedBlocksFound,
    EngineConfig,
    HashesExtended,
    Record,
    RemoveReason,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    SlotsAllocated,
    StaleKeyLeft,
)
from kvtrace.geometry.cost import cost_model
from kvtrace.replay.execute import ExecuteOptions
from kvtrace.replay.execute.inputs import UnitInputs
from kvtrace.replay.execute.model import CPU_STATE_SCALE, StateShape, state_shape
from kvtrace.replay.execute.recurrence import (
    TRUE_STATE_BUDGET,
    Recurrence,
    Timer,
    TrueStates,
    choose_kernel,
    resolve_device,
)

DEFAULT_CHUNK = 64  # chunk size when the Mamba groups declare no coarser checkpoint grid
POOL_MEMORY_SHARE = 0.5  # of free CUDA memory the pool may take at an automatic scale
TRUE_STATE_SHARE = 0.1  # of free CUDA memory (after the pool) for memoised true states
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Run:
    """A request as execute mode follows it."""

    req: int
    chain: list[int]  # hash ids of its units: the prompt's, then those decode completed
    unit: int  # the hash unit, in tokens
    looked_up: bool = False  # a lookup waits for its admission
    target: int = 0  # tokens the current admission prefills (prompt, + outputs on resume)
    hit: int = 0
    computed: int = 0  # tokens allocated so far (the chunk ends)
    position: int = 0  # tokens the running state covers (a multiple of the hash unit)
    state: torch.Tensor | None = None
    anchor: torch.Tensor | None = None  # the state read at the hit
    reads: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> state read
    prefilled: bool = True

    @property
    def prefill_end(self) -> int:
        """The last unit boundary of the admission's tokens: the running state stops there."""
        return min(self.target, len(self.chain) * self.unit) // self.unit * self.unit


@dataclass
class _Hit:
    req: int
    group: int
    block_id: int
    depth: int
    error: torch.Tensor  # relative max difference, on the device
    stale_key: bool
    content: tuple[int, int] | None  # (req, num_tokens) of the state the block held


class StateExecutor:
    """A ``RecordSink`` (call it with every record of one replay) that re-executes the
    recurrent state, checks every Mamba hit, and measures and prices recomputed prefill.
    ``finish()`` returns the figures (``variants.V.execute`` of the replay summary)."""

    def __init__(self, config: EngineConfig, options: ExecuteOptions) -> None:
        self.device = resolve_device(options.device)
        if options.model is None:
            raise ConfigError("execute mode re-executes the state of the model the source was "
                              "written for, and this source names none kvtrace could resolve (a "
                              "capture of a model served under another name)",
                              "Name it: kvtrace replay --execute --model NAME|CONFIG.json.")
        self.cost = cost_model(options.model, options.tensor_parallel_size, options.gpu)
        model = self.cost.model
        mamba = [i for i, g in enumerate(config.kv_cache_groups) if g.kind == "mamba"]
        if not mamba:
            raise ConfigError("--execute re-executes Mamba/KDA state, and this engine has no "
                              "Mamba group", "Replay a hybrid engine's trace.")
        self.group_index = {group: i for i, group in enumerate(mamba)}
        self.unit = config.hash_block_size
        spec = config.kv_cache_groups[mamba[0]]
        # Chunks on the groups' checkpoint grid (FlashKDA's 16 tokens); on a one-token grid
        # (Mamba2) or none, DEFAULT_CHUNK: the chunking orders the arithmetic, it does not
        # change the state at a hash-unit boundary, where execute mode reads states.
        alignment = spec.prefill_checkpoint_alignment
        self.chunk_size = math.gcd(self.unit, alignment if alignment and alignment > 1
                                   else DEFAULT_CHUNK)
        self.shape = self._shape(model, len(mamba), options.state_scale, config.num_gpu_blocks)
        on_cuda = self.device.type == "cuda"
        check_pool_memory(
            config.num_gpu_blocks, f"--execute's state pool of {config.num_gpu_blocks:,} blocks "
            f"at state scale {self.shape.scale:g}", "Lower --state-scale (or --num-gpu-blocks).",
            self.shape.nbytes, torch.cuda.mem_get_info(self.device)[0] if on_cuda else None,
            "the GPU" if on_cuda else "this machine")
        self.dtype = TORCH_DTYPES[self.shape.dtype]
        rows = self.shape.recurrences
        self.rows = rows
        self.tolerance = RELATIVE_TOLERANCE[self.dtype]
        self._threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # many small ops: on a shared CPU, threads mostly wait
        self.pool = torch.zeros(config.num_gpu_blocks, rows, self.shape.key_dim,
                                self.shape.value_dim, dtype=self.dtype, device=self.device)
        inputs = UnitInputs(rows * len(mamba), self.shape.key_dim, self.shape.value_dim,
                            self.unit, torch.float32, self.device)
        kernel, self.kernel_note = choose_kernel(self.device, self.chunk_size,
                                                 self.shape.key_dim, self.shape.value_dim)
        self.recurrence = Recurrence(inputs, kernel)
        self.zeros = torch.zeros(rows * len(mamba), self.shape.key_dim, self.shape.value_dim,
                                 dtype=torch.float32, device=self.device)
        budget = (TRUE_STATE_BUDGET if self.device.type == "cpu"
                  else int(TRUE_STATE_SHARE * torch.cuda.mem_get_info(self.device)[0]))
        self.true_states = TrueStates(self.recurrence, self.zeros, spec.block_size // self.unit,
                                      budget)
        self.timer = Timer(self.device)
        self._runs: dict[int, _Run] = {}
        self._block_group: dict[int, int] = {}
        self._content: dict[int, tuple[int, int]] = {}  # block -> (req, num_tokens) it holds
        self._rekeyed: dict[tuple[int, int], int] = {}  # (group, hash id) -> block it left
        self._stale_keys: set[tuple[int, int]] = set()  # (block, hash id) left stale
        self._pending: list[tuple] = []
        self._call: _Run | None = None  # the request of the cache call being recorded
        self._admitting: _Run | None = None
        self._hits: list[_Hit] = []
        self.recomputed_tokens = 0
        self.resumed_recomputed_tokens = 0
        self.recompute_flops = 0
        self.anomalies: dict[str, int] = {}
        self._handlers = {
            RequestArrived: self._arrived, HashesExtended: self._extended,
            ComputedBlocksFound: self._looked_up, SlotsAllocated: self._allocated,
            RequestPreempted: self._preempted, RequestFinished: self._finished,
            BlockStored: self._stored, BlockRemoved: self._removed,
            StaleKeyLeft: self._stale, BlockTouched: self._touched,
        }

    # --- set-up ---------------------------------------------------------------------------------

    def _shape(self, model, num_groups: int, scale: float | None,
               num_blocks: int) -> StateShape:
        if scale is not None:
            return state_shape(model, num_groups, scale)
        if self.device.type == "cpu":
            return state_shape(model, num_groups, CPU_STATE_SCALE)
        free, _ = torch.cuda.mem_get_info(self.device)
        scale = 1.0
        while True:  # full size when the pool fits, else halve every dimension
            shape = state_shape(model, num_groups, scale)
            if shape.nbytes * num_blocks <= POOL_MEMORY_SHARE * free or scale <= CPU_STATE_SCALE:
                return shape
            scale /= 2

    # --- records --------------------------------------------------------------------------------

    def __call__(self, record: Record) -> None:
        if record.family == "input" and (self._pending or self._call is not None):
            self._flush()
        handler = self._handlers.get(type(record))
        if handler is not None:
            handler(record)

    def _arrived(self, r: RequestArrived) -> None:
        run = self._runs[r.req] = _Run(r.req, list(r.hash_ids), self.unit)
        self.true_states.learn(run.chain, 0)

    def _extended(self, r: HashesExtended) -> None:
        run = self._runs.get(r.req)
        if run is not None:
            start = len(run.chain)
            run.chain.extend(r.hash_ids)
            self.true_states.learn(run.chain, start)

    def _looked_up(self, r: ComputedBlocksFound) -> None:
        run = self._runs.get(r.req)
        if run is not None:
            run.looked_up = True

    def _allocated(self, r: SlotsAllocated) -> None:
        run = self._runs.get(r.req)
        if run is None or not r.success:
            return
        if run.looked_up:  # an admission: prefill from the hit
            run.looked_up = False
            first = run.target == 0
            run.target, run.hit, run.position = r.num_tokens, r.num_new_computed_tokens, 0
            run.state, run.anchor, run.reads, run.prefilled = None, None, {}, False
            recomputed = max(0, run.target - run.hit)
            self.recomputed_tokens += recomputed
            if not first:
                self.resumed_recomputed_tokens += recomputed
            self.recompute_flops += self.cost.flops.recompute(run.hit, run.target)
            self._admitting = run
        run.computed = r.num_computed_tokens + r.num_new_computed_tokens + r.num_new_tokens
        self._call = run

    def _preempted(self, r: RequestPreempted) -> None:
        run = self._runs.get(r.req)
        if run is not None:
            run.state = run.anchor = None
            run.prefilled = True

    def _finished(self, r: RequestFinished) -> None:
        self._runs.pop(r.req, None)

    def _stored(self, r: BlockStored) -> None:
        self._block_group[r.block_id] = r.group
        if r.group not in self.group_index:
            return
        source = self._rekeyed.pop((r.group, r.hash_id), None)
        if source is not None and source != r.block_id:
            self._pending.append(("copy", r.group, source, r.block_id))
        else:
            self._pending.append(("store", self._runs.get(r.req), r.group, r.block_id,
                                  r.num_tokens))

    def _removed(self, r: BlockRemoved) -> None:
        self._stale_keys.discard((r.block_id, r.hash_id))
        if r.reason == RemoveReason.REKEY and r.group in self.group_index:
            self._rekeyed[(r.group, r.hash_id)] = r.block_id

    def _stale(self, r: StaleKeyLeft) -> None:
        self._stale_keys.add((r.block_id, r.hash_id))
        if r.group in self.group_index:
            self._pending.append(("store", self._runs.get(r.req), r.group, r.block_id,
                                  r.state_num_tokens))

    def _touched(self, r: BlockTouched) -> None:
        run = self._admitting
        group = self._block_group.get(r.block_id)
        if run is None or run.req != r.req or group not in self.group_index or run.hit == 0:
            return
        if run.hit % self.unit or run.hit > len(run.chain) * self.unit:
            self._anomaly("hit_off_the_chain")
            return
        rows = self._rows(group)
        wanted = run.chain[run.hit // self.unit - 1]
        true = self.true_states.state(wanted)[rows]
        read = self.pool[r.block_id].to(torch.float32)
        error = (read - true).abs().amax() / true.abs().amax().clamp_min(1e-30)
        self._hits.append(_Hit(run.req, group, r.block_id, run.hit, error,
                               (r.block_id, wanted) in self._stale_keys,
                               self._content.get(r.block_id)))
        run.reads[group] = read

    # --- applying a call's effects --------------------------------------------------------------

    def _flush(self) -> None:
        run, self._call, self._admitting = self._call, None, None
        if run is not None and run.state is None and not run.prefilled:
            self._start(run)
        pending, self._pending = self._pending, []
        self._rekeyed.clear()
        states = self._states_needed(pending)
        for op in pending:
            if op[0] == "copy":
                _, group, source, target = op
                self.pool[target] = self.pool[source]
                if source in self._content:
                    self._content[target] = self._content[source]
                continue
            _, store_run, group, block_id, num_tokens = op
            state = states.get((id(store_run), num_tokens))
            if state is None:
                self._content.pop(block_id, None)
                continue
            self.pool[block_id] = state[self._rows(group)].to(self.dtype)
            self._content[block_id] = (store_run.req, num_tokens)
        if run is not None and not run.prefilled and run.computed >= run.target:
            self._finish_prefill(run)

    def _start(self, run: _Run) -> None:
        """The admission's starting state: the states its hits read (zeros without a hit)."""
        if run.hit == 0:
            run.state = self.zeros
        else:
            parts = []
            for group in self.group_index:
                read = run.reads.get(group)
                if read is None:  # no block of this group was touched: nothing to check
                    self._anomaly("hit_without_mamba_block")
                    read = self.true_states.state(run.chain[run.hit // self.unit - 1])[
                        self._rows(group)]
                parts.append(read)
            run.state = torch.cat(parts)
        run.anchor, run.position = run.state, run.hit
        run.reads = {}

    def _states_needed(self, pending: list[tuple]) -> dict[tuple[int, int], torch.Tensor]:
        """The states the stores of one call need: each request's running state advanced
        through the positions in order."""
        wanted: dict[int, tuple[_Run, set[int]]] = {}
        for op in pending:
            if op[0] != "store":
                continue
            if op[1] is None:
                self._anomaly("store_by_an_unknown_request")
                continue
            wanted.setdefault(id(op[1]), (op[1], set()))[1].add(op[4])
        states = {}
        for key, (run, positions) in wanted.items():
            if run.state is None:
                self._anomaly("store_without_admission")
                continue
            for position in sorted(positions):
                if position % self.unit or position > len(run.chain) * self.unit:
                    self._anomaly("store_off_the_chain")
                    continue
                states[(key, position)] = self._advance(run, position)
        return states

    def _advance(self, run: _Run, position: int) -> torch.Tensor:
        """The running state at ``position``; from the anchor again if it is already past."""
        if position < run.position:
            self._anomaly("store_behind_the_running_state")
            return self.recurrence.run(run.anchor, run.chain[run.hit // self.unit:
                                                             position // self.unit])
        timed_end = run.position if run.prefilled else min(position, run.prefill_end)
        if timed_end > run.position:
            self.timer.start()
            run.state = self.recurrence.run(run.state, run.chain[run.position // self.unit:
                                                                 timed_end // self.unit])
            self.timer.stop()
            run.position = timed_end
        if position > run.position:  # past the prefill: decode completed these units
            run.state = self.recurrence.run(run.state, run.chain[run.position // self.unit:
                                                                 position // self.unit])
            run.position = position
        return run.state

    def _finish_prefill(self, run: _Run) -> None:
        """The admission's last chunk was allocated: run the rest of its tokens, the ragged
        tail past the last full unit on a scratch copy (its unit has no hash id yet)."""
        self._advance(run, run.prefill_end)
        tail = run.target - run.prefill_end
        if tail > 0:
            self.timer.start()
            self.recurrence.run_tail(run.state, run.req, tail)
            self.timer.stop()
        run.prefilled = True

    def _rows(self, group: int) -> slice:
        index = self.group_index[group]
        return slice(index * self.rows, (index + 1) * self.rows)

    def _anomaly(self, name: str) -> None:
        self.anomalies[name] = self.anomalies.get(name, 0) + 1

    # --- results --------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Apply the last call's effects and return the figures."""
        self._flush()
        for run in self._runs.values():
            if not run.prefilled and run.state is not None:
                self._finish_prefill(run)
        measured = self.timer.total()
        self.close()
        errors = (torch.stack([h.error for h in self._hits]).cpu().tolist()
                  if self._hits else [])
        wrong = [h for h, e in zip(self._hits, errors) if not e <= self.tolerance]
        verified = [e for e in errors if e <= self.tolerance]
        first = wrong[0] if wrong else None
        estimated = self.recompute_flops / self.cost.gpu.flops_per_s
        return {
            "device": str(self.device),
            "kernel": self.recurrence.kernel.name,
            "kernel_note": self.kernel_note,
            "chunk_size": self.chunk_size,
            "state": self.shape.describe(),
            "state_scale": self.shape.scale,
            "pool_mib": round(self.pool.numel() * self.pool.element_size() / 2**20, 1),
            "verified_hits": len(verified),
            "wrong_state_hits": len(wrong),
            "stale_key_reads": sum(h.stale_key for h in self._hits),
            "wrong_state_stale_key_reads": sum(h.stale_key for h in wrong),
            "first_wrong_state_hit": None if first is None else {
                "req": first.req, "group": first.group, "block_id": first.block_id,
                "depth": first.depth,
                "holds": None if first.content is None else {
                    "req": first.content[0], "num_tokens": first.content[1]}},
            "max_verified_error": max(verified, default=0.0),
            "min_wrong_state_error": min((e for e in errors if not e <= self.tolerance),
                                         default=None),
            "tolerance": self.tolerance,
            "recomputed_tokens": self.recomputed_tokens,
            "resumed_recomputed_tokens": self.resumed_recomputed_tokens,
            "measured_prefill_s": round(measured, 6),
            "measured_tokens_per_s": round(self.recomputed_tokens / measured, 1)
            if measured else 0.0,
            "recompute_flops": self.recompute_flops,
            "estimated_gpu_s": round(estimated, 6),
            "model": self.cost.model.name,
            "gpu": self.cost.gpu.name,
            "gpu_flops_per_s": self.cost.gpu.flops_per_s,
            "anomalies": dict(sorted(self.anomalies.items())),
        }

    def close(self) -> None:
        """Give torch its thread count back."""
        torch.set_num_threads(self._threads)

    def __enter__(self) -> "StateExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def execute_trace(path: str, options: ExecuteOptions) -> dict[str, Any]:
    """Execute mode over the records of a replay trace already written (no cache replay):
    the same figures ``kvtrace replay --execute`` gives for that variant, on any machine
    with torch (``benchmarks/execute.py`` times it on a GPU that has no vLLM)."""
    from kvtrace.traceio import TraceReader

    reader = TraceReader(path)
    if reader.header.config is None:
        raise KvtraceError(f"{path} has no engine config in its header",
                           "Execute a replay trace (kvtrace replay -o DIR writes them).")
    params = reader.header.params
    if options.model is None and "cost.model" in params:  # the model the replay priced
        options = dataclasses.replace(options, model=params["cost.model"],
                                      tensor_parallel_size=int(params["cost.tensor_parallel_size"]))
    with StateExecutor(reader.header.config, options) as executor:
        for record in reader:
            executor(record)
        return executor.finish()
