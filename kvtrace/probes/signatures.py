"""The vLLM signature contract of the probes: which releases, which methods, which parameters.

kvtrace supports the releases with #56794's checkpoint path, the rows of
``kvtrace.vllm_release_table`` (``SUPPORTED_VLLM_VERSIONS``, keyed by ``vllm.__version__``).
``EXPECTED_SIGNATURES`` are the newest's (the table's last row); ``SINCE`` is the one place that
knows what an older release lacks, each entry naming the first release that has it: a trailing
parameter of a wrapped method (``"Class.method(parameter)"``), or an attribute kvtrace's code
reads. ``release_has`` asks it. A new release with a parameter or attribute the others lack
adds it to both; one without adds nothing here.

``probe_targets()`` refuses a release outside the table, then resolves every wrapped method
on the real classes (by qualified name) and checks its parameters against that release's
(``expected_signatures``), raising ``ProbeSignatureError`` before anything is patched. The
wrappers (``wrappers.py``) are written against the newest parameter lists and rebuilt for an
older release's; ``parameter_names`` is how both sides spell them.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from typing import Any, Callable

from kvtrace.errors import KvtraceError
from kvtrace.vllm_release_table import SUPPORTED_VLLM_VERSIONS

_BLOCK_POOL = "vllm.v1.core.block_pool.BlockPool"
_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
_MAMBA = "vllm.v1.core.single_type_kv_cache_manager.MambaManager"

# Qualified name -> parameter names in the newest supported release ("*x": keyword-only).
# Older supported releases lack only the trailing parameters ``SINCE`` names.
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    f"{_BLOCK_POOL}.get_new_blocks": ("self", "num_blocks"),
    f"{_BLOCK_POOL}.touch": ("self", "blocks"),
    f"{_BLOCK_POOL}.free_blocks": ("self", "ordered_blocks"),
    f"{_BLOCK_POOL}.cache_full_blocks": (
        "self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
        "kv_cache_group_id", "block_mask"),
    f"{_BLOCK_POOL}.cache_partial_block": (
        "self", "request", "block", "num_tokens", "kv_cache_group_id", "block_size",
        "replace_existing_hashes"),
    f"{_BLOCK_POOL}.move_block_hashes": ("self", "src_block", "dst_block"),
    f"{_BLOCK_POOL}.evict_blocks": ("self", "block_ids"),
    f"{_BLOCK_POOL}.reset_prefix_cache": ("self",),
    f"{_BLOCK_POOL}._remove_cached_block_hashes": ("self", "block"),
    f"{_BLOCK_POOL}._insert_block_hash": ("self", "block_hash_with_group_id", "block",
                                          "num_tokens"),
    f"{_MANAGER}.new_step_starts": ("self",),
    f"{_MANAGER}.get_computed_blocks": ("self", "request", "max_cache_hit_length"),
    f"{_MANAGER}.allocate_slots": (
        "self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
        "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
        "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs",
        "skip_zeroing_group_ids"),
    f"{_MANAGER}.free": ("self", "request"),
    f"{_MANAGER}.cache_blocks": ("self", "request", "num_computed_tokens"),
    f"{_MANAGER}.pop_blocks_for_free": ("self", "request"),
    f"{_MAMBA}.get_num_blocks_to_allocate": (
        "self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
        "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap",
        "prefill_end"),
    f"{_MAMBA}.allocate_new_blocks": ("self", "request_id", "num_tokens",
                                      "num_tokens_main_model"),
    f"{_MAMBA}.cache_blocks": ("self", "request", "num_tokens", "retention_interval",
                               "*replay_boundaries"),
}


# What a supported release may lack -> the first release that has it (read off the wheels).
SINCE: dict[str, str] = {
    "MambaManager.get_num_blocks_to_allocate(prefill_end)": "0.31.0",
    "KVCacheManager.allocate_slots(skip_zeroing_group_ids)": "0.32.0",
    "KVCacheManager.get_computed_blocks(max_cache_hit_length)": "0.33.0",
    "KVCacheConfig.hash_block_size": "0.32.0",
    "BlockPool.num_hash_lookahead_tokens": "0.33.0",
}


class ProbeSignatureError(KvtraceError):
    """A wrapped vLLM method does not have the signature the probes were written against."""

    default_hint = (f"kvtrace's probes support vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
                    "install one of them or a kvtrace release that supports yours.")


def installed_vllm_version() -> str:
    """``vllm.__version__`` of the vLLM this process imports (a release beside the project's,
    when its directory comes first on ``sys.path``)."""
    from vllm import __version__

    return __version__


def check_supported(version: str) -> str:
    """``version``, if kvtrace supports it; ``ProbeSignatureError`` naming the ones it does."""
    if version not in SUPPORTED_VLLM_VERSIONS:
        raise ProbeSignatureError(
            f"vLLM {version} is not a release kvtrace supports (supported: "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)})",
            "kvtrace supports the releases with #56794's checkpoint path; run one of them, or "
            "a kvtrace release that supports yours.")
    return version


def release_has(feature: str, version: str | None = None) -> bool:
    """Whether release ``version`` (default: the one imported) has ``feature``, a key of
    ``SINCE``."""
    version = check_supported(version or installed_vllm_version())
    return SUPPORTED_VLLM_VERSIONS.index(version) >= SUPPORTED_VLLM_VERSIONS.index(SINCE[feature])


def drafter_fields_of(manager: Any, scheduler: Any = None) -> dict[str, Any]:
    """The ``EngineConfig`` fields a live engine's drafter decides, as its ``KVCacheManager``
    holds them (the drop, the hash lookahead) and, given the scheduler that owns it, as that
    holds them (drafts, lookahead slots, prefill lookahead): what a capture records and what
    ``kvtrace engine`` holds vLLM's scheduler to."""
    fields: dict[str, Any] = {
        "use_eagle": manager.use_eagle,
        "num_hash_lookahead_tokens": (manager.block_pool.num_hash_lookahead_tokens
                                      if release_has("BlockPool.num_hash_lookahead_tokens")
                                      else 0)}
    if scheduler is not None:
        fields.update(num_speculative_tokens=getattr(scheduler, "num_spec_tokens", 0) or 0,
                      num_lookahead_tokens=getattr(scheduler, "num_lookahead_tokens", 0) or 0,
                      num_prefill_lookahead_tokens=getattr(scheduler, "num_prefill_lookahead",
                                                           0) or 0)
    return fields


