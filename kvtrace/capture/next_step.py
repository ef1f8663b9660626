"""Running something on vLLM's scheduler thread between two engine steps, where nothing else
changes the cache: a capture's start snapshot, a ring's keyframes."""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable


class NextStep:
    """Runs ``begin(manager, scheduler)`` on vLLM's scheduler thread at the start of the next
    step (``KVCacheManager.new_step_starts``, first thing in ``Scheduler.schedule``), then the
    step as usual (through whatever ``begin`` patched). Until then, ``new_step_starts`` is a
    trigger that restores the original first, so ``begin`` finds vLLM's own method; ``cancel``
    restores it if the step never came. A pool with a probe set of its own (a replay backend in
    the same process) does not trigger. ``begin`` must not raise: the engine is running."""

    def __init__(self, begin: Callable[[Any, Any], None]) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        from kvtrace.probes.probe_state import PROBE_ATTR

        self._owner = KVCacheManager
        self._original = KVCacheManager.__dict__["new_step_starts"]
        # Reentrant: ``begin`` runs under it and may stop the capture, which cancels.
        self._lock = threading.RLock()
        original, lock, restore = self._original, self._lock, self._restore

        def new_step_starts(self):  # vLLM's own parameters, as every wrapper keeps
            if PROBE_ATTR in self.block_pool.__dict__:
                return original(self)
            with lock:
                if restore():  # the first step to come: begin, once
                    begin(self, _scheduler_of(self))
            return self.new_step_starts()

        self._trigger = new_step_starts
        KVCacheManager.new_step_starts = new_step_starts

    def _restore(self) -> bool:
        """Put vLLM's method back; whether the trigger was still installed."""
        if self._owner.__dict__.get("new_step_starts") is not self._trigger:
            return False
        setattr(self._owner, "new_step_starts", self._original)
        return True

    def pending(self) -> bool:
        """Whether the trigger still waits for its step."""
        return self._owner.__dict__.get("new_step_starts") is self._trigger

    def cancel(self) -> bool:
        """Take the trigger back if no step has come yet (waiting for one that runs)."""
        with self._lock:
            return self._restore()


def _scheduler_of(manager: Any) -> Any:
    """The vLLM scheduler calling ``manager`` on this thread: the caller's frame holds it."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not manager and getattr(candidate, "kv_cache_manager", None) is manager:
            return candidate
        frame = frame.f_back
    return None
