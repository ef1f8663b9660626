"""Probes: wrappers around the real vLLM 0.33 cache methods that turn each call into trace records.

Shared by live capture (inside a production engine) and the real-vLLM replay backend, so this
package imports no click, DuckDB, torch, replay or analysis code, and vLLM only inside functions.
"""

from kvtrace.probes.cache_probes import CacheProbes, ProbeSignatureError, probe_targets

__all__ = ["CacheProbes", "ProbeSignatureError", "probe_targets"]
