"""The geometry itself, computed on CPU by vLLM 0.33's own code wherever that code runs here.

Real vLLM: ``ModelConfig`` / ``VllmConfig`` (the model's dtype, MLA detection, head sizes, the
``align`` mode its hybrid config hook sets), the model class's
``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``, the
``MLAAttentionSpec`` / ``FullAttentionSpec`` / ``MambaSpec`` page arithmetic, the backend's
``get_preferred_block_size``, ``resolve_kv_cache_layout``, ``get_kv_cache_groups``,
``get_kv_cache_config_from_groups`` (``num_gpu_blocks``) and ``resolve_kv_cache_block_sizes``
(the hash unit). Reproduced (each tested against vLLM): the SM90 backend choice and
``_align_hybrid_block_size`` (rule.py), the per-layer checkpoint settings (families.py), the
weights (weights.py). vLLM is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.files import write_atomically
from kvtrace.geometry.architecture import ATTENTION, MAMBA, MLA
from kvtrace.geometry.families import GRID, family_of
from kvtrace.geometry.presets import ModelSource, resolve_model
from kvtrace.geometry.result import GIB, Geometry, GeometryGroup, MemorySplit
from kvtrace.geometry.rule import SM90_BACKENDS, SM90_KERNEL_BLOCK, hybrid_block_size
from kvtrace.geometry.weights import model_weights

# What CUDA reports for an H200 (torch.cuda.get_device_properties().total_memory, 143,156 MiB;
# vLLM logs it as "total_gpu_memory (139.8GiB)"), which vLLM multiplies by the utilization.
# Not the 141 GB of the datasheet, nor NVML's 143,771 MiB total: the driver keeps part of it.
H200_GIB = 143_156 / 1024
# What vLLM's start-up profile sets aside besides weights and KV cache, per GPU: the peak
# activation memory of a max_num_batched_tokens forward pass, CUDA graphs, and non-torch
# memory (CUDA context, cuBLAS / NCCL workspaces). vLLM measures it on the GPU; kvtrace
# cannot, and assumes 6 GiB (typical of H100/H200 start-up logs at 8,192 batched tokens:
# "model weights take X GiB; non_torch memory ~1 GiB; PyTorch activation peak ~2-4 GiB",
# plus ~1 GiB of CUDA graphs). --non-kv-memory-gib replaces it.
DEFAULT_NON_KV_GIB = 6.0
# The fp8 caches FA3 takes, and its largest head size on SM90 (beyond it vLLM moves to FA4).
SM90_FA3_FP8_DTYPES = ("fp8", "fp8_e4m3")
SM90_FA3_MAX_HEAD_SIZE = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM 0.33 `vllm serve` default on H100/H200
CACHE_VERSION = "2"
# vLLM imports the model class (Kimi, Qwen3-Next pull in compressed-tensors and loguru).
MODEL_CLASS_HINT = ("vLLM could not import the model's class: install the vLLM dependencies it "
                    "needs (compressed-tensors==0.17.0, loguru; scripts/bootstrap installs them).")


@dataclass(frozen=True)
class Deployment:
    """The serving settings a geometry depends on."""

    gpu_memory_gib: float = H200_GIB
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    non_kv_memory_gib: float | None = None  # None: DEFAULT_NON_KV_GIB


def default_gpu_memory_gib() -> float:
    """The GPU memory a geometry assumes unless told: that of the first GPU NVML sees on this
    host (its total less what the driver reserves, as the figure CUDA hands vLLM), else an
    H200's (``H200_GIB``)."""
    try:
        import pynvml
    except ImportError:
        return H200_GIB
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver, no GPU
        return H200_GIB
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            total = info.total - info.reserved
        except pynvml.NVMLError:  # a driver without the v2 figures
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    except pynvml.NVMLError:
        return H200_GIB
    finally:
        pynvml.nvmlShutdown()
    return total / GIB


