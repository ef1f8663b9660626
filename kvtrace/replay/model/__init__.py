"""kvtrace's own model of vLLM 0.33's hybrid prefix cache: the ``model`` replay backend."""

from kvtrace.replay.model.backend import ModelBackend

__all__ = ["ModelBackend"]
