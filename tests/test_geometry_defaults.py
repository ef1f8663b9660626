"""What the geometry assumes where a config or the host says nothing (kvtrace/geometry/): a
config field left out takes its config class's default, one of the wrong type is one error,
and the GPU is an H200 (its CUDA-reported memory, fp8 flash attention)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_runs import KVTRACE, vllm_imported  # noqa: F401


def model_config(tmp_path: Path, preset: str, **changes) -> Path:
    from kvtrace.geometry.presets import PRESET_DIR

    config = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    config.pop("_source")
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / f"{preset}.config.json"
    path.write_text(json.dumps(config))
    return path


# Hardening round three, R11.
@pytest.mark.slow
@pytest.mark.parametrize("preset, tp, field", [("nemotron-h-8b", 1, "n_groups"),
                                               ("qwen3-next-80b-a3b", 2, "linear_num_value_heads")])
def test_a_config_without_a_defaulted_field_takes_the_config_class_default(
        tmp_path, preset, tp, field):
    """The presets set these fields to their HF config class's defaults: leaving them out
    gives the same geometry (it was a KeyError in weights.py)."""
    from kvtrace.geometry import compute_geometry
    from kvtrace.geometry.bundled import geometry_for

    lacking = compute_geometry(model_config(tmp_path, preset, **{field: None}),
                               tensor_parallel_size=tp, cache_dir=tmp_path / "cache")
    shipped = geometry_for(preset, tp)
    assert (lacking.num_gpu_blocks, lacking.block_size, lacking.memory, lacking.groups) == (
        shipped.num_gpu_blocks, shipped.block_size, shipped.memory, shipped.groups)


# Hardening round three, R11.
@pytest.mark.slow
def test_a_config_field_of_the_wrong_type_is_one_error(tmp_path):
    path = model_config(tmp_path, "qwen3-next-80b-a3b", num_hidden_layers="eight")
    done = subprocess.run([*KVTRACE, "geometry", "--model", str(path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "KVTRACE_GEOMETRY_CACHE": "0"})
    assert done.returncode == 1
    assert "kvtrace: error: vLLM 0.33 rejects" in done.stderr
    assert "'num_hidden_layers' expected int, got str (value: 'eight')" in done.stderr
    assert "Traceback" not in done.stderr and "retrying" not in done.stderr


# Hardening round three, R12.
@pytest.mark.slow
def test_an_fp8_cache_for_flash_attention_is_what_an_h200_builds(tmp_path):
    """FA3 takes fp8 on an H200; this CPU host has no flash-attn, so vLLM's own check refused
    it here. The fp8 page halves the attention bytes, so the block doubles."""
    from kvtrace.geometry import compute_geometry

    auto = compute_geometry("nemotron-h-8b", cache_dir=tmp_path)
    fp8 = compute_geometry("nemotron-h-8b", kv_cache_dtype="fp8", cache_dir=tmp_path)
    assert (fp8.attention_backend, fp8.kv_cache_dtype) == ("FLASH_ATTN", "fp8")
    assert fp8.attention_page_bytes_per_token * 2 == auto.attention_page_bytes_per_token == 4096
    assert (fp8.block_size, auto.block_size) == (2080, 1040)
    assert fp8.mamba_state_bytes == auto.mamba_state_bytes


# Hardening round three, R12.
def test_the_default_gpu_memory_is_what_cuda_reports_for_an_h200():
    """141 GiB made block counts 1-4% high: vLLM plans with CUDA's total (143,156 MiB)."""
    from kvtrace.geometry.compute import H200_GIB, default_gpu_memory_gib

    assert H200_GIB * (1 << 30) == 143_156 << 20
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        assert default_gpu_memory_gib() == H200_GIB  # no GPU here: an H200's
        return
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        assert default_gpu_memory_gib() == (info.total - info.reserved) / (1 << 30)
    finally:
        pynvml.nvmlShutdown()


# Hardening round three, R12.
def test_the_shipped_geometries_plan_with_an_h200s_memory():
    from kvtrace.geometry.bundled import PRESET_TENSOR_PARALLEL, geometry_for

    for preset in PRESET_TENSOR_PARALLEL:
        assert geometry_for(preset).memory.gpu_memory_bytes == 143_156 << 20, preset
