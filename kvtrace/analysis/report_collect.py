"""A report's data, collected from a forensics database (``collect``): the verdicts, the
tables, the figures' results, the drill-down's explanations, kvtrace doctor's findings, the
fleet section and vLLM's counters reconciled.

Every figure comes from a shipped query, and each section names the query and the parameters
it ran with, so ``kvtrace sql DB --query NAME --param ...`` reproduces it; the one other read is
the ``runs`` table, for short labels. Warnings come first: a run whose hit rate is near zero
although it need not be (a *silent zero*, ``attribution.silent_zero_warning``), named by its
dominant cause: the data behind the verdict is suspect then.
"""

from __future__ import annotations

from kvtrace.analysis.causes import CAUSES
from kvtrace.analysis.miss_summary import CauseTotals, silent_zero_warning
from kvtrace.analysis.fleet_verdict import fleet
from kvtrace.analysis.pricing import Pricing, pricing_for
from kvtrace.analysis.queries import Result, execute, run_query, sql_command
from kvtrace.analysis.report_model import Labels, ReportData, Table
from kvtrace.analysis.verdict import verdicts_of
from kvtrace.analysis.vllm_counters import reconciliation_lines

DRILL_DOWN_PREFIXES = 10  # pushed-out prefixes given a drill-down in the HTML report
DRILL_DOWN_LOOKUPS = 5  # lookups per prefix whose `kvtrace why` is rendered


def collect(connection, db: str, *, bucket_steps: int = 10, min_hits: int = 2,
            pricing: Pricing | None = None) -> ReportData:
    """The report of the database open on ``connection`` (``db``: its path, which the
    reproducing commands name)."""
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
        verdicts=verdicts_of(verdict_rows, pushouts, labels, pricing),
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
