"""kvtrace report: the verdict and its sentence, pricing with the model each replay names,
Markdown, compact tables, and the drill-down's `kvtrace why` rendered from the database.
(The page in a real browser: test_demo.py.)"""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from kvtrace.analysis.database import open_database
from kvtrace.analysis.queries import run_query
from kvtrace.analysis.pricing import Pricing, pricing_for
from kvtrace.analysis.report import report_database
from kvtrace.analysis.report_collect import collect, compact_groups
from kvtrace.analysis.verdict import advice
from kvtrace.cli import cli
from kvtrace.geometry.cost import cost_model, gpu_throughput

from test_analysis_cli import db as scenario_db  # noqa: F401 (a fixture: the scenario, loaded)
from test_analysis_cli import report_figures


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_compact_groups():
    assert compact_groups([3, 0, 1, 2, 5]) == "5: 0-3, 5"
    assert compact_groups([6]) == "1: 6"


def verdict_row(saved_tokens: float, old="unfixed", new="fixed", gpu=12.5) -> dict:
    return {"from_variant": old, "to_variant": new, "prefill_tokens_saved_per_hour": saved_tokens,
            "gpu_seconds_saved_per_hour": gpu, "cost_model": "nemotron-h-8b",
            "from_prefill_tokens": 1_000_000, "to_prefill_tokens": 1_000_000 - saved_tokens / 2,
            "traffic_hours": 0.5}


def test_the_sentence_says_what_to_do():
    pricing = Pricing(gpu_throughput("h100"))
    upgrade = advice(verdict_row(2_400_000), pricing)
    assert upgrade == ("Upgrade to a release with the #56794 gate (fixed: #56794 as merged): on "
                       "this traffic it would recompute 2.40 M fewer prefill tokens per hour "
                       "(12.5 GPU-seconds per hour of nemotron-h-8b on an NVIDIA H100 SXM).")
    costs = advice(verdict_row(-40_000, gpu=-0.5), pricing)
    assert costs.startswith("The #56794 gate (fixed) would recompute 40,000 more prefill tokens "
                            "per hour on this traffic (0.5 GPU-seconds per hour")
    assert "kvtrace sweep" in costs
    assert advice(verdict_row(1_000), pricing).startswith(
        "No action: fixed and unfixed recompute within 0.5% of each other")
    naive = advice(verdict_row(50_000, old="fixed", new="naive"), pricing)
    assert "do not run it" in naive and "stale_key_hazards" in naive
    other = advice(verdict_row(-50_000, old="fixed", new="upstream", gpu=None), pricing)
    assert other == ("Prefer fixed (#56794 as merged) over upstream: upstream would recompute "
                     "50,000 more prefill tokens per hour than fixed on this traffic (not "
                     "priced: give --model).")


def test_the_verdict_comes_first_and_its_command_reproduces_it(scenario_db):
    text = report_database(str(scenario_db), model="kimi-linear-48b-a3b", gpu="350")
    verdict = text.split("\n\n")[0].splitlines()
    assert verdict[0] == "== Verdict =="
    assert verdict[1] == "unfixed -> fixed on scenario.kvtrace (model, reschedule; runs 1 and 0)"
    assert verdict[3] == "  hit rate: 18.75% -> 25.00% (+6.25 points)"
    assert "Priced as kimi-linear-48b-a3b at TP 1 (--model, for runs that name no model) on a " \
           "GPU of 350 TFLOP/s effective" in text
    command = re.search(r"Reproduce: kvtrace sql \S+ (--query variant_verdict[^;]*);", text)
    assert command, text
    result = invoke("sql", scenario_db, *command.group(1).split(), "--json")
    row = json.loads(result.stdout)
    assert f"GPU-seconds saved per hour: {row['gpu_seconds_saved_per_hour']:+,.3g}" in text
    assert f"{row['prefill_tokens_saved_per_hour']:+,.0f}" in text


def test_markdown_for_an_incident_ticket(scenario_db):
    result = invoke("report", scenario_db, "--markdown")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "## kvtrace report: s.duckdb"
    assert "**unfixed -> fixed on scenario.kvtrace (model, reschedule; runs 1 and 0)**" in lines
    assert "- hit rate: 18.75% -> 25.00% (+6.25 points)" in lines
    assert "- GPU-seconds saved per hour: not priced (give --model)" in lines
    table = lines.index("### Top pushed-out prefixes")
    assert lines[table + 4].startswith("| run | variant | hash_id | depth_tokens | groups |")
    assert lines[table + 5].startswith("| ---: | --- | ---: | ---: | --- |")
    assert lines[table + 6].startswith("| 1 | unfixed | 100 | 16 | 1: 0 |")


