"""The engine a trace runs on: derived from a source plus overrides, and checked, in one place.

Every stage that builds a cache from an ``EngineConfig`` (``kvtrace replay``, ``kvtrace engine``,
the workload writers) goes through ``derive`` / ``validate`` here, so a configuration vLLM
cannot build is refused with the same message whichever command met it first. Each rule has
one message and a hint that says what to change. One rule is this machine's: a replay's block
pool must fit its available memory (``check_pool_memory``, ``REPLAY_BYTES_PER_BLOCK`` a block).

``SchedulerSettings`` are the scheduler limits of an engine (what vLLM's ``SchedulerConfig``
holds, read from the trace's config, then overridden), plus the virtual clock that orders
arrivals against steps in the replay's scheduler model and ``kvtrace engine``.

Imports: stdlib, msgspec, events and errors only (every stage imports this module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from math import lcm

import msgspec

from kvtrace.errors import ConfigError
from kvtrace.events import EngineConfig

# vLLM 0.33 `vllm serve` defaults on an H100/H200-class GPU (EngineArgs, OPENAI_API_SERVER).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 1024
# Group kinds the replay builds (vLLM's ``kv_cache_spec_kind`` names).
SUPPORTED_GROUP_KINDS = ("full_attention", "mamba")
# "Keep the source's value" for an override (None is a value: dense retention).
KEEP = object()
# Memory a replay's block pool takes per block: vLLM's KVCacheBlock and free-queue links (about
# 140 bytes measured at 10^6 blocks), and the prefix-cache entry of a keyed block.
# tests/test_hardening.py holds the real vLLM pool to it.
REPLAY_BYTES_PER_BLOCK = 256
MAX_INT64 = (1 << 63) - 1  # the largest value of a trace's integer fields
# The longest request (prompt and output) a replay runs: longer than any model's context (10M
# tokens), and short enough that vLLM's Request (a list entry per token) fits in memory.
MAX_REQUEST_TOKENS = 1 << 26
# The most KV-cache groups an engine has here: vLLM makes one per kind of layer and group of
# equal-sized layer lists (the presets have 4 to 7); a backend keeps a manager per group.
MAX_KV_CACHE_GROUPS = 256
MAX_SPECULATIVE_TOKENS = 64  # draft tokens a step: real drafters propose a handful


@dataclass(frozen=True)
class SchedulerSettings:
    """The scheduler limits of a run. 0 in an ``EngineConfig`` means "vLLM's default"."""

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    long_prefill_token_threshold: int = 0
    max_model_len: int = 0  # 0: unlimited
    # vLLM 0.33's scheduler_reserve_full_isl (on by default; EngineConfig.reserve_full_sequence):
    # admit a request only if its whole sequence so far (prompt, plus outputs when resumed) fits.
    reserve_full_sequence: bool = True
    step_overhead_ns: int = 2_000_000
    ns_per_token: int = 10_000  # 100k scheduled tokens per second
    # The clock counts steps, every one (a capture's arrivals on its own step numbers,
    # ``captured.StepClock``), instead of time.
    step_clock: bool = False
    # A drafting engine's verifier: the chance it accepts each draft token in turn, and (a
    # capture's replay) its own answers, by (request, tokens when the step was scheduled).
    draft_acceptance: float = 0.7
    draft_answers: Mapping[tuple[int, int], int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: EngineConfig, **overrides: int | None) -> SchedulerSettings:
        """Settings from a trace's config, then non-None ``overrides`` on top, checked."""
        settings = cls(
            max_num_batched_tokens=config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=config.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_model_len=config.max_model_len,
            reserve_full_sequence=config.reserve_full_sequence,
        )
        settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
        if settings.max_num_batched_tokens <= 0 or settings.max_num_seqs <= 0:
            raise ConfigError(
                f"max_num_batched_tokens ({settings.max_num_batched_tokens}) and max_num_seqs "
                f"({settings.max_num_seqs}) must be positive",
                "Give --max-num-batched-tokens / --max-num-seqs positive values.")
        if settings.long_prefill_token_threshold < 0:
            raise ConfigError(
                f"long_prefill_token_threshold {settings.long_prefill_token_threshold} is negative",
                "Use 0 (off) or a positive number of tokens.")
        return settings


