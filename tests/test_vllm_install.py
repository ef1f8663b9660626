"""The project venv carries the real vLLM the replay backend and capture are built on: the
releases table's last row."""

import importlib.metadata

from kvtrace.vllm_release_table import PROJECT_RELEASE


def test_vllm_kv_cache_manager_imports():
    import vllm.v1.core.kv_cache_manager as kv_cache_manager

    assert importlib.metadata.version("vllm") == PROJECT_RELEASE.version
    assert hasattr(kv_cache_manager, "KVCacheManager")


def test_torch_is_the_pinned_cpu_build():
    import torch

    assert torch.__version__ == "2.13.0+cpu"
