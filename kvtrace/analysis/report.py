"""``kvtrace report``: the shipped queries summarised for a terminal, or as one HTML page.

Everything shown comes from the shipped queries (no SQL of its own), so the report and
``kvtrace sql --query`` always agree. The HTML embeds its plots as PNG data URIs (matplotlib,
Agg backend) so the page is a single file that can be mailed or attached to an issue.
Warnings come first: a run whose hit rate is near zero although it need not be (a *silent
zero*, ``kvtrace.analysis.attribution.silent_zero_warning``), named by its dominant cause.
"""

from __future__ import annotations

import base64
import html
import io
import os
from dataclasses import dataclass

from kvtrace.analysis.attribution import CAUSES, CauseTotals, silent_zero_warning
from kvtrace.analysis.queries import Result, run_query
from kvtrace.analysis.render import format_table
from kvtrace.files import write_atomically

TOP_ROWS = 10
TEXT_CELL_WIDTH = 24  # a source's sha256 would otherwise take a terminal's width
OCCUPANCY_CATEGORIES = ("running", "hot_prefix", "transient_checkpoint", "other_cached", "free")
MAX_OCCUPANCY_PLOTS = 4


@dataclass
class ReportData:
    hit_rates: Result
    timeline: Result
    pushouts: Result
    lost_hits: Result
    causes: Result
    occupancy: Result
    attribution: Result | None  # miss_attribution_summary; None: the database predates it
    warnings: list[str]
    gpu_seconds: Result
    gpu_seconds_per_variant: Result


def collect(connection, *, bucket_steps: int = 10, min_hits: int = 2) -> ReportData:
    from kvtrace.analysis.database import has_attribution

    timeline = run_query(connection, "hit_rate_timeline", {"bucket_steps": str(bucket_steps)})
    attribution = (run_query(connection, "miss_attribution_summary")
                   if has_attribution(connection) else None)
    gpu_seconds = run_query(connection, "recompute_gpu_seconds")
    return ReportData(
        hit_rates=_overall_hit_rates(timeline),
        timeline=timeline,
        pushouts=run_query(connection, "pushed_out_prefixes", {"min_hits": str(min_hits)}),
        lost_hits=run_query(connection, "lost_hits_by_prefix"),
        causes=run_query(connection, "eviction_causes"),
        occupancy=run_query(connection, "cache_occupancy",
                            {"min_hits": str(min_hits), "bucket_steps": str(bucket_steps)}),
        attribution=attribution,
        warnings=_silent_zero_warnings(attribution) if attribution else [],
        gpu_seconds=gpu_seconds,
        gpu_seconds_per_variant=_gpu_seconds_per_variant(gpu_seconds),
    )


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


def hits_went(data: ReportData) -> Result:
    """Per run (first admissions): the hit, the ideal and every cause that cost tokens, as
    percentages of the query tokens; a cause column only where some run has it."""
    if data.attribution is None:
        return Result([])
    runs = first_admission_totals(data.attribution)
    causes = [c for c in CAUSES if any(t.tokens.get(c) for _, _, t in runs.values())]
    rows = []
    for run, (variant, _, totals) in runs.items():
        share = 100 / totals.query_tokens if totals.query_tokens else 0
        rows.append((run, variant, totals.lookups, round(totals.hit_tokens * share, 1),
                     round(totals.ideal_tokens * share, 1),
                     *(round(totals.tokens.get(c, 0) * share, 1) for c in causes)))
    return Result(["run", "variant", "lookups", "hit", "ideal", *causes], rows)


def report_database(db: str, html_path: str | None = None, *, bucket_steps: int = 10,
                    min_hits: int = 2) -> str:
    """The terminal report of ``db``; with ``html_path``, also write the HTML report there
    (atomically)."""
    from kvtrace.analysis.database import open_database

    connection = open_database(db)
    try:
        data = collect(connection, bucket_steps=bucket_steps, min_hits=min_hits)
    finally:
        connection.close()
    if html_path:
        write_atomically(html_path, render_html(data, f"kvtrace report: "
                                                      f"{os.path.basename(db)}").encode())
    return render_text(data)


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


def _gpu_seconds_per_variant(per_prefix: Result) -> Result:
    """Per source and variant: the prefixes' rows summed."""
    columns = ["source", "variant", "other_variant", "lookups", "tokens_recomputed",
               "gpu_seconds", "cost_model"]
    totals: dict[tuple, list] = {}
    for row in map(lambda r: dict(zip(per_prefix.columns, r)), per_prefix.rows):
        key = (row["source"], row["variant"], row["other_variant"], row["cost_model"])
        total = totals.setdefault(key, [0, 0, 0.0])
        total[0] += row["lookups"]
        total[1] += row["tokens_recomputed"]
        total[2] += row["gpu_seconds"] or 0.0
    rows = [(source, variant, other, *total, cost)
            for (source, variant, other, cost), total in totals.items()]
    rows.sort(key=lambda r: (r[0], -r[5]))
    return Result(columns, rows)


