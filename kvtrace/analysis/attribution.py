"""Miss attribution of a whole trace (``attribute_trace``: what ``kvtrace why`` and ``kvtrace
replay``'s summary read), in one streaming pass (``kvtrace.analysis.stream``: the C core where it
is built, else the attributor's Python reference, ``kvtrace.analysis.attributor``).

The parts live by job: the causes (``causes``), what a lookup's attribution holds (``lookups``),
vLLM's hit search (``hit_search``), the attributor (``attributor``), the miss_attribution
table (``miss_table``), and the totals and the reports' warning (``miss_summary``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections.abc import Iterator

from kvtrace.analysis.lookups import TraceAttribution
from kvtrace.analysis.stream import new_pass
from kvtrace.traceio import TraceReader


def attribute_trace(path: str | os.PathLike, *, request: int | str | None = None,
                    explain: bool = False) -> TraceAttribution:
    """Attribute every admitted lookup of the trace at ``path`` (one streaming pass: the C core
    where it is built, else ``MissAttributor``)."""
    reader = TraceReader(os.fspath(path))
    with reader, cyclic_gc_paused():
        attribution = new_pass(reader.header, reader.path, request=request, explain=explain,
                               keep_lookups=True, make_rows=False,
                               spill_dir=tempfile.gettempdir())
        for batch in reader.batches():
            attribution.feed(batch)
        attribution.finish()
    return TraceAttribution(reader.path, reader.header, attribution.lookups, reader.truncated,
                            attribution.dropped_events)


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """For an attribution pass: it keeps millions of small tuples until it ends, none in a
    cycle, and Python's cyclic collector would scan them again and again (about 40% of a
    10-million-record pass)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
