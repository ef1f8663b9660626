"""Probes: wrappers around the real vLLM 0.33 cache methods that turn each call into trace records.

Shared by live capture (inside a production engine) and the real-vLLM replay backend, so this
package imports no click, DuckDB, torch, replay or analysis code, and vLLM only inside functions.
Three modules: ``signatures`` (the vLLM methods and parameters the probes are written against),
``wrappers`` (what replaces those methods, and the process-wide patch table) and
``cache_probes`` (``CacheProbes``, the probe state the wrappers report into).
"""

from kvtrace.probes.cache_probes import CacheProbes
from kvtrace.probes.signatures import ProbeSignatureError, probe_targets

__all__ = ["CacheProbes", "ProbeSignatureError", "probe_targets"]
