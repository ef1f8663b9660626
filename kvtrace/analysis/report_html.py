"""The HTML report: one self-contained page, verdict first, with interactive plots.

The plots are Plotly figures (hover for values, drag to zoom, a range slider on the time axes)
drawn by plotly.js, which the page embeds whole from the ``plotly`` package (about 4.8 MB of
the page), so that it renders on a machine with no network; the figures themselves are JSON
written here. Tables sort by a click on a column; each pushed-out prefix links to the lookups
that lost it, and each of those to what ``kvtrace why`` says of its request.
"""

from __future__ import annotations

import functools
import html
import json
from importlib import resources

from kvtrace.analysis.causes import COLOURS, HIT_COLOUR
from kvtrace.analysis.queries import Result
from kvtrace.analysis.render import cell, numeric_columns
from kvtrace.analysis.fleet_verdict import fleet_lines
from kvtrace.analysis.html_style import CSS
from kvtrace.analysis.report_model import TOP_ROWS, ReportData, Table
from kvtrace.analysis.verdict import diagnosis_lines, prefix_phrase, verdict_lines, verdict_title

HTML_ROWS = 100  # rows of a table on the page; `kvtrace sql` has the rest
MARKED_PREFIXES = 10  # hot prefixes the occupancy plots mark one by one; the rest share a trace

# The hit's colour and each cause's, by name (each defined with its cause).
CAUSE_COLOURS = {"hit": HIT_COLOUR, **COLOURS}
OCCUPANCY_COLOURS = ("#4f81bd", "#9bbb59", "#c0504d", "#f79646", "#dddddd")

# cache_occupancy's categories, bottom to top of the occupancy plots
OCCUPANCY_CATEGORIES = ("running", "hot_prefix", "transient_checkpoint", "other_cached", "free")
MAX_OCCUPANCY_PLOTS = 4  # runs given an occupancy plot

# Renders every figure of the page, marks each plot div once drawn (data-rendered: the browser
# test reads it), sorts tables on a click, and opens a drill-down link's <details>.
SCRIPT = """
const figures = JSON.parse(document.getElementById('kvtrace-figures').textContent);
for (const [id, figure] of Object.entries(figures)) {
  const div = document.getElementById(id);
  Plotly.newPlot(div, figure.data, figure.layout,
                 {responsive: true, displaylogo: false}).then(() => { div.dataset.rendered = '1'; });
}
for (const table of document.querySelectorAll('table.sortable')) {
  table.querySelectorAll('th').forEach((th, column) => th.addEventListener('click', () => {
    const ascending = th.dataset.order !== 'asc';
    table.querySelectorAll('th').forEach(other => delete other.dataset.order);
    th.dataset.order = ascending ? 'asc' : 'desc';
    const key = row => {
      const cell = row.cells[column];
      return cell.dataset.value !== undefined ? parseFloat(cell.dataset.value) : cell.textContent;
    };
    const rows = Array.from(table.tBodies[0].rows);
    rows.sort((a, b) => (key(a) < key(b) ? -1 : key(a) > key(b) ? 1 : 0) * (ascending ? 1 : -1));
    rows.forEach(row => table.tBodies[0].appendChild(row));
  }));
}
function openTarget() {
  const target = location.hash && document.getElementById(location.hash.slice(1));
  if (target && target.tagName === 'DETAILS') { target.open = true; }
}
window.addEventListener('hashchange', openTarget);
openTarget();
"""


@functools.cache
def plotly_js() -> str:
    """plotly.js as the ``plotly`` package ships it (its minified bundle)."""
    return (resources.files("plotly") / "package_data" / "plotly.min.js").read_text("utf-8")