@dataclass(frozen=True)
class Overrides:
    """What a command changes of a source's engine: the pool, the retention, the scheduler
    limits (None / ``KEEP``: the source's value)."""

    num_gpu_blocks: int | None = None
    retention_interval: object = KEEP  # KEEP, None (dense) or an int
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    long_prefill_token_threshold: int | None = None
    async_scheduling: bool | None = None  # vLLM's AsyncScheduler, or the synchronous one
    num_speculative_tokens: int | None = None  # draft tokens a decode step proposes
    speculative_method: str | None = None  # SPECULATIVE_METHODS: how the drafts are made
    lookahead_block_hashes: bool | None = None  # MTP: 0.33's lookahead hashes, or the drop

    @property
    def changes_drafter(self) -> bool:
        return (self.num_speculative_tokens, self.speculative_method,
                self.lookahead_block_hashes) != (None, None, None)

    @property
    def changes_cache(self) -> bool:
        """A cache a start snapshot cannot describe: another pool, retention, or drafter (its
        speculative Mamba blocks, and which hashes its requests have)."""
        return (self.num_gpu_blocks is not None or self.retention_interval is not KEEP
                or self.changes_drafter)

    def scheduler(self) -> dict[str, int | None]:
        return {"max_num_batched_tokens": self.max_num_batched_tokens,
                "max_num_seqs": self.max_num_seqs,
                "long_prefill_token_threshold": self.long_prefill_token_threshold}


def derive(config: EngineConfig | None, source: str,
           overrides: Overrides = Overrides()) -> tuple[EngineConfig, SchedulerSettings]:
    """The engine a run builds for ``source``: its config with ``overrides`` applied, checked
    (``validate``), and its scheduler settings."""
    if config is None:
        raise ConfigError(f"{source} has no engine config in its header",
                          "Replay a workload (kvtrace synth / import) or a captured trace.")
    changes: dict[str, object] = {}
    if overrides.num_gpu_blocks is not None:
        changes["num_gpu_blocks"] = overrides.num_gpu_blocks
    if overrides.retention_interval is not KEEP:
        changes["retention_interval"] = overrides.retention_interval
    if overrides.async_scheduling is not None:
        changes["async_scheduling"] = overrides.async_scheduling
    if overrides.num_speculative_tokens is not None:
        changes["num_speculative_tokens"] = overrides.num_speculative_tokens
    config = msgspec.structs.replace(config, **changes)
    if overrides.speculative_method is not None and not config.num_speculative_tokens:
        raise ConfigError(f"speculative method {overrides.speculative_method} drafts nothing: "
                          "the engine proposes no draft tokens",
                          "Add --num-speculative-tokens K (e.g. 2).")
    if overrides.changes_drafter:
        config = msgspec.structs.replace(config, **drafter_fields(
            config, overrides.speculative_method or speculative_method(config),
            overrides.lookahead_block_hashes))
    validate(config)
    return config, SchedulerSettings.from_config(config, **overrides.scheduler())


# How drafts are made: n-gram lookup (no forward pass: no lookahead), or a drafter with a
# forward pass of its own reading the target's hidden states (vLLM's use_eagle family; its
# cache rules are the same for EAGLE and single-module MTP).
SPECULATIVE_METHODS = ("ngram", "mtp")


def speculative_method(config: EngineConfig) -> str:
    """The ``SPECULATIVE_METHODS`` entry an engine config drafts with."""
    return "mtp" if config.num_lookahead_tokens else "ngram"


def drafter_fields(config: EngineConfig, method: str,
                   lookahead_block_hashes: bool | None) -> dict[str, object]:
    """The config fields vLLM 0.33 derives from a speculative config of ``method`` drafting
    ``config.num_speculative_tokens`` tokens (``VllmConfig.num_lookahead_tokens``,
    ``num_prefill_lookahead_tokens``, ``num_hash_lookahead_tokens``, the scheduler's
    ``use_eagle_block_drop``): single-module MTP reserves a slot a draft, reads one prefill
    token ahead, and hashes each block with the token after it (on by default,
    ``disable_lookahead_block_hashes`` off) or else drops the last matched block.
    ``lookahead_block_hashes`` None keeps the config's choice. ``kvtrace engine`` holds
    vLLM's own scheduler to these (``VllmScheduler``)."""
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"speculative method {method!r} is not one kvtrace runs",
                          f"Use one of {', '.join(SPECULATIVE_METHODS)}.")
    drafts = config.num_speculative_tokens
    if method == "ngram" or not drafts:
        if lookahead_block_hashes is not None:
            raise ConfigError("lookahead block hashes are MTP's, and this engine does not "
                              "draft with MTP", "Add --speculative-method mtp and "
                              "--num-speculative-tokens K, or drop the option.")
        return {"num_lookahead_tokens": 0, "num_prefill_lookahead_tokens": 0,
                "num_hash_lookahead_tokens": 0, "use_eagle": False}
    if lookahead_block_hashes is None:
        lookahead_block_hashes = not config.use_eagle
    hash_lookahead = 1 if lookahead_block_hashes and config.enable_caching else 0
    return {"num_lookahead_tokens": drafts, "num_prefill_lookahead_tokens": 1,
            "num_hash_lookahead_tokens": hash_lookahead, "use_eagle": not hash_lookahead}