def compute_geometry(model: str | Path | ModelSource, *, gpu_memory_gib: float | None = None,
                     gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
                     kv_cache_dtype: str = "auto", max_num_batched_tokens: int | None = None,
                     non_kv_memory_gib: float | None = None,
                     cache_dir: Path | None = None) -> Geometry:
    """The geometry vLLM 0.33 builds for ``model`` (a preset name, a config.json path, or a
    ``ModelSource``) on GPUs of ``gpu_memory_gib`` (default: ``default_gpu_memory_gib``) in
    ``align`` mode.

    Results are cached on disk by their inputs (``cache_dir``; default
    ``$XDG_CACHE_HOME/kvtrace/geometry``, ``KVTRACE_GEOMETRY_CACHE=0`` disables): importing
    vLLM and building its config takes tens of seconds on a small CPU.
    """
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    deployment = Deployment(
        default_gpu_memory_gib() if gpu_memory_gib is None else gpu_memory_gib,
        gpu_memory_utilization, tensor_parallel_size, kv_cache_dtype,
        max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, non_kv_memory_gib)
    _check_deployment(deployment)
    cache_file = _cache_file(source, deployment, cache_dir)
    if cache_file is not None and cache_file.is_file():
        try:
            return msgspec.json.decode(cache_file.read_bytes(), type=Geometry)
        except msgspec.DecodeError:
            pass  # damaged: compute again and overwrite
    geometry = _compute(source, deployment)
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(cache_file, msgspec.json.encode(geometry))
        except (OSError, KvtraceError):
            pass  # a cache that cannot be written only costs the next run the computation
    return geometry


def _check_deployment(deployment: Deployment) -> None:
    if not 0 < deployment.gpu_memory_gib < math.inf or not (
            0 < deployment.gpu_memory_utilization <= 1):
        raise ConfigError(
            f"GPU memory {deployment.gpu_memory_gib} GiB at utilization "
            f"{deployment.gpu_memory_utilization} leaves nothing to plan",
            "Give --gpu-memory-gib > 0 and 0 < --gpu-memory-utilization <= 1.")
    if deployment.tensor_parallel_size < 1 or deployment.max_num_batched_tokens < 1:
        raise ConfigError("--tensor-parallel-size and --max-num-batched-tokens must be positive",
                          "Give positive values.")
    non_kv = deployment.non_kv_memory_gib
    if non_kv is not None and not 0 <= non_kv < math.inf:
        raise ConfigError(f"--non-kv-memory-gib is {non_kv}", "Give 0 or more GiB.")