def render_html(data: ReportData) -> str:
    title = f"kvtrace report: {data.db.rsplit('/', 1)[-1]}"
    figures: dict[str, dict] = {}
    body = [f"<h1>{_e(title)}</h1>"]
    body += [f'<p class="warning">WARNING: {_e(warning)}</p>' for warning in data.warnings]
    body.append(_verdict_html(data))
    if data.fleet is not None:
        body.append(_fleet_html(data))
    body.append('<nav><a href="#plots">plots</a><a href="#tables">tables</a>'
                + ('<a href="#sweep">sweep</a>' if data.sweep.rows else "")
                + ('<a href="#drill-down">drill-down</a>' if data.explanations else "") + "</nav>")
    body.append('<h2 id="plots">Hit rate over time</h2>')
    body.append(_plot(figures, "plot-hit-rate", _hit_rate_figure(data)) if data.timeline.rows
                else "<p><em>No lookups in this database.</em></p>")
    if data.hits_went.rows:
        body.append("<h2>Where the hits went (first admissions, % of prompt tokens)</h2>")
        body.append(_plot(figures, "plot-hits-went", _hits_went_figure(data)))
    if data.table("pushouts").result.rows:
        body.append("<h2>Top pushed-out prefixes (regret, prefill tokens)</h2>")
        body.append(_plot(figures, "plot-pushouts", _pushouts_figure(data)))
    for number, (run, rows) in enumerate(_by_run(data.occupancy)[:MAX_OCCUPANCY_PLOTS]):
        if rows[0]["pool_blocks"]:
            body.append(f"<h2>Pool occupancy: run {_e(data.labels.runs.get(run, run))}, with "
                        "the evictions of hot prefixes</h2>")
            body.append(_plot(figures, f"plot-occupancy-{number}",
                              _occupancy_figure(data, run, rows)))
    body.append('<h2 id="tables">Tables</h2>')
    body += [_table_section(data, table) for table in data.tables]
    if data.sweep.rows:
        body.append(_sweep_section(data, figures))
    if data.explanations:
        body.append(_drill_down(data))
    figures_json = json.dumps(figures, separators=(",", ":")).replace("</", "<\\/")
    return ("<!doctype html><html><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style>"
            f"<script>{plotly_js()}</script></head><body>" + "\n".join(body)
            + f'<script type="application/json" id="kvtrace-figures">{figures_json}</script>'
            f"<script>{SCRIPT}</script></body></html>\n")


def _e(value) -> str:
    return html.escape(str(value))


def _plot(figures: dict[str, dict], plot_id: str, figure: dict) -> str:
    figures[plot_id] = figure
    return f'<div class="plot kvtrace-plot" id="{plot_id}"></div>'


def _rows(result: Result) -> list[dict]:
    return [dict(zip(result.columns, row)) for row in result.rows]


def _by_run(result: Result) -> list[tuple[int, list[dict]]]:
    runs: dict[int, list[dict]] = {}
    for row in _rows(result):
        runs.setdefault(row["run"], []).append(row)
    return list(runs.items())


def _prefix_anchor(run: int, hash_id: int) -> str:
    return f"prefix-{run}-{hash_id}"


def _why_anchor(run: int, req: int) -> str:
    return f"why-{run}-{req}"


# --- the verdict --------------------------------------------------------------------------------