def test_a_replay_prices_its_own_model_and_the_report_says_so(tmp_path):
    """A Nemotron-H workload's replays carry its figures: the report prices them on the GPU
    given, names both, and its GPU-seconds are the query's. No default model anywhere."""
    workload = tmp_path / "w.kvtrace"
    assert invoke("synth", "--preset", "shared-prompt", "--requests", "16", "--seed", "5",
                  "--model", "nemotron-h-8b", "--system-prompt-len", "2080", "--prompt-len",
                  "4160", "--num-gpu-blocks", "40", "-o", workload).exit_code == 0
    db = tmp_path / "w.duckdb"
    result = invoke("replay", workload, "--backend", "model", "-o", tmp_path / "runs", "--db", db)
    assert result.exit_code == 0, result.stderr
    text = report_database(str(db), gpu="h100")
    assert ("Priced as nemotron-h-8b (the replays' own figures) on an NVIDIA H100 SXM "
            "(989.4 TFLOP/s dense BF16 peak x 40% utilisation (assumed): 395.8 TFLOP/s "
            "effective).") in text
    assert "WARNING" not in text
    assert "cost_source" not in text and "default" not in text and "(parameters)" not in text
    connection = open_database(db)
    try:
        data = collect(connection, str(db), pricing=pricing_for("h100"))
        verdict = run_query(connection, "variant_verdict",
                            {"gpu_flops_per_s": str(gpu_throughput("h100").flops_per_s)})
    finally:
        connection.close()
    row = dict(zip(verdict.columns, verdict.rows[0]))
    assert row["cost_model"] == "nemotron-h-8b"
    flops = cost_model("nemotron-h-8b").flops
    assert data.verdicts[0].row == row
    # Every lookup priced [hit, query) with Nemotron-H-8B's figures: at least the constant part.
    assert row["from_gpu_seconds"] >= flops.constant * row["from_prefill_tokens"] / 395.76e12


def test_eviction_causes_fold_the_groups(scenario_db):
    connection = open_database(scenario_db)
    try:
        data = collect(connection, "s.duckdb")
        unfolded = run_query(connection, "eviction_causes")
    finally:
        connection.close()
    folded = data.table("causes").result
    removals = folded.columns.index("removals")
    assert sum(r[removals] for r in folded.rows) == sum(
        r[unfolded.columns.index("removals")] for r in unfolded.rows)
    assert folded.columns[3] == "groups"


def test_the_drill_down_renders_kvtrace_why_from_the_database(scenario_db, tmp_path):
    """The pushed-out prefix S (hash 100) links to the lookups that lost it; each links to
    its request's explanation, whose lines are what `kvtrace why` says of that request, in its
    order: every range of missed tokens, each with its decisive key (`kvtrace why` reads the
    trace again and adds the other keys and examples of the checkpoints behind)."""
    page = tmp_path / "r.html"
    assert invoke("report", scenario_db, "--html", page).exit_code == 0
    html = page.read_text()
    assert 'href="#prefix-1-100"' in html and 'id="prefix-1-100"' in html
    requests = re.findall(r'href="#why-1-(\d+)"', html)
    assert requests
    for req in set(requests):
        rendered = re.search(rf'<details class="why" id="why-1-{req}">.*?<pre>(.*?)</pre>', html,
                             re.DOTALL).group(1)
        rendered = rendered.replace("&#x27;", "'").replace("&amp;", "&").splitlines()
        why = invoke("why", scenario_db.parent / "runs" / "unfixed.kvtrace", "--request", req)
        assert why.exit_code == 0, why.stderr
        said = [line.split(", e.g. ")[0].rstrip(".") for line in why.stdout.splitlines()]
        rendered = [line.rstrip(".") for line in rendered[1:]]
        remaining = iter(said[1:])
        assert all(line in remaining for line in rendered), (rendered, said)  # a subsequence
        assert [l for l in rendered if "tokens " in l and " - " in l] == [
            l for l in said if "tokens " in l and " - " in l]
        assert sum("evicted from block" in line for line in rendered) >= 1
    assert set(report_figures(html)) >= {"plot-hit-rate", "plot-pushouts"}
