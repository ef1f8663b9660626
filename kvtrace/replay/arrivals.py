"""The requests a replay schedules, as a workload or capture gives them (``Arrival``,
``arrivals_of``), and those a run starts holding (``InFlight``, a capture's start snapshot).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import msgspec

from kvtrace.events import HashesExtended, Record, RequestArrived
from kvtrace.traceio import RecordBatch


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a workload: what ``RequestArrived`` (+ ``HashesExtended``) say.
    ``arrivals_of`` gives the hash ids as ``array('q')``: 8 bytes an id, for whole traces."""

    req: int
    prompt_len: int
    hash_ids: Sequence[int]
    max_tokens: int
    arrival_ns: int = 0
    output_hash_ids: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class InFlight:
    """A request the scheduler already holds when the run starts (a capture's start snapshot):
    running (holding blocks) or waiting, with its progress. ``spec.max_tokens`` is how many
    outputs it has in all when it finishes."""

    spec: Arrival
    running: bool
    num_computed_tokens: int
    num_tokens: int
    shared_prefix_boundary: int
    # Async scheduling: what the step in flight at the snapshot still does to the request.
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0


def arrivals_of(source: Iterable[Record | RecordBatch], in_flight: Collection[int] = (),
                in_flight_outputs: dict[int, array] | None = None) -> list[Arrival]:
    """The requests of a workload or captured trace, in arrival order.

    A ``HashesExtended`` names the output units decode will complete (a later turn's prompt
    can share them); a captured trace may extend a request many times: the extensions add up.
    Those of the requests in ``in_flight`` (a start snapshot's, which never arrive) go to
    ``in_flight_outputs``. Batches (``TraceReader.batches()``) are read from their columns,
    never as records: what stays in memory is the arrivals alone."""
    arrivals: dict[int, Arrival] = {}
    outputs: dict[int, array] = {}
    for kind, req, *fields in _arrival_rows(source):
        if kind is RequestArrived:
            if req in arrivals:
                continue  # a captured trace re-reports a resumed request; the first is the arrival
            prompt_len, hash_ids, max_tokens, arrival_ns = fields[:4]
            arrivals[req] = Arrival(req, prompt_len, array("q", hash_ids), max_tokens, arrival_ns)
        elif req in arrivals:
            outputs.setdefault(req, array("q")).extend(array("q", fields[0]))
        elif in_flight_outputs is not None and req in in_flight:
            in_flight_outputs.setdefault(req, array("q")).extend(array("q", fields[0]))
    requests = [dataclasses.replace(a, output_hash_ids=outputs[a.req]) if a.req in outputs
                else a for a in arrivals.values()]
    requests.sort(key=lambda r: r.arrival_ns)  # stable: file order breaks ties
    return requests


def _arrival_rows(source: Iterable[Record | RecordBatch]) -> Iterator[tuple]:
    """``(type, *fields)`` of the arrivals and extensions among records or batches."""
    wanted = (RequestArrived, HashesExtended)
    for item in source:
        if isinstance(item, RecordBatch):
            yield from item.field_rows(wanted)
        elif type(item) in wanted:
            yield (type(item), *msgspec.structs.astuple(item))
