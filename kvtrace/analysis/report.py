"""``kvtrace report``: a verdict first - per pair of variants, what moving from one to the other
does to hits, prefill and GPU time on this traffic, and what to do - then the forensics behind
it, for a terminal, as Markdown for an incident ticket, or as one self-contained HTML page
(``report_html``).

Every figure comes from a shipped query, and the report names the query and the parameters it
ran with, so ``kvtrace sql DB --query NAME --param ...`` reproduces it; the one other read is
the ``runs`` table, for short labels. Recomputed tokens are priced with the model each replay
names in its header (``kvtrace replay`` writes its figures), or ``--model`` for runs that name
none, on ``--gpu``. Warnings come before the tables: a run whose hit rate is near zero although
it need not be (a *silent zero*, ``attribution.silent_zero_warning``), named by its dominant
cause: the data behind the verdict is suspect then.

A database is input: every string it holds (variants, file names, models, anything a query
returns) is written through the format's escaping, ``text_value`` or ``markdown_value``, so that
it can neither drive a terminal nor start a line, a heading, a table cell, a link or HTML.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtrace.analysis.attribution import CAUSES, CauseTotals, silent_zero_warning
from kvtrace.analysis.queries import Result, execute, run_query, sql_command
from kvtrace.analysis.render import cell, format_markdown, format_table
from kvtrace.analysis.vllm_counters import QUERY as COUNTERS_QUERY
from kvtrace.analysis.vllm_counters import reconciliation_lines
from kvtrace.geometry.cost import DEFAULT_GPU, CostModel, GpuThroughput, gpu_throughput

TOP_ROWS = 10
TOP_VERDICT_PREFIXES = 3
DRILL_DOWN_PREFIXES = 10  # pushed-out prefixes given a drill-down in the HTML report
DRILL_DOWN_LOOKUPS = 5  # lookups per prefix whose `kvtrace why` is rendered
TEXT_CELL_WIDTH = 24  # a long cell would otherwise take a terminal's width
OCCUPANCY_CATEGORIES = ("running", "hot_prefix", "transient_checkpoint", "other_cached", "free")
MAX_OCCUPANCY_PLOTS = 4
# Below this share of the prefill the moved-from variant recomputes, a pair's difference is
# noise for a verdict.
MATERIAL_SHARE = 0.005
# What each variant stands for, for the verdict's sentence (docs/commands/replay.md#variants).
VARIANT_ROLES = {"unfixed": "before #56794", "naive": "#56794's gate without stripping stale keys",
                 "fixed": "#56794 as merged", "upstream": "vLLM 0.33.0's own checkpoint logic"}
GATED = ("fixed", "upstream")  # the variants that carry the #56794 gate, for the sentence
PRICED_BY_PARAMETERS = "(parameters)"  # cost_model of the runs the flops parameters priced


@dataclass(frozen=True)
class Pricing:
    """What prices recomputed tokens: the GPU, and ``model`` for the runs whose header names
    none (a capture replayed without --model)."""

    gpu: GpuThroughput
    model: CostModel | None = None

    def params(self) -> dict[str, str]:
        """The pricing parameters of recompute_gpu_seconds and variant_verdict."""
        values = {"gpu_flops_per_s": f"{self.gpu.flops_per_s:.17g}"}
        if self.model is not None:
            values["flops_per_token"] = str(self.model.flops.constant)
            values["flops_per_position"] = str(self.model.flops.per_position)
        return values

    def name_given_model(self, result: Result) -> Result:
        """``result`` with the cost_model of the runs the flops parameters priced named: the
        --model that set them."""
        if self.model is None or "cost_model" not in result.columns:
            return result
        index = result.columns.index("cost_model")
        label = f"{self.model.model.name} (--model)"
        return Result(result.columns, [
            row[:index] + (label if row[index] == PRICED_BY_PARAMETERS else row[index],)
            + row[index + 1:] for row in result.rows])

    def describe(self, models: Iterable[str | None]) -> str:
        """Which model and GPU priced the figures, in one sentence."""
        named = sorted({m for m in models if m and not m.endswith("(--model)")})
        parts = []
        if named:
            parts.append(f"{', '.join(named)} (the replays' own figures)")
        if self.model is not None:
            parts.append(f"{self.model.model.name} at TP {self.model.tensor_parallel_size} "
                         "(--model, for runs that name no model)")
        if not parts:
            return ("Not priced: no run names its model. Replay with --model NAME|CONFIG.json, "
                    "or give the report --model.")
        return (f"Priced as {' and '.join(parts)} on {self.gpu.title} ({self.gpu.source}: "
                f"{self.gpu.flops_per_s / 1e12:,.1f} TFLOP/s effective).")


def pricing_for(gpu: str = DEFAULT_GPU, model: str | None = None) -> Pricing:
    """``--gpu`` and ``--model`` of the report."""
    from kvtrace.geometry.cost import cost_model

    return Pricing(gpu_throughput(gpu), cost_model(model, None, gpu) if model else None)


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


def collect(connection, db: str, *, bucket_steps: int = 10, min_hits: int = 2,
            pricing: Pricing | None = None) -> ReportData:
    import msgspec

    from kvtrace.analysis.database import has_attribution
    from kvtrace.analysis.explain import describe, lookups_from_causes
    from kvtrace.events import TraceHeader

    pricing = pricing or pricing_for()
    runs = execute(connection, """
        SELECT run, variant, path, source_key, header_json,
               json_extract_string(header_json, '$.replay.source_path') AS source_path
        FROM runs ORDER BY run""")
    labels = Labels.of(runs)
    priced = pricing.params()
    hot = {"min_hits": str(min_hits)}
    timeline = run_query(connection, "hit_rate_timeline", {"bucket_steps": str(bucket_steps)})
    attribution = (run_query(connection, "miss_attribution_summary")
                   if has_attribution(connection) else None)
    pushouts = run_query(connection, "pushed_out_prefixes", hot)
    verdict_rows = pricing.name_given_model(run_query(connection, "variant_verdict", priced))
    gpu_seconds = pricing.name_given_model(
        run_query(connection, "recompute_gpu_seconds", priced))
    lookups = run_query(connection, "pushout_lookups", hot)
    models = ([r[verdict_rows.columns.index("cost_model")] for r in verdict_rows.rows]
              + [r[gpu_seconds.columns.index("cost_model")] for r in gpu_seconds.rows])
    data = ReportData(
        db=db, labels=labels, pricing=pricing,
        verdicts=_verdicts(verdict_rows, pushouts, labels, pricing),
        verdict_command=sql_command(db, "variant_verdict", priced),
        priced_as=pricing.describe(models),
        cost_models=models,
        warnings=_silent_zero_warnings(attribution) if attribution else [],
        tables=_tables(connection, db, labels, timeline, attribution, pushouts, gpu_seconds,
                       priced, hot),
        timeline=timeline,
        occupancy=run_query(connection, "cache_occupancy",
                            {**hot, "bucket_steps": str(bucket_steps)}),
        pushout_evictions=run_query(connection, "checkpoint_pushouts", hot),
        pushout_lookups=lookups,
        sweep=execute(connection, "SELECT * FROM sweep ORDER BY sweep_id, variant, "
                                  "retention_interval, num_gpu_blocks"),
        break_even=run_query(connection, "sweep_break_even"),
        hits_went=hits_went(attribution),
    )
    if attribution is not None:
        from kvtrace.analysis.diagnosis import diagnose

        data.diagnoses = diagnose(connection, db, pricing=priced)
        headers = {row[0]: msgspec.json.decode(row[4], type=TraceHeader) for row in runs.rows}
        paths = {row[0]: row[2] for row in runs.rows}
        for run, req in _drill_down_requests(pushouts, lookups):
            causes = run_query(connection, "request_causes", {"run": str(run), "req": str(req)})
            if causes.rows:
                data.explanations[(run, req)] = describe(
                    paths[run], headers[run], lookups_from_causes(causes))
    data.fleet = fleet(connection, db, pricing, data.verdicts, data.diagnoses)
    data.counters = reconciliation_lines(connection)
    return data


def _drill_down_requests(pushouts: Result, lookups: Result) -> list[tuple[int, int]]:
    """(run, request) of the first lookups that lost each of the top pushed-out prefixes."""
    wanted = {(row[0], row[2]) for row in pushouts.rows[:DRILL_DOWN_PREFIXES]}
    found: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for row in map(lambda r: dict(zip(lookups.columns, r)), lookups.rows):
        key = (row["run"], row["hash_id"])
        if key in wanted and len(found.setdefault(key, [])) < DRILL_DOWN_LOOKUPS:
            found[key].append((row["run"], row["req"]))
    return sorted({pair for pairs in found.values() for pair in pairs})


def report_database(db: str, html_path: str | None = None, *, bucket_steps: int = 10,
                    min_hits: int = 2, markdown: bool = False, gpu: str = DEFAULT_GPU,
                    model: str | None = None) -> str:
    """The terminal report of ``db`` (Markdown with ``markdown``); with ``html_path``, also
    write the HTML report there (atomically)."""
    from kvtrace.analysis.database import open_database
    from kvtrace.files import write_atomically

    pricing = pricing_for(gpu, model)
    connection = open_database(db)
    try:
        data = collect(connection, db, bucket_steps=bucket_steps, min_hits=min_hits,
                       pricing=pricing)
    finally:
        connection.close()
    if html_path:
        from kvtrace.analysis.report_html import render_html

        write_atomically(html_path, render_html(data).encode())
    return render_markdown(data) if markdown else render_text(data)


# --- what the tables hold ----------------------------------------------------------------------


def first_admission_totals(summary: Result) -> dict[int, tuple[str, int, CauseTotals]]:
    """Per run: its variant, hash unit and the totals of its first admissions
    (miss_attribution_summary)."""
    runs: dict[int, tuple[str, int, CauseTotals]] = {}
    for row in map(lambda r: dict(zip(summary.columns, r)), summary.rows):
        if row["lookups"] != "first":
            continue
        _, _, totals = runs.setdefault(row["run"], (row["variant"], row["hash_unit"], CauseTotals(
            row["num_lookups"], row["query_tokens"], row["ideal_tokens"], row["hit_tokens"])))
        totals.tokens[row["cause"]] = row["tokens"]
    return runs


def _silent_zero_warnings(summary: Result) -> list[str]:
    warnings = []
    for run, (variant, unit, totals) in first_admission_totals(summary).items():
        warning = silent_zero_warning(f"run {run} ({variant})", totals, unit)
        if warning:
            warnings.append(warning)
    return warnings


def hits_went(attribution: Result | None) -> Result:
    """Per run (first admissions): the hit, the ideal and every cause that cost tokens, as
    percentages of the query tokens; a cause column only where some run has it."""
    if attribution is None:
        return Result([])
    runs = first_admission_totals(attribution)
    causes = [c for c in CAUSES if any(t.tokens.get(c) for _, _, t in runs.values())]
    rows = []
    for run, (variant, _, totals) in runs.items():
        share = 100 / totals.query_tokens if totals.query_tokens else 0
        rows.append((run, variant, totals.lookups, round(totals.hit_tokens * share, 1),
                     round(totals.ideal_tokens * share, 1),
                     *(round(totals.tokens.get(c, 0) * share, 1) for c in causes)))
    return Result(["run", "variant", "lookups", "hit", "ideal", *causes], rows)


def _overall_hit_rates(timeline: Result) -> Result:
    """Per run: the timeline's buckets summed."""
    totals: dict[int, list] = {}
    for row in map(lambda r: dict(zip(timeline.columns, r)), timeline.rows):
        total = totals.setdefault(row["run"], [row["run"], row["variant"], row["backend"], 0, 0, 0])
        total[3] += row["lookups"]
        total[4] += row["query_tokens"] or 0
        total[5] += row["hit_tokens"] or 0
    rows = [tuple(t) + (t[5] / t[4] if t[4] else None,) for t in totals.values()]
    return Result(["run", "variant", "backend", "lookups", "query_tokens", "hit_tokens",
                   "hit_rate"], rows)


