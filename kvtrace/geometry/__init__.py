"""``kvtrace geometry``: the KV-cache geometry vLLM 0.33 builds for a real hybrid model.

Its own stage: it imports no replay, capture, analysis or engine code, and vLLM only inside
functions. Other stages take a ``Geometry`` and its ``engine_groups()`` / ``hash_block_size``.
"""

from kvtrace.geometry.compute import DEFAULT_NON_KV_GIB, H200_GIB, compute_geometry
from kvtrace.geometry.presets import ModelSource, preset_names, resolve_model
from kvtrace.geometry.result import Geometry, GeometryGroup, MemorySplit

__all__ = ["DEFAULT_NON_KV_GIB", "H200_GIB", "Geometry", "GeometryGroup", "MemorySplit",
           "ModelSource", "compute_geometry", "preset_names", "resolve_model"]
