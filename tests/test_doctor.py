"""``kvtrace doctor`` (#31): for every finding id, a workload on which it is the run's top finding
and one on which it is ruled out; the shares, the threshold, the predictions (each printed
``kvtrace replay`` command run here), the database source and ``--db``, and bad input.

The workloads use the bundled Kimi-K3 geometry (hash unit = block = 384 tokens, three KDA
groups and one attention group, retention 0). Most are ``kvtrace synth`` presets replayed on
the model backend; two are written here, where no preset has the shape the mechanism needs:
long shared prefixes sent twice (#56794's gate strips the prompt-end key the second send
would hit) and short prompts sent again on an MTP engine without lookahead block hashes
(EAGLE's dropped unit, replayed on the vllm backend: the model backend refuses a drafting
engine).
The figures in the comments are the shares of the missed prefill measured when the test was
written; the tests check the ranking, not the figures."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from pathlib import Path

import duckdb
import msgspec
import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.engine_config import drafter_fields
from kvtrace.traceio import read_records, write_trace
from kvtrace.workloads.workload import EngineShape, Workload, WorkloadRequest, write_workload

SECOND = 10**9
MODEL = "kimi-k3"
OVERCOUNT = "metric-overcount"  # its tokens are prompt tokens the counter misreports
FINDING_IDS = ("unique-prompts", "hash-unit-exceeds-prompts", "mamba-state-not-retained",
               "checkpoint-pushout", "prompt-end-keys-stripped", "pool-pressure",
               "eagle-dropped-unit", "preemption-recompute", OVERCOUNT)


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def ok(*args) -> str:
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result.stdout


def doctor(*args) -> dict:
    return json.loads(ok("doctor", *args, "--json"))


# --- the workloads -------------------------------------------------------------------------------


def synth(path: Path, *flags: str) -> Path:
    ok("synth", "--model", MODEL, *flags, "-o", path)
    return path


def replayed(source: Path, variant: str, *flags: str, backend: str = "model") -> Path:
    """``source`` replayed under one variant: the replay's trace."""
    outdir = source.parent / f"{source.stem}.{variant}{''.join(flags).replace('-', '_')}"
    ok("replay", source, "--variant", variant, "--backend", backend, *flags, "-o", outdir)
    (trace,) = outdir.glob("*.kvtrace")
    return trace


def hand_written(path: Path, prompts: list[tuple[int, list[int]]], num_gpu_blocks: int,
                 **config) -> Path:
    """Requests one second apart, each (prompt_len, hash ids) with 16 output tokens, under
    Kimi-K3's engine with ``config``'s fields replaced."""
    shape = EngineShape(model=MODEL, num_gpu_blocks=num_gpu_blocks)
    requests = [WorkloadRequest(i * SECOND, prompt_len, hash_ids, 16, [], f"r{i}")
                for i, (prompt_len, hash_ids) in enumerate(prompts)]
    write_workload(path, Workload("synth", requests, shape.hash_block_size), shape)
    if config:
        reader, records = read_records(path)
        write_trace(path, msgspec.structs.replace(
            reader.header, config=msgspec.structs.replace(reader.header.config, **config)),
            records)
    return path