def _verdict_html(data: ReportData) -> str:
    parts = ['<section class="verdict" id="verdict"><h2>Verdict</h2>']
    if not data.verdicts:
        parts.append("<p>No pair of variants replayed from one source: replay the traffic "
                     "under two variants (<code>kvtrace replay SOURCE --variant unfixed "
                     "--variant fixed --db DB</code>) for a verdict.</p>")
    drilled = set(_drilled_prefixes(data))
    for verdict in data.verdicts:
        parts.append(f"<h3>{_e(verdict_title(verdict))}</h3>")
        parts.append(f'<p class="advice">{_e(verdict.advice)}</p><table class="figures">')
        for label, value, columns in verdict_lines(verdict):
            parts.append(f"<tr><th>{_e(label)}</th><td class=\"text\">{_e(value)}</td>"
                         f'<td class="text"><code title="variant_verdict columns">'
                         f"{_e(columns)}</code></td></tr>")
        for prefix in verdict.prefixes:
            name = _e(prefix_phrase(prefix))
            if (prefix["run"], prefix["hash_id"]) in drilled:
                name = f'<a href="#{_prefix_anchor(prefix["run"], prefix["hash_id"])}">{name}</a>'
            parts.append(f"<tr><th>pushed out (run {prefix['run']})</th>"
                         f'<td class="text" colspan="2">{name}</td></tr>')
        parts.append("</table>")
    if data.verdicts:
        parts.append(f'<p class="note">{_e(data.priced_as)}</p>')
        parts.append(f'<p class="note">Reproduce: <code>{_e(data.verdict_command)}</code>; the '
                     f'prefixes: <code>{_e(data.table("pushouts").command)}</code></p>')
    if data.counters:
        parts.append("<h3>vLLM's counters against the trace</h3><ul>"
                     + "".join(f"<li>{_e(line)}</li>" for line in data.counters) + "</ul>")
    diagnosis = diagnosis_lines(data)
    if diagnosis:
        parts.append("<h3>Why it misses (kvtrace doctor)</h3><ul>"
                     + "".join(f"<li>{_e(line)}</li>" for line in diagnosis)
                     + f'</ul><p class="note">Evidence and predictions: '
                       f'<code>{_e(f"kvtrace doctor {data.db}")}</code></p>')
    parts.append("</section>")
    return "".join(parts)


def _fleet_html(data: ReportData) -> str:
    """The fleet verdict and one row per engine, right under the verdict."""
    table = data.fleet.table
    return (f'<section id="fleet"><h2>{_e(table.title)}</h2><ul>'
            + "".join(f"<li>{_e(line)}</li>" for line in fleet_lines(data))
            + f'</ul><p class="note">{_e(table.note)} <code>{_e(table.command)}</code></p>'
            + html_table(table.result) + "</section>")


# --- tables ---------------------------------------------------------------------------------------


def _table_section(data: ReportData, table: Table) -> str:
    links = None
    if table.key == "pushouts":
        drilled = {(run, hash_id) for run, hash_id in _drilled_prefixes(data)}
        links = {"hash_id": lambda row: (_prefix_anchor(row[0], row[2])
                                         if (row[0], row[2]) in drilled else None)}
    return (f"<h3>{_e(table.title)}</h3><p class=\"note\">{_e(table.note)} "
            f"<code>{_e(table.command)}</code></p>" + html_table(table.result, links))


def html_table(result: Result, links: dict | None = None) -> str:
    """A sortable table of ``result`` (the first ``HTML_ROWS`` rows); ``links``: per column, a
    function of the row giving the anchor its cell links to (None: no link)."""
    if not result.rows:
        return "<p><em>none</em></p>"
    links = links or {}
    numeric = numeric_columns(len(result.columns), result.rows)
    head = "".join(f'<th class="{"num" if num else "text"}">{_e(c)}</th>'
                   for c, num in zip(result.columns, numeric))
    body = []
    for row in result.rows[:HTML_ROWS]:
        cells = []
        for column, value, num in zip(result.columns, row, numeric):
            text = _e(cell(value))
            anchor = links[column](row) if column in links else None
            if anchor:
                text = f'<a href="#{anchor}">{text}</a>'
            if num and value is not None:
                cells.append(f'<td data-value="{value}">{text}</td>')
            else:
                cells.append(f'<td class="text">{text}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = (f'<p class="more">{len(result.rows) - HTML_ROWS} more rows: run the command '
            "above.</p>" if len(result.rows) > HTML_ROWS else "")
    return (f'<div class="wide"><table class="sortable"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>{more}')


# --- drill-down -----------------------------------------------------------------------------------


