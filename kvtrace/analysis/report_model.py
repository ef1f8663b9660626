"""What a report holds, as data: the sections the collection fills in (``report_collect``) and
every renderer reads (``report_text``, ``report_html``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvtrace.analysis.pricing import Pricing
from kvtrace.analysis.queries import Result

TOP_ROWS = 10  # rows of a table the text and Markdown reports show, and the HTML page plots


@dataclass(frozen=True)
class Labels:
    """Short names for runs and sources, instead of digests and paths."""

    runs: dict[int, str]  # run -> "1 unfixed"
    sources: dict[str, str]  # source_key -> "workload.kvtrace"

    @classmethod
    def of(cls, runs: Result) -> Labels:
        rows = [dict(zip(runs.columns, row)) for row in runs.rows]
        names: dict[str, str] = {}
        for row in rows:
            names.setdefault(row["source_key"], os.path.basename(row["source_path"] or row["path"]))
        taken = list(names.values())
        sources = {key: name if taken.count(name) == 1 else f"{name} ({_short_digest(key)})"
                   for key, name in names.items()}
        return cls({row["run"]: f"{row['run']} {row['variant']}" for row in rows}, sources)

    def source(self, key: str) -> str:
        return self.sources.get(key, _short_digest(key))


def _short_digest(key: str) -> str:
    digest = key.removeprefix("sha256:")
    return digest[:12] if digest != key else os.path.basename(key)


@dataclass
class Table:
    """A section of the report: a titled result, what it means, and the command behind it."""

    key: str
    title: str
    result: Result
    note: str
    command: str


@dataclass
class Verdict:
    """One pair of variants: the ``variant_verdict`` row, the top pushed-out prefixes of the
    moved-from run, and the sentence."""

    row: dict
    source: str
    prefixes: list[dict]
    advice: str


@dataclass
class ReportData:
    db: str
    labels: Labels
    pricing: Pricing
    verdicts: list[Verdict]
    verdict_command: str
    priced_as: str
    cost_models: list[str | None]  # the models the figures were priced as (``priced_as``)
    warnings: list[str]
    tables: list[Table]
    timeline: Result
    occupancy: Result
    pushout_evictions: Result
    pushout_lookups: Result
    sweep: Result
    break_even: Result
    hits_went: Result
    explanations: dict[tuple[int, int], str] = field(default_factory=dict)
    diagnoses: list = field(default_factory=list)  # kvtrace doctor's, without predictions
    fleet: Fleet | None = None  # with runs of two engines or more
    counters: list[str] = field(default_factory=list)  # vLLM's recorded counters, reconciled

    def table(self, key: str) -> Table:
        return next(table for table in self.tables if table.key == key)


@dataclass
class FleetFix:
    """One pair of variants replayed on engines of the fleet: their ``variant_verdict`` rows
    summed (rates per hour add up: the engines serve side by side), and its sentence."""

    row: dict
    engines: list[str]
    advice: str


@dataclass
class Fleet:
    """The fleet's engines (``fleet``: one row each, with its top finding and what each fix is
    worth on it), what each fix is worth summed over them, and the finding that costs the
    fleet most."""

    table: Table
    engines: list[dict]
    fixes: list[FleetFix]
    finding: tuple[str, int, list[str]] | None  # id, tokens over the fleet, engines it tops
