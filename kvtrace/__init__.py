"""kvtrace: trace capture and offline replay for forensics of vLLM's prefix (KV) cache."""

__version__ = "0.1.0"