def _cache_file(source: ModelSource, deployment: Deployment, cache_dir: Path | None
                ) -> Path | None:
    if cache_dir is None:
        if os.environ.get("KVTRACE_GEOMETRY_CACHE", "1") == "0":
            return None
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        cache_dir = Path(base) / "kvtrace" / "geometry"
    from importlib.metadata import version

    from kvtrace import __version__

    key = json.dumps([CACHE_VERSION, __version__, version("vllm"), source.config,
                      source.source, deployment.__dict__], sort_keys=True, default=str)
    return cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _compute(source: ModelSource, deployment: Deployment) -> Geometry:
    from vllm import __version__ as vllm_version
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)
    from vllm.v1.core.kv_cache_planning import (get_kv_cache_config_from_groups,
                                                get_kv_cache_groups)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import MambaSpec, get_kv_cache_spec_kind, get_kv_quant_mode

    with tempfile.TemporaryDirectory(prefix="kvtrace-geometry-") as folder:
        vllm_config = _vllm_config(source, deployment, Path(folder))
    # The fields a config.json leaves out are the HF config class's defaults, as vLLM reads
    # the model (Nemotron-H without n_groups, Qwen3-Next without linear_num_value_heads).
    source = dataclasses.replace(source, config=_with_defaults(
        source.config, vllm_config.model_config.hf_config.to_dict()))
    family = family_of(source.architecture)  # after vLLM has said whether it is hybrid
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    text = source.text_config
    plans = family.layers(text)
    if not any(p.kind == MAMBA for p in plans) or all(p.kind == MAMBA for p in plans):
        raise _not_hybrid(source, "its layers are not a mix of attention and Mamba/KDA")
    use_mla = model_config.use_mla
    if use_mla != any(p.kind == MLA for p in plans):
        raise ConfigError(f"{source.name}: vLLM's use_mla ({use_mla}) disagrees with the "
                          "layer layout kvtrace reads from the config",
                          "Check the config's MLA fields (kv_lora_rank, qk_rope_head_dim).")

    backend_name = SM90_BACKENDS[use_mla]
    backend = _backend_class(backend_name)
    kv_dtype = _kv_dtype(cache_config.cache_dtype, model_config.dtype)
    quant_mode = get_kv_quant_mode(cache_config.cache_dtype)
    head_size = model_config.get_head_size()
    if not _takes_on_sm90(backend_name, backend, cache_config.cache_dtype, head_size):
        raise ConfigError(
            f"{backend_name}, the attention backend vLLM 0.33 prefers on an H200, does not take "
            f"kv_cache_dtype {cache_config.cache_dtype!r} with head size {head_size}; vLLM would "
            "fall back to another backend, which kvtrace does not model",
            "Use --kv-cache-dtype auto (or bfloat16).")
    model_cls = _model_class(model_config)
    try:
        mamba_spec = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                               dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                               block_size=-1)
    except (AssertionError, ValueError) as error:  # e.g. heads not divisible by TP
        raise ConfigError(
            f"vLLM 0.33 cannot lay out {source.name}'s Mamba/KDA state at tensor parallel size "
            f"{deployment.tensor_parallel_size}: {error or type(error).__name__}",
            "Use a tensor parallel size that divides the model's head counts.") from error
    ssm_dtype = str(mamba_spec.dtypes[-1]).removeprefix("torch.")
    checkpointing = family.checkpointing(text, str(model_config.dtype).removeprefix("torch."),
                                         ssm_dtype)
    attn_page = _attention_page(vllm_config, backend, kv_dtype, quant_mode)
    kernel_block = SM90_KERNEL_BLOCK[backend_name]
    with set_current_vllm_config(vllm_config):
        preferred = backend.get_preferred_block_size(cache_config.DEFAULT_BLOCK_SIZE)
    block_size = hybrid_block_size(
        attn_page_per_token=attn_page, mamba_page=mamba_spec.page_size_bytes,
        block_size=preferred, kernel_block=kernel_block, backend_kernel_blocks=[kernel_block],
        use_mla=use_mla, checkpoint_alignment=checkpointing.layer_alignment)
    cache_config.block_size = block_size
    cache_config.mamba_block_size = block_size  # align mode
    page = block_size * attn_page
    padded = page if page != mamba_spec.page_size_bytes else None
    cache_config.mamba_page_size_padded = padded

    spec_alignment = (block_size if checkpointing.spec_alignment == GRID
                      else checkpointing.spec_alignment) if checkpointing.spec_blocks else None
    prefix = "language_model.model." if "text_config" in source.config else "model."
    specs = {prefix + plan.name: _layer_spec(plan.kind, vllm_config, family, mamba_spec,
                                             kv_dtype, quant_mode, checkpointing.spec_blocks,
                                             spec_alignment)
             for plan in plans}
    resolve_kv_cache_layout(vllm_config, [[layout.name for layout in
                                           get_supported_kv_cache_layouts([backend])]],
                            specs.values())
    groups = get_kv_cache_groups(vllm_config, specs)

    weights = model_weights(source.architecture, source.config)
    memory = _memory_split(source, deployment, weights)
    kv_config = get_kv_cache_config_from_groups(vllm_config, groups, memory.kv_cache_bytes)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, vllm_config)
    bytes_per_block = kv_config.kv_cache_tensors[0].size // max(kv_config.num_blocks, 1)
    # A checkpoint holds one block id in every Mamba group; each block id is a slot in every
    # shared layer tensor, so it costs bytes_per_block of the pool.
    mamba_groups = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    return Geometry(
        model=source.name, architecture=source.architecture, source=source.source,
        vllm_version=vllm_version, attention_backend=backend_name,
        mamba_prefill_backend=checkpointing.prefill_backend,
        kv_cache_dtype=cache_config.cache_dtype,
        tensor_parallel_size=deployment.tensor_parallel_size,
        max_num_batched_tokens=deployment.max_num_batched_tokens,
        block_size=block_size, mamba_block_size=cache_config.mamba_block_size,
        hash_block_size=hash_block_size, scheduler_block_size=scheduler_block_size,
        attention_page_bytes_per_token=attn_page, page_bytes=page,
        mamba_state_bytes=mamba_spec.page_size_bytes,
        checkpoint_alignment=spec_alignment,
        checkpoint_blocks=len(mamba_groups),
        checkpoint_bytes=len(mamba_groups) * bytes_per_block,
        bytes_per_block=bytes_per_block, num_gpu_blocks=kv_config.num_blocks,
        groups=[GeometryGroup(
            kind=get_kv_cache_spec_kind(g.kv_cache_spec).value, num_layers=len(g.layer_names),
            block_size=g.kv_cache_spec.block_size, layers=list(g.layer_names),
            num_prefill_checkpoint_blocks=getattr(g.kv_cache_spec,
                                                  "num_prefill_checkpoint_blocks", 0),
            prefill_checkpoint_alignment=getattr(g.kv_cache_spec,
                                                 "prefill_checkpoint_alignment", None))
            for g in groups],
        memory=memory)