def _sections(data: ReportData) -> list[tuple[str, Result, str]]:
    return [
        ("Hit rate per run", data.hit_rates,
         "First admission of each request (as kvtrace replay counts); hit_rate = hit tokens / "
         "prompt tokens."),
        ("Where the hits went", hits_went(data),
         "Per run, first admissions, in % of prompt tokens: the hit, the ideal (what an "
         "unbounded cache under the same schedule would have hit), and what each cause cost "
         "(`kvtrace sql --query miss_attribution_summary`; one lookup: `kvtrace why`). The "
         "causes sum to 100 - hit; those before `cold` make up ideal - hit."
         if data.attribution is not None else
         "This database was loaded by an older kvtrace and has no miss attribution: reload "
         "its traces (`kvtrace load TRACE ... -o DB`) to see where the hits went."),
        ("Top pushed-out prefixes", data.pushouts,
         "Hot prefixes evicted by LRU reuse while transient checkpoints sat cached behind them, "
         "one row per prefix (`kvtrace sql --query checkpoint_pushouts`: one per eviction)."),
        ("Hits lost by the unfixed variant", data.lost_hits,
         "Per prefix: lookups that hit in `fixed` and hit less in `unfixed` (same source)."),
        ("GPU-seconds recomputing hits the other variant kept", data.gpu_seconds_per_variant,
         "Per variant: prefill its lookups recomputed where the paired variant hit deeper, in "
         "FLOPs of the model over an H200's effective throughput (cost_source: execute = the "
         "figures of `kvtrace replay --execute`, default = Kimi-Linear-48B-A3B on an H200)."),
        ("Top prefixes by GPU-seconds recomputed", data.gpu_seconds,
         "`kvtrace sql --query recompute_gpu_seconds`: one row per variant and prefix."),
        ("Eviction causes", data.causes, "Hash removals by reason and kind of entry."),
    ]


def render_text(data: ReportData) -> str:
    parts = [f"WARNING: {warning}\n" for warning in data.warnings]
    if parts:
        parts.append("\n")
    for title, result, note in _sections(data):
        parts.append(f"== {title} ==\n{note}\n")
        if result.rows:
            parts.append(format_table(result.columns, result.rows, max_rows=TOP_ROWS,
                                      max_width=TEXT_CELL_WIDTH))
        else:
            parts.append("(none)\n")
        parts.append("\n")
    return "".join(parts)


# --- HTML -------------------------------------------------------------------------------------


def render_html(data: ReportData, title: str) -> str:
    plots = [("Hit rate over time", _plot_hit_rate(data.timeline)),
             ("Top pushed-out prefixes (regret, prefill tokens)", _plot_pushouts(data.pushouts))]
    plots += [(f"Pool occupancy: run {run} ({variant})", png)
              for run, variant, png in _plot_occupancy(data.occupancy)]
    body = [f"<h1>{html.escape(title)}</h1>"]
    body += [f'<p class="warning">WARNING: {html.escape(warning)}</p>'
             for warning in data.warnings]
    for caption, png in plots:
        if png is not None:
            body.append(f"<h2>{html.escape(caption)}</h2>"
                        f'<img alt="{html.escape(caption)}" src="data:image/png;base64,{png}">')
    for heading, result, note in _sections(data):
        bars = _html_hits_went(result) if heading == "Where the hits went" else ""
        body.append(f"<h2>{html.escape(heading)}</h2><p>{html.escape(note)}</p>" + bars
                    + _html_table(result))
    return ("<!doctype html><html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


_CSS = ("body{font-family:sans-serif;margin:2em;max-width:70em}"
        "table{border-collapse:collapse;font-size:90%}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "th{background:#eee}img{max-width:100%}"
        ".warning{background:#fde9e7;border:1px solid #c0504d;padding:6px 10px}"
        ".bar-row{display:flex;align-items:center;margin:4px 0}"
        ".bar-label{width:14em;font-size:90%}"
        ".bar{position:relative;display:flex;width:40em;height:1.2em;border:1px solid #999}"
        ".bar span{display:block;height:100%}"
        ".bar i{position:absolute;top:-3px;bottom:-3px;width:2px;background:#000}"
        ".legend span{margin-right:1em;font-size:85%}"
        ".legend b{display:inline-block;width:.9em;height:.9em;margin-right:.3em}")


def _html_table(result: Result) -> str:
    if not result.rows:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in result.columns)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_html_cell(v))}</td>" for v in row) + "</tr>"
        for row in result.rows[:TOP_ROWS * 2])
    return f"<table><tr>{head}</tr>{rows}</table>"


def _html_cell(value) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(9, 3.6), dpi=100)
    return pyplot, figure, axes