def check_possible(config: EngineConfig) -> None:
    """Refuse a config no engine can have (what reading a trace's figures needs: load, why):
    numbers that do not fit, no groups, sizes that are not positive multiples of the hash
    unit, a negative pool, limit or retention."""
    _check_fits_int64(config)
    groups = config.kv_cache_groups
    unit = config.hash_block_size
    if not groups:
        raise ConfigError("the engine config has no KV-cache groups",
                          "A hybrid engine has a full-attention group and a Mamba group.")
    if len(groups) > MAX_KV_CACHE_GROUPS:
        raise ConfigError(f"the engine config has {len(groups):,} KV-cache groups, more than "
                          f"the {MAX_KV_CACHE_GROUPS} an engine has",
                          "The trace is damaged or was written wrongly; check its source.")
    if unit <= 0:
        raise ConfigError(f"the hash unit (hash_block_size) must be positive, not {unit}",
                          "Use the engine's hash block size (e.g. 16 or 32 tokens).")
    for index, group in enumerate(groups):
        if group.block_size <= 0 or group.block_size % unit:
            raise ConfigError(
                f"KV-cache group {index} ({group.kind}) has block size {group.block_size}, "
                f"not a multiple of the hash unit {unit}",
                "vLLM hashes blocks in hash units: every block size must be a multiple of it.")
        alignment = group.prefill_checkpoint_alignment
        if group.num_prefill_checkpoint_blocks < 0 or (alignment is not None and alignment <= 0):
            raise ConfigError(
                f"KV-cache group {index} has {group.num_prefill_checkpoint_blocks} checkpoint "
                f"blocks at alignment {alignment}", "Both must be positive (or none).")
    for name in ("num_gpu_blocks", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                 "long_prefill_token_threshold", "cache_block_size", "num_speculative_tokens",
                 "num_lookahead_tokens", "num_hash_lookahead_tokens",
                 "num_prefill_lookahead_tokens"):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name} is {getattr(config, name)}, which is negative",
                              "The trace is damaged or was written wrongly; check its source.")
    # Lookahead: at most one slot more than the drafts (DFlash's bonus query).
    for name, limit in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS),
                        ("num_lookahead_tokens", MAX_SPECULATIVE_TOKENS + 1),
                        ("num_hash_lookahead_tokens", MAX_SPECULATIVE_TOKENS + 1),
                        ("num_prefill_lookahead_tokens", MAX_SPECULATIVE_TOKENS + 1)):
        if getattr(config, name) > limit:
            raise ConfigError(f"{name} is {getattr(config, name)}, more than the {limit} "
                              "tokens a drafter reserves or reads",
                              "The trace is damaged or was written wrongly; check its source.")
    block = lcm(*(g.block_size for g in groups))
    retention = config.retention_interval
    if retention is not None and (retention < 0 or retention % block):
        raise ConfigError(
            f"retention interval {retention} is not 0 or a multiple of the scheduler block "
            f"size {block}",
            "vLLM accepts none (dense), 0 (latest-only) or a multiple of the scheduler block.")


def validate(config: EngineConfig) -> None:
    """Refuse an engine vLLM 0.33 would not build, or that kvtrace's replay cannot (here: the
    pool must fit this machine's memory): one ``ConfigError`` per rule, naming the value and
    what to change."""
    check_possible(config)
    groups = config.kv_cache_groups
    for index, group in enumerate(groups):
        if group.kind not in SUPPORTED_GROUP_KINDS:
            raise ConfigError(
                f"KV-cache group {index} is {group.kind!r}; kvtrace replays "
                f"{' and '.join(SUPPORTED_GROUP_KINDS)} groups only",
                "Sliding-window and cross-attention groups are not supported yet.")
        if group.kind == "mamba" and config.enable_caching and group.mamba_cache_mode not in (
                "", "align"):
            raise ConfigError(
                f"Mamba group {index} uses mamba_cache_mode {group.mamba_cache_mode!r}; "
                "prefix caching needs 'align'", "Replay an engine in 'align' mode.")
    mamba = [group for group in groups if group.kind == "mamba"]
    shapes = {(g.block_size, g.num_prefill_checkpoint_blocks, g.prefill_checkpoint_alignment)
              for g in mamba}
    if len(shapes) > 1:
        raise ConfigError(
            f"the {len(mamba)} Mamba groups differ in block size or checkpoint settings "
            f"({sorted(shapes, key=str)}); vLLM builds every Mamba group from one cache config",
            "Give every Mamba group the same block size, checkpoint blocks and alignment.")
    if config.num_gpu_blocks < 2:
        raise ConfigError(f"num_gpu_blocks is {config.num_gpu_blocks}, which leaves no usable "
                          "block", "vLLM reserves one block as the null block; use at least 2.")
    check_pool_memory(config.num_gpu_blocks)