def _drilled_prefixes(data: ReportData) -> list[tuple[int, int]]:
    """The pushed-out prefixes with a lookup whose request is explained, in table order."""
    explained = {(row["run"], row["hash_id"]) for row in _rows(data.pushout_lookups)
                 if (row["run"], row["req"]) in data.explanations}
    return [(row["run"], row["hash_id"]) for row in _rows(data.table("pushouts").result)
            if (row["run"], row["hash_id"]) in explained]


def _drill_down(data: ReportData) -> str:
    lookups = _rows(data.pushout_lookups)
    prefixes = {(row["run"], row["hash_id"]): row for row in _rows(data.table("pushouts").result)}
    command = data.table("pushouts").command.replace("pushed_out_prefixes", "pushout_lookups")
    parts = ['<h2 id="drill-down">Drill-down: the lookups that lost each pushed-out prefix</h2>',
             f'<p class="note">Each request links to what <code>kvtrace why</code> says of it. '
             f"<code>{_e(command)}</code></p>"]
    for run, hash_id in _drilled_prefixes(data):
        prefix = prefixes[(run, hash_id)]
        rows = [row for row in lookups if (row["run"], row["hash_id"]) == (run, hash_id)]
        result = Result(["req", "lookup_step", "hit_tokens", "regret_tokens", "evicted_step"],
                        [tuple(row[c] for c in ("req", "lookup_step", "hit_tokens",
                                                "regret_tokens", "evicted_step")) for row in rows])
        parts.append(f'<div id="{_prefix_anchor(run, hash_id)}"><h3>run '
                     f"{_e(data.labels.runs.get(run, run))}: {_e(prefix_phrase(prefix))}; "
                     f"groups {_e(prefix['groups'])}</h3>")
        parts.append(html_table(result, {"req": lambda row, run=run: (
            _why_anchor(run, row[0]) if (run, row[0]) in data.explanations else None)}))
        parts.append("</div>")
    parts.append("<h2>Why those requests missed</h2><p class=\"note\">From the database: the "
                 "decisive key of each range of missed tokens. The command under each reads the "
                 "trace again and adds every key and examples of the checkpoints behind an "
                 "eviction.</p>")
    variants = {run: label.split(" ", 1)[1] for run, label in data.labels.runs.items()}
    for (run, req), text in sorted(data.explanations.items()):
        parts.append(f'<details class="why" id="{_why_anchor(run, req)}"><summary>run '
                     f"{_e(data.labels.runs.get(run, run))}, request {req}</summary>"
                     f"<pre>{_e(text)}</pre><p><code>kvtrace why {_e(data.db)} --request {req} "
                     f"--variant {_e(variants.get(run, ''))}</code></p></details>")
    return "".join(parts)


# --- the sweep ------------------------------------------------------------------------------------


def _sweep_section(data: ReportData, figures: dict[str, dict]) -> str:
    parts = ['<h2 id="sweep">Sweep: hit rate against pool size</h2>']
    break_even = _rows(data.break_even)
    for sweep_id, rows in _by_key(_rows(data.sweep), "sweep_id"):
        parts.append(f"<h3>Sweep {sweep_id}: {_e(rows[0]['source_path'])} "
                     f"({_e(rows[0]['backend'])})</h3>")
        marks = [row for row in break_even if row["sweep_id"] == sweep_id]
        parts.append(_plot(figures, f"plot-sweep-{sweep_id}", _sweep_figure(rows, marks)))
    parts.append("<p class=\"note\">Where fixed starts to pay: the smallest pool from which it "
                 "hits at least as much as unfixed at every larger pool swept. <code>kvtrace sql "
                 f"{_e(data.db)} --query sweep_break_even</code></p>")
    parts.append(html_table(data.break_even))
    return "".join(parts)


def _by_key(rows: list[dict], key: str) -> list[tuple[object, list[dict]]]:
    grouped: dict[object, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row[key], []).append(row)
    return list(grouped.items())


# --- figures (Plotly JSON) --------------------------------------------------------------------------