def _with_source_labels(result: Result, labels: Labels, column: str = "source") -> Result:
    """``column``'s digests replaced by the sources' short labels."""
    index = result.columns.index(column)
    return Result(result.columns, [row[:index] + (labels.source(row[index]),) + row[index + 1:]
                                   for row in result.rows])


def compact_groups(ids: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> '5: 0-3, 5' (how many groups, then which)."""
    spans: list[list[int]] = []
    for group in sorted(ids):
        if spans and group == spans[-1][1] + 1:
            spans[-1][1] = group
        else:
            spans.append([group, group])
    which = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"{len(ids)}: {which}"


def _pushouts_table(pushouts: Result) -> Result:
    """pushed_out_prefixes with its group list folded to 'count: ranges'."""
    index = pushouts.columns.index("group_ids")
    columns = pushouts.columns[:index] + ["groups"] + pushouts.columns[index + 1:]
    return Result(columns, [row[:index] + (compact_groups(list(row[index])),) + row[index + 1:]
                            for row in pushouts.rows])


def _folded_causes(causes: Result) -> Result:
    """eviction_causes with the rows that differ only in their KV-cache group folded into one,
    with the groups' count and ranges: a checkpoint holds a block in every Mamba group, so its
    evictions otherwise repeat once per group."""
    folded: dict[tuple, list] = {}
    for row in map(lambda r: dict(zip(causes.columns, r)), causes.rows):
        key = (row["run"], row["variant"], row["reason"], row["entry_kind"], row["position_class"])
        entry = folded.setdefault(key, [[], 0, 0.0])
        entry[0].append(row["group_id"])
        entry[1] += row["removals"]
        entry[2] += row["share_of_run"]
    rows = [(*key[:3], compact_groups(groups), *key[3:], removals, share)
            for key, (groups, removals, share) in folded.items()]
    rows.sort(key=lambda r: (r[0], -r[6]))
    return Result(["run", "variant", "reason", "groups", "entry_kind", "position_class",
                   "removals", "share_of_run"], rows)


def _gpu_seconds_per_variant(per_prefix: Result) -> Result:
    """Per source and variant: the prefixes' rows summed."""
    columns = ["source", "variant", "other_variant", "lookups", "tokens_recomputed",
               "gpu_seconds", "cost_model"]
    totals: dict[tuple, list] = {}
    for row in map(lambda r: dict(zip(per_prefix.columns, r)), per_prefix.rows):
        key = (row["source"], row["variant"], row["other_variant"], row["cost_model"])
        total = totals.setdefault(key, [0, 0, None])
        total[0] += row["lookups"]
        total[1] += row["tokens_recomputed"]
        if row["gpu_seconds"] is not None:
            total[2] = (total[2] or 0.0) + row["gpu_seconds"]
    rows = [(source, variant, other, *total, cost)
            for (source, variant, other, cost), total in totals.items()]
    rows.sort(key=lambda r: (r[0], -(r[5] or 0), -r[4]))
    return Result(columns, rows)


def _tables(connection, db: str, labels: Labels, timeline: Result, attribution: Result | None,
            pushouts: Result, gpu_seconds: Result, priced: dict[str, str],
            hot: dict[str, str]) -> list[Table]:
    went = hits_went(attribution)
    lost = run_query(connection, "lost_hits_by_prefix")
    return [
        Table("hit_rates", "Hit rate per run", _overall_hit_rates(timeline),
              "First admission of each request (as kvtrace replay counts); hit_rate = hit "
              "tokens / prompt tokens.", sql_command(db, "hit_rate_timeline")),
        Table("hits_went", "Where the hits went", went,
              "Per run, first admissions, in % of prompt tokens: the hit, the ideal (what an "
              "unbounded cache under the same schedule would have hit), and what each cause "
              "cost (one lookup: `kvtrace why`). The causes sum to 100 - hit; those before "
              "`cold` make up ideal - hit."
              if attribution is not None else
              "This database was loaded by an older kvtrace and has no miss attribution: "
              "reload its traces (`kvtrace load TRACE ... -o DB`) to see where the hits went.",
              sql_command(db, "miss_attribution_summary")),
        Table("pushouts", "Top pushed-out prefixes", _pushouts_table(pushouts),
              "Hot prefixes evicted by LRU reuse while transient checkpoints sat cached behind "
              "them, one row per prefix; groups: how many KV-cache groups lost an entry for "
              "it, and which (`--query checkpoint_pushouts`: one row per eviction; "
              "`--query pushout_lookups`: the lookups that lost it).",
              sql_command(db, "pushed_out_prefixes", hot)),
        Table("lost_hits", "Hits lost by the unfixed variant", _with_source_labels(lost, labels),
              "Per prefix: lookups that hit in `fixed` and hit less in `unfixed` (same source).",
              sql_command(db, "lost_hits_by_prefix")),
        Table("gpu_per_variant", "GPU-seconds recomputing hits the other variant kept",
              _with_source_labels(_gpu_seconds_per_variant(gpu_seconds), labels),
              "Per variant: prefill its lookups recomputed where the paired variant hit "
              "deeper, priced with the model's FLOPs (cost_model) on the report's GPU.",
              sql_command(db, "recompute_gpu_seconds", priced)),
        Table("gpu_per_prefix", "Top prefixes by GPU-seconds recomputed",
              _with_source_labels(gpu_seconds, labels),
              "One row per variant and prefix.", sql_command(db, "recompute_gpu_seconds", priced)),
        Table("causes", "Eviction causes",
              _folded_causes(run_query(connection, "eviction_causes")),
              "Hash removals by reason and kind of entry; the rows of the KV-cache groups "
              "that removed alike are folded into one (groups: how many, and which).",
              sql_command(db, "eviction_causes")),
    ]


# --- the verdict -------------------------------------------------------------------------------


def _verdicts(rows: Result, pushouts: Result, labels: Labels, pricing: Pricing) -> list[Verdict]:
    verdicts = []
    prefixes = [dict(zip(pushouts.columns, row)) for row in pushouts.rows]
    for row in map(lambda r: dict(zip(rows.columns, r)), rows.rows):
        top = [p for p in prefixes if p["run"] == row["from_run"]][:TOP_VERDICT_PREFIXES]
        verdicts.append(Verdict(row, labels.source(row["source"]), top, advice(row, pricing)))
    return verdicts


def tokens_phrase(count: float) -> str:
    count = abs(count)
    if count >= 1e6:
        return f"{count / 1e6:,.2f} M"
    return f"{count:,.0f}"


def advice(row: dict, pricing: Pricing) -> str:
    """One sentence: what to do about the pair ``row`` (a ``variant_verdict`` row)."""
    old, new = row["from_variant"], row["to_variant"]
    per_hour = row["prefill_tokens_saved_per_hour"]
    if per_hour is None:
        return (f"No verdict: the runs of {old} and {new} have no scheduler steps to measure "
                "their traffic by.")
    gpu = row["gpu_seconds_saved_per_hour"]
    model = row["cost_model"].removesuffix(" (--model)") if gpu is not None else ""
    cost = (f" ({abs(gpu):,.3g} GPU-seconds per hour of {model} on {pricing.gpu.title})"
            if gpu is not None else " (not priced: give --model)")
    changed = row["from_prefill_tokens"] - row["to_prefill_tokens"]
    if abs(changed) < MATERIAL_SHARE * max(row["from_prefill_tokens"], 1):
        return (f"No action: {new} and {old} recompute within {MATERIAL_SHARE:.1%} of each "
                f"other on this traffic ({per_hour:+,.0f} tokens per hour).")
    amount = f"{tokens_phrase(per_hour)} {'fewer' if per_hour > 0 else 'more'} prefill tokens"
    better, worse = (new, old) if per_hour > 0 else (old, new)
    if better == "naive":
        return (f"naive would recompute {tokens_phrase(per_hour)} "
                f"{'fewer' if better == new else 'more'} prefill tokens per hour{cost}, but "
                "it leaves stale keys that hand a hit the wrong state (`--query "
                "stale_key_hazards`): do not run it; compare the other variants.")
    if old == "unfixed" and new in GATED:
        if per_hour > 0:
            return (f"Upgrade to a release with the #56794 gate ({new}: {VARIANT_ROLES[new]}): "
                    f"on this traffic it would recompute {amount} per hour{cost}.")
        return (f"The #56794 gate ({new}) would recompute {amount} per hour on this "
                f"traffic{cost}: the transient checkpoints {old} publishes served later hits "
                "here. Size the pool before relying on the gate (`kvtrace sweep` finds the "
                "pool size at which it pays).")
    return (f"Prefer {better} ({VARIANT_ROLES.get(better, 'a variant')}) over {worse}: "
            f"{new} would recompute {amount} per hour than {old} on this traffic{cost}.")


def verdict_lines(verdict: Verdict) -> list[tuple[str, str, str]]:
    """(label, value, the variant_verdict columns behind it) of a verdict's figures."""
    row = verdict.row
    rate = (f"{row['from_hit_rate']:.2%} -> {row['to_hit_rate']:.2%} "
            f"({row['hit_rate_change'] * 100:+.2f} points)")
    hours = row["traffic_hours"]
    lines = [("hit rate", rate, "from_hit_rate, to_hit_rate, hit_rate_change")]
    if hours:
        per_hour = row["prefill_tokens_saved_per_hour"]
        lines.append(("prefill tokens saved per hour",
                      f"{per_hour:+,.0f} ({row['from_prefill_tokens']:,} -> "
                      f"{row['to_prefill_tokens']:,} tokens in {hours * 3600:,.1f} s of "
                      "traffic)",
                      "prefill_tokens_saved_per_hour, from_prefill_tokens, to_prefill_tokens, "
                      "traffic_hours"))
        gpu = row["gpu_seconds_saved_per_hour"]
        lines.append(("GPU-seconds saved per hour",
                      f"{gpu:+,.3g}, priced as {row['cost_model']}" if gpu is not None
                      else "not priced (give --model)",
                      "gpu_seconds_saved_per_hour, cost_model"))
    return lines


def prefix_phrase(prefix: dict) -> str:
    return (f"hash {prefix['hash_id']} ({prefix['depth_tokens']:,} tokens): "
            f"{prefix['evictions']} eviction{'s' if prefix['evictions'] != 1 else ''}, "
            f"{prefix['later_missed_lookups']} missed lookup"
            f"{'s' if prefix['later_missed_lookups'] != 1 else ''}, "
            f"{prefix['regret_tokens']:,} tokens of regret")


def verdict_title(verdict: Verdict) -> str:
    row = verdict.row
    return (f"{row['from_variant']} -> {row['to_variant']} on {verdict.source} "
            f"({row['backend']}, {row['mode']}; runs {row['from_run']} and {row['to_run']})")


# --- the fleet ---------------------------------------------------------------------------------

TOP_FLEET_ENGINES = 3  # engines the fleet verdict names as losing most


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


def fleet(connection, db: str, pricing: Pricing, verdicts: list[Verdict],
          diagnoses: list) -> Fleet | None:
    """The fleet section of a database whose runs observed two engines or more (else None):
    the ``fleet`` query's rows, each engine's top ``kvtrace doctor`` finding over its runs, and
    the verdicts' pairs summed per pair over the engines whose traffic they replayed."""
    priced = pricing.params()
    rows = pricing.name_given_model(run_query(connection, "fleet", priced))
    if len(rows.rows) < 2:
        return None
    engines = [dict(zip(rows.columns, row)) for row in rows.rows]
    engine_of = {source: row["engine"] for row in engines for source in row["sources"]}
    by_run = {diagnosis.run: diagnosis for diagnosis in diagnoses}
    fleet_tokens: dict[str, int] = {}
    tops: dict[str, list[str]] = {}
    for row in engines:
        tokens: dict[str, int] = {}
        for diagnosis in (by_run[run] for run in row["runs"] if run in by_run):
            for finding in diagnosis.findings:
                tokens[finding.id] = tokens.get(finding.id, 0) + finding.tokens
        for finding_id, count in tokens.items():
            fleet_tokens[finding_id] = fleet_tokens.get(finding_id, 0) + count
        top = min(tokens.items(), key=lambda item: (-item[1], item[0]), default=None)
        row["top_finding"] = top and (f"{top[0]} ({top[1] / row['missed_tokens']:.1%})"
                                      if row["missed_tokens"] else top[0])
        if top:
            tops.setdefault(top[0], []).append(row["engine"])
        row["fixes"] = {}
    pairs: dict[tuple, list[tuple[int, str, dict]]] = {}
    order = {row["engine"]: index for index, row in enumerate(engines)}
    for verdict in verdicts:
        engine = engine_of.get(verdict.row["source"])
        if engine is not None:
            key = tuple(verdict.row[k] for k in ("from_variant", "to_variant", "backend", "mode"))
            pairs.setdefault(key, []).append((order[engine], engine, verdict.row))
            engines[order[engine]]["fixes"][key] = verdict.row
    fixes = [_fleet_fix([member[1:] for member in sorted(members, key=lambda m: m[0])], pricing)
             for members in pairs.values()]
    finding = min(fleet_tokens.items(), key=lambda item: (-item[1], item[0]), default=None)
    return Fleet(
        Table("fleet", f"Fleet: {len(engines)} engines", _fleet_table(engines, list(pairs)),
              "One row per engine (a captured engine core by host:pid and data-parallel rank, "
              "else a trace file), over the runs that observed it: first admissions' hit "
              "rate, the prefill its admitted lookups recomputed, per hour of its traffic and "
              "in GPU-seconds, its share of the fleet's, kvtrace doctor's top finding, and what "
              "each pair of replayed variants saves on it per hour (tokens, GPU-seconds).",
              sql_command(db, "fleet", priced)),
        engines, fixes,
        finding and (finding[0], finding[1], tops.get(finding[0], [])))


def _fleet_fix(members: list[tuple[str, dict]], pricing: Pricing) -> FleetFix:
    """A pair's verdict rows summed over the engines it was replayed on."""
    rows = [row for _, row in members]
    first = rows[0]

    def total(column: str):
        values = [row[column] for row in rows]
        return None if any(value is None for value in values) else sum(values)

    models = sorted({row["cost_model"] for row in rows if row["cost_model"]})
    row = {**first, "source": None, "from_run": None, "to_run": None,
           **{column: total(column) for column in (
               "lookups", "traffic_hours", "from_prefill_tokens", "to_prefill_tokens",
               "prefill_tokens_saved_per_hour", "from_gpu_seconds", "to_gpu_seconds",
               "gpu_seconds_saved_per_hour")},
           "cost_model": ", ".join(models) or None}
    return FleetFix(row, [engine for engine, _ in members], advice(row, pricing))


def _fleet_table(engines: list[dict], pairs: list[tuple]) -> Result:
    columns = ["engine", "runs", "lookups", "hit_rate", "missed_tokens",
               "missed_tokens_per_hour", "gpu_seconds_per_hour", "share_of_fleet_missed",
               "top_finding"]
    names = [f"{old}->{new}" + (f" ({backend})" if len({p[2] for p in pairs}) > 1 else "")
             for old, new, backend, _ in pairs]
    header = columns + [f"{name} {what}" for name in names
                        for what in ("tokens_saved_per_hour", "gpu_seconds_saved_per_hour")]
    rows = []
    for row in engines:
        saved = []
        for pair in pairs:
            fix = row["fixes"].get(pair)
            saved += ([fix["prefill_tokens_saved_per_hour"], fix["gpu_seconds_saved_per_hour"]]
                      if fix else [None, None])
        rows.append((row["engine"], ", ".join(map(str, row["runs"])),
                     *(row[column] for column in columns[2:]), *saved))
    return Result(header, rows)


def fleet_lines(data: ReportData) -> list[str]:
    """The fleet verdict: the engines that lose most, what each fix is worth summed over the
    engines it was replayed on, and the finding that costs the fleet most."""
    fleet_data = data.fleet
    lines = []
    losing = []
    for row in fleet_data.engines[:TOP_FLEET_ENGINES]:
        rate = (f"{row['gpu_seconds_per_hour']:,.3g} GPU-seconds per hour"
                if row["gpu_seconds_per_hour"] is not None else
                f"{tokens_phrase(row['missed_tokens_per_hour'] or 0)} prefill tokens per hour"
                if row["missed_tokens_per_hour"] is not None else
                f"{row['missed_tokens']:,} prefill tokens")
        share = (f", {row['share_of_fleet_missed']:.0%} of the fleet's missed prefill"
                 if row["share_of_fleet_missed"] is not None else "")
        top = f"; top finding {row['top_finding']}" if row["top_finding"] else ""
        losing.append(f"{row['engine']} ({rate}{share}{top})")
    lines.append(f"The engines that lose most, of {len(fleet_data.engines)}: "
                 + "; ".join(losing) + ".")
    for fix in fleet_data.fixes:
        row = fix.row
        lines.append(f"{row['from_variant']} -> {row['to_variant']} ({row['backend']}, "
                     f"{row['mode']}) replayed on {len(fix.engines)} of "
                     f"{len(fleet_data.engines)} engines ({', '.join(fix.engines)}), summed: "
                     f"{fix.advice}")
    if not fleet_data.fixes:
        lines.append("No engine's traffic was replayed under two variants: replay each "
                     "engine's capture (kvtrace replay CAPTURE --variant unfixed --variant "
                     "fixed --db DB) to see what a fix is worth over the fleet.")
    if fleet_data.finding:
        finding_id, tokens, engines = fleet_data.finding
        from kvtrace.analysis.diagnosis import BY_ID

        where = f", the top finding on {', '.join(engines)}" if engines else ""
        lines.append(f"Across the fleet, kvtrace doctor's costliest finding is {finding_id} "
                     f"({tokens:,} prefill tokens{where}): {BY_ID[finding_id].action}")
    return lines


# --- text and Markdown ------------------------------------------------------------------------

# What a terminal acts on, or ends a line at, rather than shows: C0 controls (newline and tab
# included), DEL, C1 controls, the Unicode line and paragraph separators, and the bidirectional
# marks and overrides that make text read other than it is.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                       r"\u2066-\u2069]")
# What Markdown acts on inside a line: HTML, entities and table cells (as entities, which a GFM
# table's cell split does not see), and what makes a heading, code, a link, strikethrough or
# emphasis (backslash-escaped); '_' only where it can open or close emphasis, not inside a word
# (hash_id).
_MARKDOWN_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "&#124;"}
_MARKDOWN_ACTIVE = re.compile(r"[\\`*\[\]#~&<>|]|(?<![^\W_])_|_(?![^\W_])")