def _png(pyplot, figure) -> str:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    pyplot.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _rows_by_run(result: Result) -> dict[int, list[dict]]:
    runs: dict[int, list[dict]] = {}
    for row in result.rows:
        record = dict(zip(result.columns, row))
        runs.setdefault(record["run"], []).append(record)
    return runs


def _plot_hit_rate(timeline: Result) -> str | None:
    if not timeline.rows:
        return None
    pyplot, figure, axes = _figure()
    highest = 0.0
    for run, rows in _rows_by_run(timeline).items():
        label = f"run {run}: {rows[0]['variant']} ({rows[0]['backend']})"
        rates = [r["cumulative_hit_rate"] or 0 for r in rows]
        highest = max(highest, *rates)
        live = rows[0]["backend"] == "live"  # a capture: dashed on top, so a faithful replay
        axes.plot([r["step_start"] for r in rows], rates, label=label,  # stays visible
                  linestyle="--" if live else "-", zorder=3 if live else 2)
    axes.set_xlabel("scheduler step")
    axes.set_ylabel("cumulative hit rate (tokens)")
    # Room above the highest curve, so that runs a few points apart stay apart.
    axes.set_ylim(0, min(1.0, max(highest * 1.25, 0.05)))
    axes.legend(loc="best", fontsize="small")
    return _png(pyplot, figure)


# One colour per cause, in waterfall order; cold and the uncacheable tails in greys.
_CAUSE_COLOURS = dict(zip(("hit",) + CAUSES, (
    "#9bbb59", "#8064a2", "#4bacc6", "#f79646", "#fac090", "#ffc000", "#b7dee8", "#7f7f7f",
    "#c0504d", "#e6b9b8", "#ccc1da", "#000000", "#d9d9d9", "#bfbfbf", "#a6a6a6")))


def _html_hits_went(shares: Result) -> str:
    """A stacked bar per run, drawn in HTML: the hit, then each cause, in % of prompt tokens;
    a black tick marks the ideal."""
    if "hit" not in shares.columns or not shares.rows:
        return ""
    parts = ["hit"] + shares.columns[5:]
    bars = []
    for row in map(lambda r: dict(zip(shares.columns, r)), shares.rows):
        segments = "".join(
            f'<span title="{html.escape(p)}: {row[p]:.1f}%" style="width:{row[p]}%;'
            f'background:{_CAUSE_COLOURS[p]}"></span>' for p in parts if row[p])
        bars.append(f'<div class="bar-row"><span class="bar-label">run {row["run"]} '
                    f'({html.escape(str(row["variant"]))})</span><span class="bar">{segments}'
                    f'<i style="left:{row["ideal"]}%" title="ideal {row["ideal"]:.1f}%"></i>'
                    "</span></div>")
    legend = "".join(f'<span><b style="background:{_CAUSE_COLOURS[p]}"></b>'
                     f'{html.escape(p.replace("_", " "))}</span>' for p in parts)
    return f'<div class="bars">{"".join(bars)}<div class="legend">{legend}</div></div>'


def _plot_pushouts(pushouts: Result) -> str | None:
    if not pushouts.rows:
        return None
    rows = [dict(zip(pushouts.columns, r)) for r in pushouts.rows[:TOP_ROWS]]
    pyplot, figure, axes = _figure()
    labels = [f"run {r['run']} ({r['variant']}) hash {r['hash_id']}, {r['depth_tokens']} tok: "
              f"{r['evictions']} eviction{'s' if r['evictions'] != 1 else ''}" for r in rows]
    axes.barh(range(len(rows)), [r["regret_tokens"] for r in rows], color="#c0504d")
    axes.set_yticks(range(len(rows)), labels, fontsize="small")
    axes.invert_yaxis()
    axes.set_xlabel("regret (prefill tokens recomputed by later lookups, each counted once)")
    return _png(pyplot, figure)


def _plot_occupancy(occupancy: Result) -> list[tuple[int, str, str]]:
    plots = []
    for run, rows in list(_rows_by_run(occupancy).items())[:MAX_OCCUPANCY_PLOTS]:
        pool = rows[0]["pool_blocks"]
        if not pool:
            continue
        pyplot, figure, axes = _figure()
        steps = [r["step_start"] for r in rows]
        shares = [[r[c] / pool for r in rows] for c in OCCUPANCY_CATEGORIES]
        axes.stackplot(steps, shares, labels=[c.replace("_", " ") for c in OCCUPANCY_CATEGORIES],
                       step="post",
                       colors=["#4f81bd", "#9bbb59", "#c0504d", "#f79646", "#dddddd"])
        axes.set_xlabel("scheduler step")
        axes.set_ylabel("share of the block pool")
        axes.set_ylim(0, 1)
        axes.legend(loc="upper left", fontsize="small", ncol=5)
        plots.append((run, rows[0]["variant"], _png(pyplot, figure)))
    return plots
