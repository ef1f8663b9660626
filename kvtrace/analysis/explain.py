"""Why a request's lookups missed, in plain sentences: what ``kvtrace why`` prints for the
lookups an attribution pass found, and what ``kvtrace report`` renders for a request from the
database (``lookups_from_causes``: the ``request_causes`` query's rows)."""

from __future__ import annotations

from kvtrace.analysis.causes import DESCRIPTIONS, SHORTFALL_CAUSES
from kvtrace.analysis.database import run_labels
from kvtrace.analysis.diagnosis import mechanism_of
from kvtrace.analysis.lookups import NO_REQ, LookupAttribution, LostKey, Removal, Segment
from kvtrace.analysis.queries import Result
from kvtrace.events import RemoveReason, TraceHeader, enum_label


def lookups_from_causes(causes: Result) -> list[LookupAttribution]:
    """The lookups of one request from its ``request_causes`` rows: each range with its
    decisive key and the removal that took it."""
    lookups: dict[int, LookupAttribution] = {}
    for row in map(lambda r: dict(zip(causes.columns, r)), causes.rows):
        lookup = lookups.get(row["lookup"])
        if lookup is None:
            lookup = lookups[row["lookup"]] = LookupAttribution(
                req=row["req"], lookup=row["lookup"], seq=row["seq"], step=row["step"],
                query_tokens=row["query_tokens"], ideal_tokens=row["ideal_tokens"],
                hit_tokens=row["hit_tokens"],
                shared_prefix_boundary=row["shared_prefix_boundary"],
                attention_hit=row["attention_hit_tokens"], mamba_hit=row["mamba_hit_tokens"])
        keys = ()
        if row["key_group"] is not None:
            removal = None
            if row["removal_reason"] is not None:
                removal = Removal(RemoveReason[row["removal_reason"]], row["removed_seq"],
                                  row["removed_step"], row["removed_block_id"],
                                  NO_REQ if row["removed_by_req"] is None
                                  else row["removed_by_req"], row["transient_behind"] or 0)
            keys = (LostKey(row["key_group"], row["key_depth_tokens"], row["key_hash_id"],
                            removal),)
        lookup.segments.append(Segment(row["cause"], row["from_tokens"], row["to_tokens"], keys))
    return sorted(lookups.values(), key=lambda lookup: lookup.lookup)


def describe(path: str, header: TraceHeader, lookups: list[LookupAttribution], *,
             incomplete: bool = False) -> str:
    """Every lookup of one trace's request, as text; ``incomplete``: the trace was truncated or
    dropped events."""
    config = header.config
    variant, backend, _ = run_labels(header)
    groups = ", ".join(f"{_kind(g.kind)} {g.block_size}" for g in config.kv_cache_groups)
    lines = [f"{path}: variant {variant}, backend {backend}; hash unit "
             f"{config.hash_block_size}, block sizes: {groups}"]
    if incomplete:
        lines.append("  (the trace is incomplete - truncated, or events were dropped - so the "
                     "causes below are approximate)")
    lines.append(f"request {lookups[0].req}: {len(lookups)} admitted lookup"
                 f"{'s' if len(lookups) != 1 else ''}")
    for lookup in lookups:
        lines += _describe_lookup(lookup, config)
    return "\n".join(lines) + "\n"


def _describe_lookup(lookup: LookupAttribution, config) -> list[str]:
    kind = "first admission" if lookup.lookup == 1 else f"resumption {lookup.lookup - 1}"
    if lookup.in_flight:
        kind += ", in flight when the capture began"
    query = "prompt" if lookup.lookup == 1 else "tokens so far"
    lines = [f"lookup {lookup.lookup} ({kind}) at step {lookup.step}: "
             f"{lookup.query_tokens:,} {query} tokens",
             f"  hit {lookup.hit_tokens:,} tokens; ideal {lookup.ideal_tokens:,} (what an "
             f"unbounded cache under the same schedule would have hit)"]
    per_group = []
    if lookup.attention_hit is not None:
        per_group.append(f"full attention alone {lookup.attention_hit:,}")
    if lookup.mamba_hit is not None:
        per_group.append(f"Mamba alone {lookup.mamba_hit:,} (its deepest state below the last "
                         "token)")
    if per_group:
        lines.append(f"  per group (ideal {lookup.ideal_tokens:,} in each): "
                     + "; ".join(per_group))
    if lookup.shared_prefix_boundary:
        lines.append(f"  shared-prefix junction: {lookup.shared_prefix_boundary:,} tokens")
    shortfall = sorted((s for s in lookup.segments if s.cause in SHORTFALL_CAUSES),
                       key=lambda s: s.start)
    beyond = [s for s in lookup.segments if s.cause not in SHORTFALL_CAUSES]
    for title, segments in ((f"missed {lookup.shortfall:,} tokens of the ideal", shortfall),
                            ("beyond the ideal", beyond)):
        if segments:
            lines.append(f"  {title}:")
        for segment in segments:
            lines.append(f"    tokens {segment.start:,}-{segment.end:,} ({segment.tokens:,}"
                         f"{_blocks(segment, config)}): {segment.cause} - "
                         f"{DESCRIPTIONS[segment.cause]}{_mechanism(lookup, segment.cause)}.")
            lines += [f"      {_describe_key(key, config)}" for key in segment.keys]
    return lines


def _mechanism(lookup: LookupAttribution, cause: str) -> str:
    """The finding ``kvtrace doctor`` files these tokens under, as a suffix."""
    mechanism = mechanism_of(cause, lookup.lookup > 1)
    return f" [doctor: {mechanism}]" if mechanism else ""


def _blocks(segment, config) -> str:
    attention = [g for g in config.kv_cache_groups if g.kind != "mamba"]
    if not attention:
        return ""
    size = attention[0].block_size
    first, last = segment.start // size, (segment.end - 1) // size
    return f"; block {first}" if first == last else f"; blocks {first}-{last}"


def _describe_key(key: LostKey, config) -> str:
    group = config.kv_cache_groups[key.group]
    what = (f"{_kind(group.kind)} {'state' if group.kind == 'mamba' else 'key'} at "
            f"{key.depth_tokens:,} tokens (group {key.group}, hash {key.hash_id})")
    removal = key.removal
    if removal is None:
        return f"{what}: never stored before this lookup."
    if removal.reason != RemoveReason.LRU_REUSE:
        return (f"{what}: removed ({enum_label(RemoveReason, removal.reason)}) from block "
                f"{removal.block_id} at step {removal.step} (seq {removal.seq}).")
    by = f" to make room for request {removal.by_req}" if removal.by_req >= 0 else ""
    sentence = (f"{what}: evicted from block {removal.block_id} at step {removal.step} "
                f"(seq {removal.seq}){by}")
    if not removal.transient_behind:
        return sentence + "; no transient checkpoint sat cached behind it."
    examples = ", ".join(f"request {req}'s at {position:,} tokens (block {block})"
                         for req, position, block in removal.behind)
    count = removal.transient_behind
    return (f"{sentence}, while {count} transient checkpoint{'s' if count != 1 else ''} sat "
            f"cached in the free queue behind it" + (f", e.g. {examples}" if examples else "")
            + ".")


def _kind(kind: str) -> str:
    return "Mamba" if kind == "mamba" else kind.replace("_", " ")
