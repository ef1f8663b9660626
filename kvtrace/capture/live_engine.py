"""What a capture reads off the live vLLM engine it runs in: the process's title, its
``KVCacheManager`` objects and the schedulers that own them, and from those the trace header's
engine config, served model, scheduling and variant (vLLM 0.33 attributes). vLLM is imported
only inside functions."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

from kvtrace.events import EngineConfig, KVCacheGroup
from kvtrace.probes.signatures import drafter_fields_of, release_has


def process_title() -> str:
    """The title vLLM gave this process (``VLLM::EngineCore...``), else its command name."""
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            return cmdline.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return os.path.basename(sys.argv[0]) if sys.argv else ""


def find_kv_cache_managers() -> list[tuple[Any, Any]]:
    """Every live vLLM ``KVCacheManager`` in this process (normally one per engine core), each
    with the vLLM scheduler that owns it (None when none is found).

    Looked for first among the objects the running threads' frames hold (the engine core's
    busy loop holds its scheduler, which holds the manager): cheap. Only if that finds none is
    the garbage collector's object list scanned, a pause of a few tenths of a second."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.interface import SchedulerInterface

    found: dict[int, Any] = {}
    for frame in sys._current_frames().values():
        while frame is not None:
            for value in list(frame.f_locals.values()):
                _collect(value, KVCacheManager, SchedulerInterface, found, depth=3)
            frame = frame.f_back
    if not any(_is_a(obj, KVCacheManager) for obj in found.values()):
        found = {id(obj): obj for obj in gc.get_objects()
                 if _is_a(obj, KVCacheManager) or _is_a(obj, SchedulerInterface)}
    owners = {id(getattr(obj, "kv_cache_manager", None)): obj for obj in found.values()
              if _is_a(obj, SchedulerInterface)}
    return [(obj, owners.get(id(obj))) for obj in found.values() if _is_a(obj, KVCacheManager)]


def _is_a(value: Any, cls: type) -> bool:
    """``isinstance`` by the object's real type only: no ``__class__`` lookup, which some
    proxies in a live process answer with a warning (or worse)."""
    return cls in type(value).__mro__


def _collect(value: Any, manager_type: type, scheduler_type: type, found: dict[int, Any],
             depth: int) -> None:
    """Managers and schedulers reachable from ``value`` within ``depth`` attribute hops."""
    if _is_a(value, manager_type):
        found[id(value)] = value
        return
    if _is_a(value, scheduler_type):
        found[id(value)] = value  # and on, to the manager it holds
    attributes = getattr(value, "__dict__", None)
    if depth == 0 or not isinstance(attributes, dict) or isinstance(value, type):
        return
    for attribute in list(attributes.values()):
        if hasattr(attribute, "__dict__") and not callable(attribute):
            _collect(attribute, manager_type, scheduler_type, found, depth - 1)


def engine_config_of(manager: Any, scheduler: Any = None) -> EngineConfig:
    """Read the engine's cache settings off a live ``KVCacheManager``, and its scheduler limits
    off the scheduler that owns it when there is one (vLLM 0.33 attributes)."""
    config = manager.kv_cache_config
    groups = []
    for (kind, _sliding_window), group in zip(manager.kv_cache_event_metadata, config.kv_cache_groups):
        spec = group.kv_cache_spec
        groups.append(KVCacheGroup(
            kind=kind,
            block_size=spec.block_size,
            mamba_cache_mode=getattr(spec, "mamba_cache_mode", "") or "",
            num_prefill_checkpoint_blocks=getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0,
            prefill_checkpoint_alignment=getattr(spec, "prefill_checkpoint_alignment", None),
        ))
    coordinator = manager.coordinator
    hash_block_size = (release_has("KVCacheConfig.hash_block_size") and config.hash_block_size
                       or getattr(coordinator, "hash_block_size", 0))
    return EngineConfig(
        kv_cache_groups=groups,
        hash_block_size=hash_block_size,
        num_gpu_blocks=config.num_blocks,
        retention_interval=config.prefix_cache_retention_interval,
        enable_caching=manager.enable_caching,
        max_model_len=manager.max_model_len,
        **drafter_fields_of(manager, scheduler),
        **({} if scheduler is None else _scheduler_limits(scheduler, groups)),
    )


def _scheduler_limits(scheduler: Any, groups: list[KVCacheGroup]) -> dict[str, Any]:
    scheduler_config = scheduler.scheduler_config
    # What the Mamba split aligns to, where it is not the Mamba groups' own block size.
    split_block_size = scheduler.cache_config.block_size
    mamba_block_sizes = {group.block_size for group in groups if group.kind == "mamba"}
    return {
        "async_scheduling": is_async_scheduler(scheduler),
        "cache_block_size": (split_block_size if mamba_block_sizes
                             and mamba_block_sizes != {split_block_size} else 0),
        "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
        "max_num_seqs": scheduler_config.max_num_seqs,
        "long_prefill_token_threshold": scheduler_config.long_prefill_token_threshold,
        "reserve_full_sequence": bool(scheduler_config.scheduler_reserve_full_isl),
    }


def served_model(scheduler: Any) -> dict[str, str]:
    """The model the engine serves, by the name it serves it as (vLLM's ``served_model_name``;
    a replay prices recomputed tokens with it when it names a model kvtrace knows), with the
    ``--hf-overrides`` the engine applied to its config, as ``presets.model_spec`` writes them
    (``NAME --hf-overrides JSON``), which every reader of a model applies again."""
    from kvtrace.geometry.presets import model_spec

    model_config = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", "")
    if isinstance(name, list):
        name = name[0] if name else ""
    if not isinstance(name, str) or not name:
        return {}
    overrides = getattr(model_config, "hf_overrides", None)  # a dict, or a function (Python)
    try:
        return {"model": model_spec(name, overrides if isinstance(overrides, dict) else {})}
    except (TypeError, ValueError):  # overrides given in Python that are no JSON
        return {"model": name}


def is_async_scheduler(scheduler: Any) -> bool:
    """Whether the engine runs vLLM's ``AsyncScheduler`` (read off the class: an engine built
    by hand may run the synchronous one whatever its config says)."""
    return any(cls.__name__ == "AsyncScheduler" for cls in type(scheduler).__mro__)


def scheduling(scheduler: Any) -> dict[str, str]:
    """How the engine schedules, which decides when its cache calls happen: the scheduler's
    class, and whether it is vLLM's ``AsyncScheduler`` (what the engine runs where async
    scheduling is on, vLLM's default; read off the class, since an engine built by hand, as
    ``kvtrace engine``'s, may run the synchronous one whatever its config says), and the
    speculative decoding it runs (method and draft tokens a step; none: 0)."""
    speculative = getattr(getattr(scheduler, "vllm_config", None), "speculative_config", None)
    return {"scheduler": type(scheduler).__name__,
            "async_scheduling": str(is_async_scheduler(scheduler)).lower(),
            "speculative_method": str(getattr(speculative, "method", None) or ""),
            "num_speculative_tokens": str(getattr(speculative, "num_speculative_tokens",
                                                  None) or 0)}


def engine_variant(manager: Any) -> str:
    """The checkpoint variant kvtrace's own engine installed, else the vLLM's own code."""
    for single_type_manager in manager.coordinator.single_type_managers:
        variant = getattr(single_type_manager, "kvtrace_variant", None)
        if variant:
            return variant
    return "upstream"