def expected_signatures(version: str) -> dict[str, tuple[str, ...]]:
    """``EXPECTED_SIGNATURES`` as release ``version`` has them."""
    signatures = {}
    for qualname, names in EXPECTED_SIGNATURES.items():
        method = ".".join(qualname.rsplit(".", 2)[-2:])
        signatures[qualname] = tuple(
            name for name in names
            if f"{method}({name.lstrip('*')})" not in SINCE
            or release_has(f"{method}({name.lstrip('*')})", version))
    return signatures


def parameter_names(function: Callable) -> tuple[str, ...]:
    """``function``'s parameter names as ``EXPECTED_SIGNATURES`` spells them."""
    return tuple(
        ("*" if p.kind is inspect.Parameter.KEYWORD_ONLY else "") + p.name
        for p in inspect.signature(function).parameters.values()
    )


def probe_targets() -> list[tuple[type, str, Callable]]:
    """Check the imported vLLM is a supported release, resolve every wrapped method and check
    its signature against that release's; raise before anything is patched."""
    version = check_supported(installed_vllm_version())
    targets = []
    for qualname, expected in expected_signatures(version).items():
        module_name, class_name, method_name = qualname.rsplit(".", 2)
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
            function = owner.__dict__[method_name]
        except (ImportError, AttributeError, KeyError):
            raise ProbeSignatureError(f"vLLM {version} has no {qualname}") from None
        found = parameter_names(function)
        if found != expected:
            raise ProbeSignatureError(
                f"{qualname} has parameters ({', '.join(found)}); vLLM {version} has "
                f"({', '.join(expected)})"
            )
        targets.append((owner, method_name, function))
    return targets


def replaced_methods() -> list[str]:
    """The probed vLLM methods that are not vLLM's own right now (a probe, a trigger), by
    qualified name: [] once every patch is undone. Imports nothing: a process that has not
    imported vLLM's cache has nothing replaced."""
    replaced = []
    for qualname in EXPECTED_SIGNATURES:
        module_name, class_name, method_name = qualname.rsplit(".", 2)
        owner = getattr(sys.modules.get(module_name), class_name, None)
        function = None if owner is None else owner.__dict__.get(method_name)
        if function is not None and not (type(function) is types.FunctionType
                                         and function.__module__ == owner.__module__):
            replaced.append(qualname)
    return replaced


def block_pool_class() -> type:
    """vLLM's ``BlockPool`` class: a process-wide probe set marks it."""
    module_name, class_name = _BLOCK_POOL.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)
