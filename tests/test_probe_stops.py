"""The engine's own stop inside a native probe (``csrc/probes.c``) reaches the engine.

vLLM's SIGTERM handler raises SystemExit and Ctrl-C raises KeyboardInterrupt wherever Python
code runs, and a probe runs some (the sink, its own report methods, a request's attributes). The
native fast paths cleared those as their own failures, so the engine would not stop when told;
an ordinary exception there is still ours: counted and swallowed.
"""

from __future__ import annotations

import pytest
from vllm_support import prefill_chunks, seed_config, vllm_backend_class  # noqa: F401

from kvtrace import native
from kvtrace.events import HashInterner
from kvtrace.probes import wrappers

pytestmark = pytest.mark.skipif(native.core is None, reason="the native core is off here")

STOPS = [KeyboardInterrupt, SystemExit]


class Once:
    """Raises ``error`` the first time it is called while set, then does nothing."""

    def __init__(self):
        self.error = None

    def __call__(self, *args):
        error, self.error = self.error, None
        if error is not None:
            raise error


def decode_steps(backend, req: int, num_steps: int) -> None:
    """Decode steps of one token (no hash unit completed), as the engine makes them (no step
    announced): new_step_starts' and allocate_slots' native fast paths."""
    for _ in range(num_steps):
        backend.manager.new_step_starts()
        backend.allocate_slots(req, 1)
        backend.advance(req, 1)


def in_stop_site(site: str, raise_once: Once, probes, monkeypatch) -> None:
    """Make the probe's Python code at `site` call `raise_once`."""
    if site == "sink":  # flush hands the call's records to sink_many
        probes.sink_many = raise_once
    elif site == "flush":  # without sink_many, flush calls the probe set's _flush
        probes.sink_many = None
        probes.sink = raise_once
    else:  # a request attribute read before the call (the `slow:` paths)
        from vllm.v1.request import Request

        def token_ids(request):
            raise_once()
            return request.__dict__["_all_token_ids"]

        def set_token_ids(request, value):
            request.__dict__["_all_token_ids"] = value

        monkeypatch.setattr(Request, "_all_token_ids", property(token_ids, set_token_ids),
                            raising=False)


SITES = ["sink", "flush", "request"]


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("stop", STOPS)
def test_a_stop_in_a_native_probe_reaches_the_engine(vllm_backend_class, monkeypatch, site,
                                                     stop):
    """The stop propagates out of the cache call; the probe set is left as between calls and
    goes on recording; nothing was counted as our failure."""
    from kvtrace.probes import CacheProbes

    raise_once = Once()
    records = []
    with vllm_backend_class(seed_config(0), "fixed", None) as backend:
        probes = CacheProbes(print, HashInterner(), sink_many=records.extend)
        probes.arm()
        try:
            backend.add_request(1, 240, list(range(15)), 64)
            prefill_chunks(backend, 1, [128, 112])
            in_stop_site(site, raise_once, probes, monkeypatch)
            between_calls = (probes._req, probes._request, probes._held)
            assert between_calls[:2] == (wrappers._NO_REQ, None)
            raise_once.error = stop(15)
            with pytest.raises(stop):
                decode_steps(backend, 1, 1)
            assert raise_once.error is None
            assert (probes._req, probes._request, probes._held) == between_calls
            assert probes.num_failures == 0
            decode_steps(backend, 1, 3)  # the capture goes on
        finally:
            probes.disarm()
    assert probes.num_failures == 0


@pytest.mark.parametrize("site", SITES)
def test_an_ordinary_error_in_a_native_probe_is_counted_and_swallowed(vllm_backend_class,
                                                                      monkeypatch, site):
    from kvtrace.probes import CacheProbes

    raise_once = Once()
    with vllm_backend_class(seed_config(0), "fixed", None) as backend:
        probes = CacheProbes(print, HashInterner(), sink_many=list)
        probes.arm()
        try:
            backend.add_request(1, 240, list(range(15)), 64)
            prefill_chunks(backend, 1, [128, 112])
            in_stop_site(site, raise_once, probes, monkeypatch)
            raise_once.error = RuntimeError("ours")
            decode_steps(backend, 1, 2)
            assert raise_once.error is None
        finally:
            probes.disarm()
    # A request attribute that failed sends the call to the Python wrapper, which reads it
    # again: nothing lost, nothing counted.
    assert probes.num_failures == (0 if site == "request" else 1)