def _takes_on_sm90(backend_name: str, backend: Any, cache_dtype: str, head_size: int) -> bool:
    """Whether the backend takes this KV-cache dtype and head size on an H200. FLASH_ATTN runs
    FA3 there for head sizes up to 256, and FA3 takes an fp8 (e4m3) cache
    (``fa_utils.flash_attn_supports_kv_cache_dtype``); vLLM's own check asks the installed
    flash-attn for its version, and a CPU build has none, so here it refuses fp8 for all."""
    if not backend.supports_head_size(head_size):
        return False
    if backend_name == "FLASH_ATTN" and cache_dtype in SM90_FA3_FP8_DTYPES:
        return head_size <= SM90_FA3_MAX_HEAD_SIZE
    return backend.supports_kv_cache_dtype(cache_dtype)


def _attention_page(vllm_config: Any, backend: Any, kv_dtype: Any, quant_mode: Any) -> int:
    """One token of one attention layer, as ``_align_hybrid_block_size`` computes it."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    model_config, cache_dtype = vllm_config.model_config, vllm_config.cache_config.cache_dtype
    num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
    if model_config.use_mla:
        return MLAAttentionSpec(block_size=1, num_kv_heads=num_kv_heads,
                                head_size=model_config.get_head_size(), dtype=kv_dtype,
                                cache_dtype_str=cache_dtype, kv_quant_mode=quant_mode
                                ).page_size_bytes
    with set_current_vllm_config(vllm_config):  # customize_spec may read the model config
        return backend.customize_spec(FullAttentionSpec(
            block_size=1, num_kv_heads=num_kv_heads, head_size=model_config.get_head_size(),
            dtype=kv_dtype, kv_quant_mode=quant_mode)).page_size_bytes


def _layer_spec(kind: str, vllm_config: Any, family: Any, mamba_spec: Any, kv_dtype: Any,
                quant_mode: Any, checkpoint_blocks: int, checkpoint_alignment: int | None
                ) -> Any:
    """The spec the layer's ``get_kv_cache_spec`` returns: ``MLAAttention`` (mla_attention.py),
    ``Attention`` (attention.py), ``MambaBase`` plus the layer's checkpoint fields."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    if kind == MLA:
        return MLAAttentionSpec(
            block_size=cache_config.block_size, num_kv_heads=1, max_tp_shards=1,
            head_size=model_config.get_head_size(), dtype=kv_dtype,
            cache_dtype_str=cache_config.cache_dtype, kv_quant_mode=quant_mode)
    if kind == ATTENTION:
        return FullAttentionSpec(
            block_size=cache_config.block_size, head_size=model_config.get_head_size(),
            num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            dtype=kv_dtype, kv_quant_mode=quant_mode)
    return MambaSpec(
        shapes=mamba_spec.shapes, dtypes=mamba_spec.dtypes,
        block_size=cache_config.mamba_block_size,
        page_size_padded=cache_config.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum[family.mamba_type],
        mamba_cache_mode=cache_config.mamba_cache_mode,
        num_prefill_checkpoint_blocks=checkpoint_blocks,
        prefill_checkpoint_alignment=checkpoint_alignment)


def _vllm_config(source: ModelSource, deployment: Deployment, folder: Path) -> Any:
    """vLLM's own config for the model: ``ModelConfig`` reads the config.json (no weights, no
    tokenizer); ``VllmConfig`` runs the model's config hooks (``MambaModelConfig`` sets
    ``align`` mode when prefix caching is on)."""
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    from huggingface_hub.errors import StrictDataclassError

    (folder / "config.json").write_text(json.dumps(source.config))
    try:
        with _quiet_config_retries():
            model_config = ModelConfig(model=str(folder), skip_tokenizer_init=True)
        if not model_config.is_hybrid:
            raise _not_hybrid(source, "vLLM does not treat it as a hybrid model")
        vllm_config = VllmConfig(
            device_config=DeviceConfig(device="cpu"), model_config=model_config,
            cache_config=CacheConfig(enable_prefix_caching=True, mamba_cache_mode="align",
                                     cache_dtype=deployment.kv_cache_dtype),
            parallel_config=ParallelConfig(tensor_parallel_size=deployment.tensor_parallel_size),
            scheduler_config=SchedulerConfig(
                max_model_len=model_config.max_model_len, is_encoder_decoder=False,
                enable_chunked_prefill=True,
                max_num_batched_tokens=deployment.max_num_batched_tokens))
    except (ValueError, TypeError, AssertionError, StrictDataclassError) as error:
        # pydantic's, vLLM's and the HF config class's validation (a field of the wrong type)
        details = getattr(error, "errors", None)  # a pydantic ValidationError lists them
        reason = ("; ".join(e["msg"] for e in details()) if callable(details)
                  else " ".join(line.strip() for line in str(error).splitlines()[:2])
                  if str(error) else type(error).__name__)
        hint = (MODEL_CLASS_HINT if "failed to be inspected" in reason
                else "Check the config.json and the flags against vLLM's message.")
        raise ConfigError(f"vLLM 0.33 rejects {source.name}: {reason}", hint) from error
    # VllmConfig turns the hybrid KV-cache manager off on a platform without it (this CPU);
    # CUDA has it (CudaPlatform.support_hybrid_kv_cache), so decide as there.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    if vllm_config.cache_config.mamba_cache_mode != "align":
        raise ConfigError(
            f"{source.name}: vLLM runs it in mamba_cache_mode "
            f"{vllm_config.cache_config.mamba_cache_mode!r}, not 'align'",
            "kvtrace's geometry is align mode's (prefix caching of Mamba state); vLLM leaves it "
            "when prefix caching is off for the model (e.g. non-causal or encoder-only).")
    return vllm_config