def available_memory() -> int | None:
    """Bytes this machine can still give a process (``MemAvailable``, within a cgroup's
    limit); None where the kernel does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as limit:
                available = min(available, int(limit.read()))
        except (OSError, ValueError):
            pass  # absent, or "max"
    return available


def check_pool_memory(num_gpu_blocks: int, subject: str = "", hint: str = "",
                      bytes_per_block: int = REPLAY_BYTES_PER_BLOCK,
                      available: int | None = None, where: str = "this machine") -> None:
    """Refuse a pool of ``num_gpu_blocks`` (what ``subject`` needs; default: the pool itself)
    that a replay on this machine (``where``, with ``available`` bytes: default this machine's
    memory) could not hold, ``bytes_per_block`` a block, rather than run into the limit."""
    available = available_memory() if available is None else available
    need = num_gpu_blocks * bytes_per_block
    if available is None or need <= available:
        return
    raise ConfigError(
        f"{subject or f'a pool of {num_gpu_blocks:,} blocks'} needs about {_bytes(need)} of "
        f"memory to replay ({bytes_per_block:,} bytes a block), more than the "
        f"{_bytes(available)} {where} has available",
        hint or f"Use at most {available // bytes_per_block:,} blocks here "
                "(--num-gpu-blocks), or replay on a machine with more memory.")


def _bytes(count: int) -> str:
    """``count`` bytes to a tenth of the largest binary unit it holds one of (exact for any
    integer, however large)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    power = 0
    while power < len(units) - 1 and count >= 1024 ** (power + 1):
        power += 1
    tenths = count * 10 // 1024 ** power
    return f"{tenths // 10:,}.{tenths % 10} {units[power]}"


def _check_fits_int64(config: EngineConfig) -> None:
    """Every number of the config must fit the 64-bit integers a trace header holds."""
    fields = [(f"group {i} {name}", value) for i, group in enumerate(config.kv_cache_groups)
              for name, value in msgspec.structs.asdict(group).items()]
    fields += msgspec.structs.asdict(config).items()
    for name, value in fields:
        if isinstance(value, int) and not -MAX_INT64 - 1 <= value <= MAX_INT64:
            raise ConfigError(f"{name} {value} does not fit a trace's 64-bit integers",
                              "Give a value below 2**63.")