def text_value(value) -> str:
    """``value`` for a terminal: every control character, newline and tab included, shown as
    its escape (``\\n``, ``\\x1b``), so that it cannot start a line of its own or drive the
    terminal."""
    return _CONTROLS.sub(lambda match: ascii(match.group())[1:-1], str(value))


def markdown_value(value) -> str:
    """``value`` for Markdown: as ``text_value`` (a newline would start a heading or end a
    table row), then inert: HTML characters and pipes as entities, the rest of Markdown's
    punctuation backslash-escaped."""
    return _MARKDOWN_ACTIVE.sub(
        lambda match: _MARKDOWN_ENTITIES.get(match.group(), "\\" + match.group()),
        text_value(value))


def markdown_code(text: str) -> str:
    """``text`` (a command) as a Markdown code span, inside which nothing is interpreted: its
    controls shown escaped, fenced by more backticks than any run of them in it."""
    text = text_value(text)
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _inert_value(value, escape):
    """A number as it is, anything else shown by ``escape``."""
    return value if value is None or isinstance(value, (int, float)) else escape(cell(value))


def _inert(result: Result, escape) -> Result:
    """``result`` with its column names and every cell but a number shown by ``escape``."""
    return Result([escape(column) for column in result.columns],
                  [tuple(_inert_value(v, escape) for v in row) for row in result.rows])