def _with_defaults(given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``given`` with what it lacks taken from ``defaults``, nested configs alike."""
    merged = {**defaults, **given}
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            merged[key] = _with_defaults(value, defaults[key])
    return merged


@contextlib.contextmanager
def _quiet_config_retries() -> Iterator[None]:
    """vLLM logs each failed parse of a config.json as an error and parses it again after a
    pause: a config that cannot load is reported once, as kvtrace's own error."""
    logger = logging.getLogger("vllm.transformers_utils.repo_utils")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _not_hybrid(source: ModelSource, why: str) -> ConfigError:
    return ConfigError(
        f"{source.name} ({source.architecture}) is not a hybrid attention + Mamba/KDA model: "
        f"{why}",
        "kvtrace geometry computes align-mode hybrid caches; a pure-attention or pure-Mamba "
        "model has no Mamba block to align.")


def _backend_class(name: str) -> Any:
    """The backend class, or (for FLASH_ATTN_MLA, whose module imports FA3 kernels) a class
    that declares what it declares: rule.SM90_KERNEL_BLOCK, checked by the tests against
    the installed source."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        return AttentionBackendEnum[name].get_class()
    except ImportError:
        kernel_block = SM90_KERNEL_BLOCK[name]

        class DeclaredMLABackend(CPUMLABackend):  # MLA head sizes, dtypes and specs
            supported_kv_cache_dtypes = ["auto", "float16", "bfloat16"]

            @staticmethod
            def get_name() -> str:
                return name

            @staticmethod
            def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
                return [MultipleOf(kernel_block)]

            @classmethod
            def supports_block_size(cls, block_size: int | None) -> bool:
                return block_size is None or block_size % kernel_block == 0

        return DeclaredMLABackend


def _model_class(model_config: Any) -> Any:
    try:
        model_cls, _ = model_config.registry.resolve_model_cls(model_config.architectures,
                                                               model_config)
    except (ImportError, ValueError) as error:
        raise ConfigError(
            f"vLLM's model class for {model_config.architecture} does not import here: {error}",
            MODEL_CLASS_HINT) from error
    return model_cls


def _kv_dtype(cache_dtype: str, model_dtype: Any) -> Any:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    return model_dtype if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]


def _memory_split(source: ModelSource, deployment: Deployment, weights: Any) -> MemorySplit:
    total = int(deployment.gpu_memory_gib * GIB)
    usable = int(total * deployment.gpu_memory_utilization)
    weight_bytes = -(-weights.nbytes // deployment.tensor_parallel_size)
    assumed = deployment.non_kv_memory_gib is None
    non_kv = int((DEFAULT_NON_KV_GIB if assumed else deployment.non_kv_memory_gib) * GIB)
    kv_bytes = usable - weight_bytes - non_kv
    if kv_bytes <= 0:
        needed = -(-weights.nbytes // max(usable - non_kv, 1))
        heads = source.text_config.get("num_attention_heads") or needed
        needed = next((tp for tp in range(needed, heads + 1) if heads % tp == 0), needed)
        raise ConfigError(
            f"{source.name}: its weights take {weight_bytes / GIB:.1f} GiB per GPU at tensor "
            f"parallel size {deployment.tensor_parallel_size}, and with "
            f"{non_kv / GIB:.1f} GiB for activations nothing of the {usable / GIB:.1f} GiB "
            "usable is left for the KV cache",
            f"Raise --tensor-parallel-size (at least {needed}) or --gpu-memory-gib.")
    return MemorySplit(gpu_memory_bytes=total,
                       gpu_memory_utilization=deployment.gpu_memory_utilization,
                       weight_bytes=weight_bytes, weight_parameters=weights.parameters,
                       non_kv_bytes=non_kv, non_kv_assumed=assumed, kv_cache_bytes=kv_bytes)