def blocks_needed(config: EngineConfig, num_tokens: int) -> int:
    """vLLM's own per-request need (``max_memory_usage_bytes``) in blocks: a full-attention
    block per block of tokens, 2 + checkpoint blocks per Mamba "align" group; plus the null
    block."""
    need = 1
    for group in config.kv_cache_groups:
        if group.kind == "mamba":
            need += 2 + group.num_prefill_checkpoint_blocks
        else:
            need += -(-num_tokens // group.block_size)
    return need


# Hash ids for units no workload named (decode past the known ones) are made up from here,
# far above any workload's ids, so a made-up unit never equals a unit of a later request; a
# trace's own ids lie below it (and are never negative: a hash id is a hash's bytes).
FIRST_MADE_UP_HASH_ID = 1 << 62


def num_hashed_units(num_tokens: int, hash_unit: int, hash_lookahead: int = 0) -> int:
    """The hash units vLLM's block hasher has hashed for ``num_tokens`` tokens: the whole ones,
    each once the ``hash_lookahead`` tokens after it exist too (0.33's lookahead block hashes,
    ``EngineConfig.num_hash_lookahead_tokens``)."""
    return max(0, num_tokens - hash_lookahead) // hash_unit


def check_request(req: int | str, prompt_len: int, max_tokens: int, hash_ids: Sequence[int],
                  hash_unit: int, hash_lookahead: int = 0) -> None:
    """A request a replay can run: a prompt with one hash id per full hash unit (with lookahead
    hashes, an engine hashes its last ones only once the tokens after them exist), each from 0
    up to ``FIRST_MADE_UP_HASH_ID``, no negative output, and at most ``MAX_REQUEST_TOKENS`` in
    all."""
    if prompt_len < 1 or max_tokens < 0:
        raise ConfigError(f"request {req} has {prompt_len} prompt and {max_tokens} output "
                          "tokens; a request has a prompt, and no negative output",
                          "The trace is damaged or was written wrongly; check its source.")
    if prompt_len + max_tokens > MAX_REQUEST_TOKENS:
        raise ConfigError(f"request {req} has {prompt_len + max_tokens:,} tokens, more than the "
                          f"{MAX_REQUEST_TOKENS:,} kvtrace replays (longer than any model's "
                          "context)", "Check the request's prompt and output lengths.")
    fewest = num_hashed_units(prompt_len, hash_unit, hash_lookahead)
    if not fewest <= len(hash_ids) <= prompt_len // hash_unit:
        needs = (f"{prompt_len // hash_unit}" if fewest == prompt_len // hash_unit
                 else f"{fewest} to {prompt_len // hash_unit}")
        raise ConfigError(f"request {req}: {len(hash_ids)} hash ids for a {prompt_len}-token "
                          f"prompt (hash unit {hash_unit} needs {needs})",
                          "Each full hash unit of the prompt needs exactly one hash id.")
    check_hash_ids(req, hash_ids)


def hash_id_out_of_range(hash_ids: Sequence[int]) -> int | None:
    """The lowest or highest of ``hash_ids`` if it lies outside 0 to below
    ``FIRST_MADE_UP_HASH_ID`` (a backend turns each id into hash bytes); None if none does."""
    return next((hash_id for hash_id in (min(hash_ids, default=0), max(hash_ids, default=0))
                 if not 0 <= hash_id < FIRST_MADE_UP_HASH_ID), None)


def check_hash_ids(req: int | str, hash_ids: Sequence[int]) -> None:
    """A request's hash ids (its prompt's, or the output units a later turn names) all in
    range (``hash_id_out_of_range``)."""
    hash_id = hash_id_out_of_range(hash_ids)
    if hash_id is not None:
        raise ConfigError(f"request {req} has hash id {hash_id}; hash ids run from 0 to below "
                          "2^62", "The trace is damaged or was written wrongly; check its source.")


def check_added_request(config: EngineConfig, req: int, prompt_len: int, hash_ids: Sequence[int],
                        max_tokens: int, known: bool) -> None:
    """Refuse a request a backend is given as both backends do: ``check_request``, a new
    number (``known``: added before), a sequence the pool can hold."""
    check_request(req, prompt_len, max_tokens, hash_ids, config.hash_block_size,
                  config.num_hash_lookahead_tokens)
    if known:
        raise ConfigError(f"request {req} was added twice",
                          "Request numbers must be unique within a trace.")
    check_pool_fits(config, req, prompt_len + max_tokens)


def check_fits_model_len(settings: SchedulerSettings, req: int, prompt_len: int) -> None:
    """vLLM rejects a prompt that leaves no room below ``max_model_len`` at its API."""
    limit = settings.max_model_len
    if limit and prompt_len >= limit:
        raise ConfigError(
            f"request {req} has a {prompt_len}-token prompt, not below max_model_len {limit}",
            "Raise --max-model-len (vLLM rejects such a request at the API).")


def check_pool_fits(config: EngineConfig, req: int, num_tokens: int) -> None:
    """Refuse a request whose whole sequence needs more blocks than the pool has: vLLM's
    scheduler would wait for it forever."""
    need = blocks_needed(config, num_tokens)
    if need > config.num_gpu_blocks:
        raise ConfigError(
            f"a pool of {config.num_gpu_blocks} blocks cannot hold request {req} "
            f"({num_tokens} tokens need {need} blocks, null block included)",
            f"Raise --num-gpu-blocks to at least {need}, or shorten the request.")


def describe_retention(retention: int | None) -> str:
    return "none" if retention is None else str(retention)


def parse_retention(text: str) -> int | None:
    """``none``/``dense`` (keep every state), ``0`` (latest-only) or a token interval."""
    if text.lower() in ("none", "dense"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--retention {text!r} is not none, 0 or a number of tokens",
                          "Use --retention none (dense), 0 (latest-only) or N tokens.") from None
    if value < 0:
        raise ConfigError(f"--retention {value} is negative", "Use none, 0 or a positive N.")
    return value
