"""The miss_attribution table: its columns (``ROW_COLUMNS``, the DuckDB schema), the columns the
streaming pass hands over for it (``ATTRIBUTION_COLUMNS``), and its rows made from attributed
lookups. Every row is built by column name, so no order has to match another."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator

import numpy as np

from kvtrace.analysis.causes import CAUSES, SHORTFALL_CAUSES
from kvtrace.analysis.lookups import NO_REQ, LookupAttribution, Segment

ATTRIBUTION_TABLE = "miss_attribution"
NONE = np.iinfo(np.int64).min  # NULL in a column the pass hands over

ROW_COLUMNS = (
    ("run", "INTEGER"), ("variant", "VARCHAR"), ("backend", "VARCHAR"), ("req", "BIGINT"),
    ("lookup", "INTEGER"), ("resumed", "BOOLEAN"), ("seq", "BIGINT"), ("step", "BIGINT"),
    ("query_tokens", "BIGINT"), ("ideal_tokens", "BIGINT"), ("hit_tokens", "BIGINT"),
    ("attention_hit_tokens", "BIGINT"), ("mamba_hit_tokens", "BIGINT"),
    ("cause", f"ENUM({', '.join(map(repr, CAUSES))})"),
    ("in_shortfall", "BOOLEAN"), ("tokens", "BIGINT"), ("from_tokens", "BIGINT"),
    ("to_tokens", "BIGINT"), ("key_group", "INTEGER"), ("key_depth_tokens", "BIGINT"),
    ("key_hash_id", "BIGINT"), ("removed_block_id", "BIGINT"), ("removed_seq", "BIGINT"),
    ("removed_step", "BIGINT"), ("removed_by_req", "BIGINT"), ("transient_behind", "BIGINT"),
    ("in_flight", "BOOLEAN"),
)
_RUN_LABELS = ("run", "variant", "backend")
_DERIVED = ("resumed", "in_shortfall")  # SQL derives them from lookup and cause
# The columns the streaming pass hands over (its C core finds each by name): the table's, but
# the run's labels and the derived ones. The cause comes as its index in CAUSES.
ATTRIBUTION_COLUMNS = tuple(name for name, _ in ROW_COLUMNS
                            if name not in _RUN_LABELS + _DERIVED)

_SHORTFALL = frozenset(SHORTFALL_CAUSES)
_CAUSE_INDEX = {cause: index for index, cause in enumerate(CAUSES)}
_IN_ROW_ORDER = operator.itemgetter(*(name for name, _ in ROW_COLUMNS))
_IN_PASS_ORDER = operator.itemgetter(*ATTRIBUTION_COLUMNS)


def _values(lookup: LookupAttribution, segment: Segment) -> dict[str, object]:
    """A row's values by column name, but the run's labels."""
    key = segment.keys[0] if segment.keys else None
    removal = key.removal if key else None
    return {
        "req": lookup.req, "lookup": lookup.lookup, "resumed": lookup.lookup > 1,
        "seq": lookup.seq, "step": lookup.step, "query_tokens": lookup.query_tokens,
        "ideal_tokens": lookup.ideal_tokens, "hit_tokens": lookup.hit_tokens,
        "attention_hit_tokens": lookup.attention_hit, "mamba_hit_tokens": lookup.mamba_hit,
        "cause": segment.cause, "in_shortfall": segment.cause in _SHORTFALL,
        "tokens": segment.tokens, "from_tokens": segment.start, "to_tokens": segment.end,
        "key_group": key.group if key else None,
        "key_depth_tokens": key.depth_tokens if key else None,
        "key_hash_id": key.hash_id if key else None,
        "removed_block_id": removal.block_id if removal else None,
        "removed_seq": removal.seq if removal else None,
        "removed_step": removal.step if removal else None,
        "removed_by_req": removal.by_req if removal and removal.by_req != NO_REQ else None,
        "transient_behind": removal.transient_behind if removal else None,
        "in_flight": lookup.in_flight,
    }


def iter_rows(run: int, variant: str, backend: str,
              lookups: Iterable[LookupAttribution]) -> Iterator[tuple]:
    """One row per lookup and cause, in ``ROW_COLUMNS`` order (the DuckDB table)."""
    labels = {"run": run, "variant": variant, "backend": backend}
    for lookup in lookups:
        for segment in lookup.segments:
            yield _IN_ROW_ORDER({**labels, **_values(lookup, segment)})


def lookup_columns(lookups: Iterable[LookupAttribution]) -> dict[str, np.ndarray]:
    """Lookups as the pass hands their rows over (``ATTRIBUTION_COLUMNS``: int64 columns, the
    cause by its index in CAUSES, NULL as ``NONE``): what the attributor's Python reference
    gives where the C core would."""
    rows = []
    for lookup in lookups:
        for segment in lookup.segments:
            values = _values(lookup, segment)
            values["cause"] = _CAUSE_INDEX[segment.cause]
            rows.append([NONE if value is None else int(value)
                         for value in _IN_PASS_ORDER(values)])
    data = np.array(rows, dtype=np.int64).reshape(len(rows), len(ATTRIBUTION_COLUMNS))
    return {name: data[:, index].copy() for index, name in enumerate(ATTRIBUTION_COLUMNS)}
