"""The project venv carries the real vLLM 0.33.0 the replay backend and capture are built on."""

import importlib.metadata


def test_vllm_kv_cache_manager_imports():
    import vllm.v1.core.kv_cache_manager as kv_cache_manager

    assert importlib.metadata.version("vllm") == "0.33.0"
    assert hasattr(kv_cache_manager, "KVCacheManager")


def test_torch_is_the_pinned_cpu_build():
    import torch

    assert torch.__version__ == "2.13.0+cpu"