def _inert_verdict(verdict: Verdict, pricing: Pricing, escape) -> Verdict:
    """``verdict`` with what came from the database shown by ``escape``, and its advice
    written anew around those values (its own Markdown kept)."""
    def inert(row: dict) -> dict:
        return {key: _inert_value(value, escape) for key, value in row.items()}

    row = inert(verdict.row)
    return Verdict(row, escape(verdict.source), [inert(p) for p in verdict.prefixes],
                   advice(row, pricing))


def render_text(data: ReportData) -> str:
    parts = [f"WARNING: {text_value(warning)}\n" for warning in data.warnings]
    if data.warnings:
        parts.append("\n")
    parts.append("== Verdict ==\n")
    parts += _verdict_text(data, bullet="  ", escape=text_value, code=text_value)
    parts.append("\n")
    if data.fleet is not None:
        table = data.fleet.table
        parts.append(f"== {table.title} ==\n")
        parts += [f"  {text_value(line)}\n" for line in fleet_lines(data)]
        parts.append(f"  Reproduce: {text_value(table.command)}\n{table.note}\n")
        result = _inert(table.result, text_value)
        parts.append(format_table(result.columns, result.rows, max_rows=TOP_ROWS,
                                  max_width=TEXT_CELL_WIDTH) + "\n")
    for table in data.tables:
        parts.append(f"== {table.title} ==\n{table.note}\n")
        if table.result.rows:
            result = _inert(table.result, text_value)
            parts.append(format_table(result.columns, result.rows, max_rows=TOP_ROWS,
                                      max_width=TEXT_CELL_WIDTH))
        else:
            parts.append("(none)\n")
        parts.append("\n")
    return "".join(parts)