def _layout(x_title: str, y_title: str, **extra) -> dict:
    return {"margin": {"l": 60, "r": 20, "t": 10, "b": 40}, "hovermode": "closest",
            "xaxis": {"title": {"text": x_title}}, "yaxis": {"title": {"text": y_title}},
            "legend": {"orientation": "h", "y": 1.12}, **extra}


def _time_axis(layout: dict) -> dict:
    """A range slider under a step axis: drag it to zoom on a time range."""
    layout["xaxis"]["rangeslider"] = {"visible": True, "thickness": 0.08}
    layout["margin"]["b"] = 30
    return layout


def _hit_rate_figure(data: ReportData) -> dict:
    traces, highest = [], 0.0
    for run, rows in _by_run(data.timeline):
        rates = [row["cumulative_hit_rate"] or 0 for row in rows]
        highest = max(highest, *rates)
        live = rows[0]["backend"] == "live"  # a capture: dashed on top of a faithful replay
        traces.append({"type": "scatter", "mode": "lines", "x": [r["step_start"] for r in rows],
                       "y": rates, "name": f"run {data.labels.runs.get(run, run)} "
                                           f"({rows[0]['backend']})",
                       "line": {"dash": "dash" if live else "solid", "width": 2},
                       "hovertemplate": "step %{x}: %{y:.2%}"})
    traces.sort(key=lambda t: t["line"]["dash"] == "dash")  # captures drawn last, on top
    layout = _layout("scheduler step", "cumulative hit rate (tokens)")
    # Room above the highest curve, so that runs a few points apart stay apart.
    layout["yaxis"].update(range=[0, min(1.0, max(highest * 1.25, 0.05))], tickformat=".0%")
    return {"data": traces, "layout": _time_axis(layout)}


def _hits_went_figure(data: ReportData) -> dict:
    shares = data.hits_went
    parts = ["hit"] + shares.columns[5:]
    rows = _rows(shares)
    labels = [f"run {data.labels.runs.get(row['run'], row['run'])}" for row in rows]
    traces = [{"type": "bar", "orientation": "h", "name": part.replace("_", " "),
               "y": labels, "x": [row[part] for row in rows],
               "marker": {"color": CAUSE_COLOURS[part]},
               "hovertemplate": f"{part.replace('_', ' ')}: %{{x:.1f}}%<extra>%{{y}}</extra>"}
              for part in parts]
    traces.append({"type": "scatter", "mode": "markers", "name": "ideal", "y": labels,
                   "x": [row["ideal"] for row in rows],
                   "marker": {"symbol": "line-ns-open", "size": 22, "color": "#000",
                              "line": {"width": 3}},
                   "hovertemplate": "ideal: %{x:.1f}%<extra>%{y}</extra>"})
    layout = _layout("% of prompt tokens", "", barmode="stack",
                     height=140 + 40 * len(rows))
    layout["xaxis"]["range"] = [0, 100]
    layout["yaxis"].update(autorange="reversed", automargin=True)
    layout["legend"]["traceorder"] = "normal"
    return {"data": traces, "layout": layout}


def _pushouts_figure(data: ReportData) -> dict:
    rows = _rows(data.table("pushouts").result)[:TOP_ROWS]
    labels = [f"run {data.labels.runs.get(r['run'], r['run'])} · hash {r['hash_id']} "
              f"({r['depth_tokens']:,} tok)" for r in rows]
    hover = [f"{r['evictions']} evictions (groups {r['groups']}), first at step "
             f"{r['first_evicted_step']}<br>{r['hits_before_evictions']} hits before; "
             f"{r['later_missed_lookups']} later lookups missed it" for r in rows]
    trace = {"type": "bar", "orientation": "h", "y": labels,
             "x": [r["regret_tokens"] for r in rows], "customdata": hover,
             "marker": {"color": "#c0504d"},
             "hovertemplate": "%{x:,} tokens of regret<br>%{customdata}<extra>%{y}</extra>"}
    layout = _layout("regret (prefill tokens recomputed by later lookups, each counted once)",
                     "", height=120 + 32 * len(rows))
    layout["yaxis"]["autorange"] = "reversed"
    layout["yaxis"]["automargin"] = True
    return {"data": [trace], "layout": layout}


