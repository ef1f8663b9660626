"""Token totals over attributed lookups, and what the reports say of them: the warning when
prefix caching looks like it does nothing although it could (``silent_zero_warning``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtrace.analysis.causes import CAUSE_MECHANISMS, DESCRIPTIONS
from kvtrace.analysis.lookups import LookupAttribution


@dataclass
class CauseTotals:
    """Token totals over a set of lookups (one run's first admissions, say)."""

    lookups: int = 0
    query_tokens: int = 0
    ideal_tokens: int = 0
    hit_tokens: int = 0
    tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, lookups: Iterable[LookupAttribution]) -> CauseTotals:
        totals = cls()
        for lookup in lookups:
            totals.lookups += 1
            totals.query_tokens += lookup.query_tokens
            totals.ideal_tokens += lookup.ideal_tokens
            totals.hit_tokens += lookup.hit_tokens
            for segment in lookup.segments:
                totals.tokens[segment.cause] = totals.tokens.get(segment.cause, 0) + segment.tokens
        return totals


NEAR_ZERO_HIT_RATE = 0.01  # a hit rate below this reads as "prefix caching does nothing"
IDEAL_WORTH_HITTING = 0.05  # ...which is silent when an unbounded cache would have hit this much
STRUCTURAL_SHARE = 0.5  # ...or when this share of the missed tokens could never have hit


def silent_zero_warning(label: str, totals: CauseTotals, unit: int) -> str | None:
    """A warning when ``totals``' hit rate is near zero although the ideal is not, or although
    most missed tokens were lost to something other than cold units; it names the dominant
    cause (``unit``: the hash unit, for the sentence)."""
    if not totals.query_tokens or totals.hit_tokens >= NEAR_ZERO_HIT_RATE * totals.query_tokens:
        return None
    missed = totals.query_tokens - totals.hit_tokens
    causes = {c: t for c, t in totals.tokens.items() if c != "cold" and t > 0}
    if not causes:
        return None
    ideal_rate = totals.ideal_tokens / totals.query_tokens
    cause, tokens = max(causes.items(), key=lambda item: item[1])
    if ideal_rate < IDEAL_WORTH_HITTING and sum(causes.values()) < STRUCTURAL_SHARE * missed:
        return None
    mechanism = CAUSE_MECHANISMS.get(cause)
    return (f"{label}: prefix-cache hit rate {totals.hit_tokens / totals.query_tokens:.1%} "
            f"(an unbounded cache: {ideal_rate:.1%}); {_cause_phrase(cause, unit)}: "
            f"{tokens / missed:.0%} of the missed tokens"
            + (f" (kvtrace doctor's {mechanism})" if mechanism else ""))


def _cause_phrase(cause: str, unit: int) -> str:
    if cause == "short_prompt":
        return f"prompts shorter than the {unit:,}-token hash unit (the block, by default)"
    if cause == "hit_cap":
        return ("the last token is always recomputed (a prompt of exactly one "
                f"{unit:,}-token unit never hits)")
    return f"{cause.replace('_', ' ')} ({DESCRIPTIONS[cause]})"