def _verdict_text(data: ReportData, bullet: str, escape, code,
                  title=lambda text: text) -> list[str]:
    """The verdict block's lines, shared by the terminal and Markdown (``escape`` shows what
    came from the database, ``code`` marks a command, ``title`` a pair's heading)."""
    lines = [] if data.verdicts else [
        f"{bullet}No pair of variants replayed from one source: replay the traffic under two "
        f"variants (kvtrace replay SOURCE --variant unfixed --variant fixed --db DB) for a "
        "verdict.\n"]
    for verdict in (_inert_verdict(v, data.pricing, escape) for v in data.verdicts):
        lines.append(f"{title(verdict_title(verdict))}\n")
        lines.append(f"{bullet}{verdict.advice}\n")
        lines += [f"{bullet}{label}: {value}\n" for label, value, _ in verdict_lines(verdict)]
        if verdict.prefixes:
            lines.append(f"{bullet}top pushed-out prefixes (run {verdict.row['from_run']}): "
                         + "; ".join(prefix_phrase(p) for p in verdict.prefixes) + "\n")
    if data.verdicts:
        lines.append(f"{bullet}{data.pricing.describe(escape(m) for m in data.cost_models if m)}"
                     "\n")
        lines.append(f"{bullet}Reproduce: {code(data.verdict_command)}; prefixes: "
                     f"{code(data.table('pushouts').command)}\n")
    lines += [f"{bullet}{escape(line)}\n" for line in diagnosis_lines(data)]
    if data.diagnoses:
        lines.append(f"{bullet}Each finding's evidence, and what a replay of its change "
                     f"predicts: {code(f'kvtrace doctor {data.db}')}\n")
    lines += [f"{bullet}{escape(line)}\n" for line in data.counters]
    if data.counters:
        lines.append(f"{bullet}vLLM's counters against the trace: "
                     f"{code(sql_command(data.db, COUNTERS_QUERY))}\n")
    return lines