def _occupancy_figure(data: ReportData, run: int, rows: list[dict]) -> dict:
    pool = rows[0]["pool_blocks"]
    steps = [row["step_start"] for row in rows]
    traces = [{"type": "scatter", "mode": "lines", "stackgroup": "pool", "line": {"shape": "hv",
               "width": 0.5, "color": colour}, "name": category.replace("_", " "), "x": steps,
               "y": [row[category] / pool for row in rows],
               "hovertemplate": f"{category.replace('_', ' ')}: %{{y:.1%}} at step %{{x}}"
                                "<extra></extra>"}
              for category, colour in zip(OCCUPANCY_CATEGORIES, OCCUPANCY_COLOURS)]
    traces += _eviction_marks(data, run)
    layout = _layout("scheduler step", "share of the block pool")
    layout["yaxis"].update(range=[0, 1.08], tickformat=".0%")
    return {"data": traces, "layout": _time_axis(layout)}


def _eviction_marks(data: ReportData, run: int) -> list[dict]:
    """A triangle above the pool at each step a hot prefix was pushed out (its groups' evictions
    folded): one trace per top prefix of the run, the rest together."""
    evictions: dict[tuple[int, int], dict] = {}
    for row in _rows(data.pushout_evictions):
        if row["run"] == run:
            entry = evictions.setdefault((row["hash_id"], row["evicted_step"]),
                                         {"depth": row["depth_tokens"], "groups": 0})
            entry["groups"] += 1
    ranked = [r["hash_id"] for r in _rows(data.table("pushouts").result) if r["run"] == run]
    marked = ranked[:MARKED_PREFIXES]
    traces = []
    for name, hashes in [(f"evicted: hash {h}", {h}) for h in marked] + [
            ("evicted: other hot prefixes", set(ranked) - set(marked))]:
        points = sorted((step, hash_id, entry) for (hash_id, step), entry in evictions.items()
                        if hash_id in hashes)
        if points:
            traces.append({"type": "scatter", "mode": "markers", "name": name,
                           "x": [step for step, _, _ in points], "y": [1.04] * len(points),
                           "marker": {"symbol": "triangle-down", "size": 10},
                           "text": [f"hash {h} ({e['depth']:,} tokens) pushed out of "
                                    f"{e['groups']} group(s)" for _, h, e in points],
                           "hovertemplate": "%{text} at step %{x}<extra></extra>"})
    return traces


def _sweep_figure(rows: list[dict], break_even: list[dict]) -> dict:
    from kvtrace.analysis.sweep import curves

    traces = [{"type": "scatter", "mode": "lines+markers", "name": label,
               "x": [r["num_gpu_blocks"] for r in points], "y": [r["hit_rate"] for r in points],
               "hovertemplate": "%{x} blocks: %{y:.2%}"}
              for label, points in curves({"rows": rows}).items()]
    layout = _layout("pool size (num_gpu_blocks)", "hit rate (prompt tokens)")
    layout["yaxis"]["tickformat"] = ".0%"
    marks = [row for row in break_even if row["break_even_blocks"] is not None]
    layout["shapes"] = [{"type": "line", "xref": "x", "yref": "paper", "x0": row[
        "break_even_blocks"], "x1": row["break_even_blocks"], "y0": 0, "y1": 1,
        "line": {"dash": "dot", "color": "#555"}} for row in marks]
    layout["annotations"] = [{"x": row["break_even_blocks"], "y": 1, "xref": "x",
                              "yref": "paper", "text": f"fixed pays from "
                              f"{row['break_even_blocks']:,} blocks", "showarrow": False,
                              "yanchor": "bottom"} for row in marks]
    return {"data": traces, "layout": layout}