def shared_prefixes_sent_twice(path: Path) -> Path:
    """Ten prompts, each a 20,000-token prefix all share plus 2,007 tokens of its own, each
    sent twice in a row; a pool that never evicts. The second send of a prompt would hit its
    prompt-end state, which #56794's gate (variant fixed) strips."""
    unit = 384
    shared = list(range(20000 // unit))
    prompts = []
    for prompt in range(10):
        own = [10000 * (prompt + 1) + i for i in range(2000 // unit)]
        prompts += [(20000 + 2007, shared + own)] * 2
    return hand_written(path, prompts, num_gpu_blocks=2000)


def short_prompts_sent_again(path: Path, lookahead_block_hashes: bool) -> Path:
    """Ten 788-token prompts (two hash units and 20 tokens), each sent five times, under an
    engine drafting 2 tokens with MTP: with lookahead block hashes (vLLM 0.33's default), or
    without them, so that every hit drops its last matched unit (use_eagle)."""
    prompts = [(788, [100 * p, 100 * p + 1]) for _ in range(5) for p in range(10)]
    config = EngineShape(model=MODEL, num_gpu_blocks=200).engine_config(num_gpu_blocks=200)
    config = msgspec.structs.replace(config, num_speculative_tokens=2)
    return hand_written(path, prompts, num_gpu_blocks=200, num_speculative_tokens=2,
                        **drafter_fields(config, "mtp", lookahead_block_hashes))


def chat(d: Path) -> Path:
    return synth(d / "chat.kvtrace", "--preset", "chat", "--requests", "200")


def agent(d: Path) -> Path:
    return synth(d / "agent.kvtrace", "--preset", "agent", "--requests", "200")


def documents(d: Path) -> Path:
    return synth(d / "documents.kvtrace", "--preset", "documents", "--requests", "100")


def one_system_prompt(d: Path) -> Path:
    """One system prompt and an 8-token question per request: every prompt ends inside a
    hash unit, and almost nothing is cold."""
    return synth(d / "one_prompt.kvtrace", "--preset", "shared-prompt", "--requests", "400",
                 "--system-prompts", "1", "--prompt-len", "8")


def one_long_system_prompt(d: Path) -> Path:
    """One 4,096-token system prompt and a 64-token question per request, 512 output
    tokens: almost every first admission hits, if the pool lets it in."""
    return synth(d / "one_long_prompt.kvtrace", "--preset", "shared-prompt", "--requests",
                 "200", "--system-prompts", "1", "--system-prompt-len", "4096", "--prompt-len",
                 "64", "--output-len", "512")


def long_chat(d: Path) -> Path:
    """Chats whose turns append long outputs (1,024 tokens) to long system prompts (2,048),
    with a pool of every distinct block: a turn shares the previous turn's output, where
    retention 0 keeps no state."""
    return synth(d / "long_chat.kvtrace", "--preset", "chat", "--requests", "200",
                 "--pool-fraction", "1", "--output-len", "1024", "--system-prompt-len", "2048")


def long_outputs(d: Path) -> Path:
    """40 unique documents of about 1,100 tokens that decode 8,192 tokens each."""
    return synth(d / "long_outputs.kvtrace", "--preset", "documents", "--requests", "40",
                 "--prompt-len", "1024", "--output-len", "8192", "--system-prompt-len", "64")


def counted_capture(d: Path, name: str, counted_hits: bool = True) -> Path:
    """A capture on the wall clock (a step a second) of six requests of 48 tokens sharing 32,
    with vLLM's counters scraped beside it (tests/test_vllm_counters.py's scrapes: at 1, 4 and
    7 s inside the window): as vLLM 0.30-0.33 count them (at admission), or with no hit."""
    from test_vllm_counters import CONFIG, SECOND, T0, scrape_line, window

    from kvtrace.capture.vllm_metrics import sidecar_path
    from kvtrace.events import (ComputedBlocksFound, FreeQueueState, RequestArrived,
                                SlotsAllocated, SnapshotEnded, SnapshotStarted, StepStarted,
                                TraceHeader)

    records = [SnapshotStarted(0, 7, 0, 0), FreeQueueState([1, 2, 3, 4, 5, 6]),
               SnapshotEnded(1000)]
    for req in range(6):  # request 0 at 0 s, before the window, misses; the others hit 32
        hit = 32 if req else 0
        records += [StepStarted(req, req * SECOND),
                    RequestArrived(req, 48, [101, 102, 200 + req], 4),
                    ComputedBlocksFound(req, hit, 0),
                    SlotsAllocated(req, 48 - hit, 0, hit, 0, 0, 48, True)]
    records.append(StepStarted(6, 8 * SECOND))
    trace = d / f"{name}.kvtrace"
    write_trace(trace, TraceHeader(kvtrace_version="test", created_ns=T0, source="capture",
                                   config=CONFIG, process_title="VLLM::EngineCore"), records)
    added = (5 * 48, 5 * 32 if counted_hits else 0)
    Path(sidecar_path(trace)).write_text("".join(
        scrape_line(T0 + ms * 10**6, queries, hits)
        for ms, queries, hits in window(added, before=(48, 0))))
    return trace


# name -> how to make the run's trace in a directory (a replay output, or a capture).
RUNS: dict[str, Callable[[Path], Path]] = {
    # pool-pressure 32.3% (78 blocks), then hash-unit-exceeds-prompts 26.1%, unique-prompts
    # 20.2%, mamba-state-not-retained 18.3%.
    "chat": lambda d: replayed(chat(d), "unfixed"),
    # a pool of 60 blocks under one long system prompt: admissions fail and are retried, and
    # preempted requests resume (no counters recorded: metric-overcount ruled out).
    "one_prompt_tight": lambda d: replayed(one_long_system_prompt(d), "unfixed",
                                           "--num-gpu-blocks", "60"),
    # vLLM's counters recorded beside a capture read no hit (vllm-ascend #16639) where its
    # admitted lookups hit 66.7%: metric-overcount 150% of the missed prefill, ahead of
    # unique-prompts.
    "counters_off": lambda d: counted_capture(d, "counters_off", counted_hits=False),
    # the same capture's counters at admission (vLLM 0.30-0.33): they read kvtrace's rate.
    "counters_at_admission": lambda d: counted_capture(d, "counters_at_admission"),
    # checkpoint-pushout 53.1%, then unique-prompts 20.3%.
    "agent_unfixed": lambda d: replayed(agent(d), "unfixed"),
    # #56794's gate: no transient checkpoint is cached (checkpoint-pushout 0).
    "agent_fixed": lambda d: replayed(agent(d), "fixed"),
    # unique-prompts 96.2%; hash-unit-exceeds-prompts 0.9%.
    "documents": lambda d: replayed(documents(d), "unfixed"),
    # hash-unit-exceeds-prompts 96.8%; unique-prompts 3.2%.
    "one_prompt": lambda d: replayed(one_system_prompt(d), "unfixed"),
    # mamba-state-not-retained 60.9%; pool-pressure 3.0%.
    "long_chat": lambda d: replayed(long_chat(d), "upstream"),
    # dense retention: mamba-state-not-retained 0.6%.
    "long_chat_dense": lambda d: replayed(long_chat(d), "upstream", "--retention", "none"),
    # prompt-end-keys-stripped 54.5%, then unique-prompts 38.9%.
    "prefixes_fixed": lambda d: replayed(shared_prefixes_sent_twice(d / "prefixes.kvtrace"),
                                         "fixed"),
    # vLLM 0.33's gate keeps the prompt-end keys: prompt-end-keys-stripped 0.
    "prefixes_upstream": lambda d: replayed(shared_prefixes_sent_twice(d / "prefixes.kvtrace"),
                                            "upstream"),
    # 100 blocks: preemption-recompute 84.4%, unique-prompts 13.5%. 66,708 retried lookups
    # (preempted requests waiting to resume) hit 725,376 tokens, but over 251 million query
    # tokens: vLLM's counter reads 0.29% against 0% admitted, under a point, so
    # metric-overcount is ruled out.
    "long_outputs_tight": lambda d: replayed(long_outputs(d), "upstream",
                                             "--num-gpu-blocks", "100"),
    # 2,000 blocks: no preemption.
    "long_outputs_roomy": lambda d: replayed(long_outputs(d), "upstream",
                                             "--num-gpu-blocks", "2000"),
    # eagle-dropped-unit 63.9%, unique-prompts 31.9%.
    "eagle": lambda d: replayed(short_prompts_sent_again(d / "eagle.kvtrace", False),
                                "upstream", backend="vllm"),
    # lookahead block hashes: nothing dropped.
    "lookahead": lambda d: replayed(short_prompts_sent_again(d / "lookahead.kvtrace", True),
                                    "upstream", backend="vllm"),
}

# finding id -> (a run where it is the top finding, a run where it is ruled out)
CASES = {
    "unique-prompts": ("documents", "one_prompt"),
    "hash-unit-exceeds-prompts": ("one_prompt", "documents"),
    "mamba-state-not-retained": ("long_chat", "long_chat_dense"),
    "checkpoint-pushout": ("agent_unfixed", "agent_fixed"),
    "prompt-end-keys-stripped": ("prefixes_fixed", "prefixes_upstream"),
    "pool-pressure": ("chat", "long_chat"),
    "eagle-dropped-unit": ("eagle", "lookahead"),
    "preemption-recompute": ("long_outputs_tight", "long_outputs_roomy"),
    OVERCOUNT: ("counters_off", "counters_at_admission"),
}


def test_every_finding_id_has_a_case():
    from kvtrace.analysis.diagnosis import MECHANISMS

    assert set(CASES) == set(FINDING_IDS) == {m.id for m in MECHANISMS}


def test_every_cause_that_names_its_finding_names_one_that_exists():
    """Each cause names the finding that owns it where it is defined (causes.py); a misspelt
    one would leave the cause unexplained without a word."""
    from kvtrace.analysis.causes import CAUSE_MECHANISMS, CAUSES
    from kvtrace.analysis.diagnosis import BY_ID

    assert set(CAUSE_MECHANISMS) <= set(CAUSES)
    assert set(CAUSE_MECHANISMS.values()) <= BY_ID.keys()
    assert {cause for m in BY_ID.values() for cause in m.causes} == CAUSE_MECHANISMS.keys()


@pytest.fixture(scope="module")
def run_trace(tmp_path_factory) -> Callable[[str], Path]:
    """Each run's trace, made once per module, in a directory of its own (a run's source
    and the replay outputs beside it)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = RUNS[name](tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="module")
def diagnosed(run_trace) -> Callable[[str], dict]:
    """``kvtrace doctor RUN --no-predict --json`` of each run, once."""
    done: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in done:
            done[name] = doctor(run_trace(name), "--no-predict")
        return done[name]

    return get


def ids(entries: list[dict]) -> list[str]:
    return [entry["id"] for entry in entries]


def cases(position: int):
    return [pytest.param(finding, runs[position], id=finding) for finding, runs in CASES.items()]


@pytest.mark.parametrize("finding, run", cases(0))
def test_the_finding_is_the_top_finding(diagnosed, finding, run):
    diagnosis = diagnosed(run)
    assert [r["run"] for r in diagnosis["runs"]] == [0]
    assert ids(diagnosis["findings"])[0] == finding, diagnosis["findings"]
    top = diagnosis["findings"][0]
    assert top["tokens"] > 0 and top["share_of_missed"] >= 0.05
    assert finding not in ids(diagnosis["ruled_out"])
    # Ranked by tokens: the top finding cost the most.
    assert top["tokens"] == max(f["tokens"] for f in diagnosis["findings"])


@pytest.mark.parametrize("finding, run", cases(1))
def test_the_finding_is_ruled_out(diagnosed, finding, run):
    diagnosis = diagnosed(run)
    assert finding in ids(diagnosis["ruled_out"]), diagnosis["ruled_out"]
    assert finding not in ids(diagnosis["findings"])
    if finding != OVERCOUNT:
        (ruled,) = [r for r in diagnosis["ruled_out"] if r["id"] == finding]
        assert ruled["share_of_missed"] < 0.05


def test_the_eagle_runs_are_mtp_engines_with_and_without_lookahead_hashes(run_trace):
    """What the eagle-dropped-unit cases compare: the same drafting engine, dropping a unit
    or hashing each unit with the token after it."""
    eagle, lookahead = (read_records(run_trace(name))[0].header.config for name in ("eagle", "lookahead"))
    assert (eagle.num_speculative_tokens, eagle.num_lookahead_tokens) == (2, 2)
    assert (lookahead.num_speculative_tokens, lookahead.num_lookahead_tokens) == (2, 2)
    assert (eagle.use_eagle, eagle.num_hash_lookahead_tokens) == (True, 0)
    assert (lookahead.use_eagle, lookahead.num_hash_lookahead_tokens) == (False, 1)


@pytest.mark.parametrize("run", ["one_prompt_tight", "chat", "long_outputs_tight"])
def test_without_recorded_counters_metric_overcount_is_ruled_out(diagnosed, run):
    """vLLM 0.30-0.33 record their prefix-cache stats at admission (PR #48860), and leave out
    a preempted request's: their counter reads kvtrace's hit rate however many lookups were
    retried (one_prompt_tight and long_outputs_tight retry thousands). Without counters
    recorded beside the trace, metric-overcount is ruled out at 0, and its note says why."""
    diagnosis = diagnosed(run)
    (overcount,) = [f for f in diagnosis["ruled_out"] if f["id"] == OVERCOUNT]
    assert overcount["tokens"] == 0 and "record theirs at admission" in overcount["note"]


@pytest.mark.parametrize("run, found", [("counters_off", True),
                                        ("counters_at_admission", False)])
def test_metric_overcount_is_vllms_recorded_counter_a_point_off_the_admitted_hit_rate(
        run_trace, tmp_path, run, found):
    """With vLLM's counters recorded beside the capture, metric-overcount's tokens are the
    prompt tokens their hit rate misreports (its distance from kvtrace's, over the first
    admissions' prompt tokens), and it is a finding only when that is a point or more."""
    from kvtrace.analysis.queries import run_query

    db = tmp_path / "run.duckdb"
    diagnosis = doctor(run_trace(run), "--no-predict", "--db", db)
    connection = duckdb.connect(str(db), read_only=True)
    try:
        result = run_query(connection, "vllm_counter_reconciliation")
        first = connection.execute("SELECT sum(num_query_tokens) FROM lookups "
                                   "WHERE admission = 1").fetchone()[0]
    finally:
        connection.close()
    (row,) = [dict(zip(result.columns, values)) for values in result.rows]
    (overcount,) = [f for f in diagnosis["findings"] + diagnosis["ruled_out"]
                    if f["id"] == OVERCOUNT]
    points = abs(row["vllm_hit_rate"] - row["hit_rate"])
    assert overcount["tokens"] == round(points * first)
    assert (points >= 0.01) is found and (OVERCOUNT in ids(diagnosis["findings"])) is found
    assert ("counted at admission" in overcount["note"]) is not found
    assert f"{row['vllm_query_tokens']:,} query tokens" in overcount["note"]


# --- shares --------------------------------------------------------------------------------------


@pytest.mark.parametrize("run", RUNS)
def test_the_shares_partition_the_missed_prefill(diagnosed, run):
    """Every mechanism but metric-overcount (whose tokens are prompt tokens the counter
    misreports) owns missed tokens: findings, ruled out and the causes no mechanism owns add
    up to the missed prefill, and each share is its tokens over the missed prefill."""
    diagnosis = diagnosed(run)
    (info,) = diagnosis["runs"]
    entries = diagnosis["findings"] + diagnosis["ruled_out"]
    assert sorted(ids(entries)) == sorted(FINDING_IDS)
    missed = info["missed_tokens"]
    assert missed > 0
    owned = sum(e["tokens"] for e in entries if e["id"] != OVERCOUNT)
    assert owned + sum(info["unexplained"].values()) == missed
    for entry in entries:
        assert entry["share_of_missed"] == pytest.approx(entry["tokens"] / missed, abs=1e-6)


def test_the_shares_by_hand(run_trace, tmp_path):
    """On the tight pool of long outputs, from the replay's own summary and the database's
    lookups: the missed prefill is the first admissions' prompt tokens less their hits plus
    what the resumed lookups did not hit, and preemption-recompute is the latter."""
    trace = run_trace("long_outputs_tight")
    source = trace.parent.parent / "long_outputs.kvtrace"
    summary_json = tmp_path / "summary.json"
    ok("replay", source, "--variant", "upstream", "--backend", "model", "--num-gpu-blocks",
       "100", "-o", tmp_path / "again", "--summary-json", summary_json)
    summary = json.loads(summary_json.read_text())["variants"]["upstream"]
    assert summary["preemptions"] > 0
    db = tmp_path / "run.duckdb"
    diagnosis = doctor(trace, "--no-predict", "--db", db)
    connection = duckdb.connect(str(db), read_only=True)
    try:
        first, resumed = connection.execute(
            "SELECT sum(num_query_tokens - num_hit_tokens) FILTER (WHERE admission = 1), "
            "sum(num_query_tokens - num_hit_tokens) FILTER (WHERE admission > 1) "
            "FROM lookups WHERE admitted").fetchone()
        causes = dict(connection.execute(
            "SELECT cause, sum(tokens) FROM miss_attribution WHERE NOT resumed "
            "GROUP BY cause").fetchall())
    finally:
        connection.close()
    assert first == summary["prompt_tokens"] - summary["hit_tokens"]
    (info,) = diagnosis["runs"]
    assert info["missed_tokens"] == first + resumed
    assert info["hit_rate"] == pytest.approx(summary["hit_rate"], abs=1e-6)
    by_id = {e["id"]: e for e in diagnosis["findings"] + diagnosis["ruled_out"]}
    assert by_id["preemption-recompute"]["tokens"] == resumed
    assert by_id["unique-prompts"]["tokens"] == causes.get("cold", 0)
    assert by_id["hash-unit-exceeds-prompts"]["tokens"] == sum(
        causes.get(c, 0) for c in ("short_prompt", "partial_unit", "hit_cap",
                                   "block_quantisation"))
    assert by_id["preemption-recompute"]["share_of_missed"] == pytest.approx(
        resumed / (first + resumed), abs=1e-6)
    owned = sum(e["tokens"] for e in by_id.values() if e["id"] != OVERCOUNT)
    assert owned + sum(info["unexplained"].values()) == first + resumed


# --- the threshold -------------------------------------------------------------------------------


def test_raising_the_threshold_moves_findings_to_ruled_out(run_trace):
    """chat: pool-pressure 32.3%, hash-unit-exceeds-prompts 26.1%, unique-prompts 20.2%,
    mamba-state-not-retained 18.3%."""
    trace = run_trace("chat")
    default = doctor(trace, "--no-predict")
    found = ids(default["findings"])
    assert found == ["pool-pressure", "hash-unit-exceeds-prompts", "unique-prompts",
                     "mamba-state-not-retained"]
    shares = {e["id"]: e["share_of_missed"] for e in default["findings"] + default["ruled_out"]}
    threshold = (shares["hash-unit-exceeds-prompts"] + shares["unique-prompts"]) / 2
    raised = doctor(trace, "--no-predict", "--threshold", threshold)
    assert ids(raised["findings"]) == ["pool-pressure", "hash-unit-exceeds-prompts"]
    assert {"unique-prompts", "mamba-state-not-retained"} <= set(ids(raised["ruled_out"]))
    assert raised["runs"][0]["threshold"] == threshold
    # A share exactly at the threshold is a finding; the next float above it, ruled out.
    tokens = {e["id"]: e["tokens"] for e in default["findings"]}
    share = tokens["unique-prompts"] / default["runs"][0]["missed_tokens"]
    at = doctor(trace, "--no-predict", "--threshold", repr(share))
    assert ids(at["findings"])[-1] == "unique-prompts"
    above = doctor(trace, "--no-predict", "--threshold", repr(math.nextafter(share, 1)))
    assert ids(above["findings"])[-1] == "hash-unit-exceeds-prompts"
    above = doctor(trace, "--no-predict", "--threshold", shares["pool-pressure"] + 1e-6)
    assert ids(above["findings"]) == []
    assert sorted(ids(above["ruled_out"])) == sorted(FINDING_IDS)
    text = ok("doctor", trace, "--no-predict", "--threshold", "0.5")
    assert "no mechanism reaches 50% of the missed prefill" in text
    assert "ruled out (below 50% of the missed prefill): pool-pressure 32.3%" in text


# --- predictions ---------------------------------------------------------------------------------


def replay_command(command: str, outdir: Path) -> float:
    """The hit rate of a prediction's printed ``kvtrace replay`` command, run here (into
    ``outdir`` instead of doctor-runs/)."""
    argv = shlex.split(command)
    assert argv[:2] == ["kvtrace", "replay"] and argv[-2:] == ["-o", "doctor-runs/"]
    summary = outdir / "summary.json"
    ok(*argv[1:-2], "-o", outdir, "--summary-json", summary)
    (variant,) = json.loads(summary.read_text())["variants"].values()
    return variant["hit_rate"]


PREDICTED = {  # run -> the findings that have a change, and the change
    "chat": {"pool-pressure": "twice the KV pool",
             "mamba-state-not-retained": "dense Mamba retention (a state kept at every block)"},
    "agent_unfixed": {"checkpoint-pushout": "#56794's gate (variant fixed)",
                      "pool-pressure": "twice the KV pool"},
    "prefixes_fixed": {"prompt-end-keys-stripped":
                       "vLLM 0.33's own checkpoint logic (variant upstream)"},
    "long_outputs_tight": {"preemption-recompute": "twice the KV pool"},
}


@pytest.mark.parametrize("run", PREDICTED)
def test_a_prediction_is_its_printed_replay_command(run_trace, tmp_path, run):
    trace = run_trace(run)
    diagnosis = doctor(trace)
    (info,) = diagnosis["runs"]
    preempted = any(f["id"] == "preemption-recompute" and f["tokens"]
                    for f in diagnosis["findings"] + diagnosis["ruled_out"])
    predicted = {f["id"]: f["predicted"] for f in diagnosis["findings"]
                 if f["predicted"] is not None}
    assert {k: p["change"] for k, p in predicted.items()} == PREDICTED[run]
    for finding in diagnosis["findings"]:  # the others have no change to replay
        if finding["id"] not in predicted:
            assert finding["predicted"] is None and finding["note"] == "" \
                or finding["id"] == OVERCOUNT
    for number, (finding, prediction) in enumerate(predicted.items()):
        # The baseline is the run itself, rescheduled again.
        assert prediction["hit_rate_before"] == pytest.approx(info["hit_rate"], abs=1e-6)
        after = replay_command(prediction["command"], tmp_path / str(number))
        assert abs(after - prediction["hit_rate_after"]) <= 1e-9, (finding, prediction)
        if not preempted:  # else the run's missed prefill has the resumed lookups' too
            assert prediction["missed_before"] == info["missed_tokens"]
    if "pool-pressure" in predicted:
        assert predicted["pool-pressure"]["hit_rate_after"] \
            > predicted["pool-pressure"]["hit_rate_before"]


def test_the_eagle_prediction_is_its_printed_replay_command(run_trace, tmp_path):
    diagnosis = doctor(run_trace("eagle"))
    (finding,) = [f for f in diagnosis["findings"] if f["id"] == "eagle-dropped-unit"]
    prediction = finding["predicted"]
    assert prediction["change"] == "0.33's lookahead block hashes"
    # The change does what the lookahead run shows: nothing dropped.
    lookahead = doctor(run_trace("lookahead"), "--no-predict")["runs"][0]["hit_rate"]
    assert prediction["hit_rate_after"] == pytest.approx(lookahead, abs=1e-6)
    after = replay_command(prediction["command"], tmp_path / "eagle")
    assert abs(after - prediction["hit_rate_after"]) <= 1e-9


def test_no_predict_gives_no_prediction(diagnosed):
    diagnosis = diagnosed("chat")
    assert diagnosis["findings"]
    assert all(f["predicted"] is None for f in diagnosis["findings"])
    assert "predicted:" not in ok("doctor", "--no-predict", diagnosis["runs"][0]["path"])


# --- sources: a database, --db ------------------------------------------------------------------


def comparable(diagnosis: dict) -> tuple:
    """What a diagnosis says, less the evidence (which names the database it reads)."""
    findings = [{k: v for k, v in f.items() if k != "evidence"} for f in diagnosis["findings"]]
    return findings, diagnosis["ruled_out"], diagnosis["runs"]


def test_a_database_source_gives_the_same_findings_as_the_traces(run_trace, tmp_path):
    traces = [run_trace("agent_unfixed"), run_trace("agent_fixed")]
    db = tmp_path / "agent.duckdb"
    ok("load", *traces, "-o", db)
    from_traces = doctor(*traces, "--no-predict")
    from_db = doctor(db, "--no-predict")
    assert [r["variant"] for r in from_db["runs"]] == ["unfixed", "fixed"]
    assert comparable(from_db) == comparable(from_traces)
    assert ids(f for f in from_db["findings"] if f["run"] == 0)[0] == "checkpoint-pushout"
    assert all(e.startswith(f"kvtrace sql {db} ") for f in from_db["findings"]
               for e in f["evidence"][:1])
    assert all(e.startswith("kvtrace sql doctor.duckdb ") for f in from_traces["findings"]
               for e in f["evidence"][:1])
    # The database's runs name their traces, so its predictions replay the same sources.
    assert comparable(doctor(db)) == comparable(doctor(*traces))


def test_db_keeps_the_database(run_trace, tmp_path):
    trace = run_trace("chat")
    db = tmp_path / "kept.duckdb"
    result = invoke("doctor", trace, "--no-predict", "--db", db)
    assert result.exit_code == 0, result.output
    assert db.is_file()
    assert "keep it with --db" not in result.stderr
    assert f"kvtrace sql {db} --query eviction_causes" in result.stdout
    assert comparable(doctor(db, "--no-predict")) == comparable(doctor(trace, "--no-predict"))
    # Without --db the database is a temporary one, and doctor says how to keep it.
    result = invoke("doctor", trace, "--no-predict")
    assert "keep it with --db doctor.duckdb" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.duckdb"]


# --- bad input -----------------------------------------------------------------------------------


@pytest.fixture
def not_a_trace(tmp_path) -> Path:
    path = tmp_path / "notes.kvtrace"
    path.write_text("not a trace\n")
    return path


BAD = {
    "missing file": (lambda d, trace, text: [d / "missing.kvtrace"], "missing.kvtrace",
                     "Check the path"),
    "not a trace": (lambda d, trace, text: [text], "is not a kvtrace trace", "damaged"),
    "threshold above 1": (lambda d, trace, text: [trace, "--threshold", "1.5"],
                          "--threshold 1.5 is not a share", "from 0 to below 1"),
    "threshold 1": (lambda d, trace, text: [trace, "--threshold", "1"],
                    "--threshold 1.0 is not a share", "from 0 to below 1"),
    "negative threshold": (lambda d, trace, text: [trace, "--threshold", "-0.1"],
                           "--threshold -0.1 is not a share", "from 0 to below 1"),
    "nan threshold": (lambda d, trace, text: [trace, "--threshold", "nan"],
                      "--threshold nan is not a share", "from 0 to below 1"),
    "unknown backend": (lambda d, trace, text: [trace, "--backend", "sglang"],
                        "unknown backend 'sglang'", "Known backends: vllm, model"),
}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_bad_input_is_one_error_and_a_hint_and_writes_nothing(run_trace, not_a_trace, tmp_path,
                                                              case, as_json):
    trace = run_trace("chat")
    arguments, error, hint = BAD[case]
    before = sorted(tmp_path.iterdir())
    db = tmp_path / "out.duckdb"
    result = invoke("doctor", *arguments(tmp_path, trace, not_a_trace), "--db", db,
                    *(["--json"] if as_json else []))
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("kvtrace: error:") and error in lines[0]
    assert lines[1].startswith("kvtrace: hint:") and hint in lines[1]
    assert sorted(tmp_path.iterdir()) == before


def test_a_threshold_that_is_no_number_is_a_usage_error(run_trace, tmp_path):
    result = invoke("doctor", run_trace("chat"), "--threshold", "five", "--db",
                    tmp_path / "out.duckdb")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "Invalid value for '--threshold'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_threshold_is_a_share_below_one():
    from kvtrace.analysis.diagnosis import check_threshold
    from kvtrace.errors import ConfigError

    for bad in (math.inf, -math.inf, math.nan, 1.0, -1e-9):
        with pytest.raises(ConfigError):
            check_threshold(bad)
    for good in (0.0, 0.05, 0.999):
        check_threshold(good)