def diagnosis_lines(data: ReportData) -> list[str]:
    """Per run, kvtrace doctor's findings (the same diagnosis, without predictions): the top
    ones with their share of the missed prefill and what to change."""
    lines = []
    for diagnosis in data.diagnoses:
        label = data.labels.runs.get(diagnosis.run, str(diagnosis.run))
        if not diagnosis.findings:
            lines.append(f"run {label}: no mechanism reaches {diagnosis.threshold:.0%} of the "
                         "missed prefill")
            continue
        findings = "; ".join(f"{f.id} ({f.share_of_missed:.1%} of the missed prefill)"
                             for f in diagnosis.findings[:TOP_VERDICT_PREFIXES])
        top = diagnosis.findings[0]
        lines.append(f"run {label}: why it misses (kvtrace doctor): {findings}. "
                     f"{top.mechanism.name}: {top.action}")
    return lines


MARKDOWN_TABLES = ("hit_rates", "pushouts", "lost_hits", "gpu_per_variant")


def render_markdown(data: ReportData) -> str:
    """The verdict and the top tables, to paste into an incident ticket."""
    parts = [f"## kvtrace report: {markdown_value(os.path.basename(data.db))}\n\n"]
    parts += [f"> **Warning:** {markdown_value(warning)}\n\n" for warning in data.warnings]
    parts.append("### Verdict\n\n")
    parts += _verdict_text(data, bullet="- ", escape=markdown_value, code=markdown_code,
                           title=lambda s: f"**{s}**\n")
    if data.fleet is not None:
        table = data.fleet.table
        parts.append(f"\n### {table.title}\n\n")
        parts += [f"- {markdown_value(line)}\n" for line in fleet_lines(data)]
        result = _inert(table.result, markdown_value)
        parts.append(f"\n{table.note}\n\n"
                     + format_markdown(result.columns, result.rows, max_rows=TOP_ROWS)
                     + f"\n{markdown_code(table.command)}\n")
    for table in (data.table(key) for key in MARKDOWN_TABLES):
        parts.append(f"\n### {table.title}\n\n{table.note}\n\n")
        result = _inert(table.result, markdown_value)
        parts.append(format_markdown(result.columns, result.rows, max_rows=TOP_ROWS)
                     if result.rows else "(none)\n")
        parts.append(f"\n{markdown_code(table.command)}\n")
    return "".join(parts)
