"""Why a hybrid prefix cache misses, named as the mechanisms vLLM's maintainers know, ranked by
the prefill they cost, with what to change and what a replay of that change predicts.

The diagnosis reads a loaded database (``kvtrace load``): the miss attribution's causes of the
first admissions (``diagnosis.sql``), the tokens preempted requests prefilled again, and vLLM's
own counters, where they were recorded beside the capture, against kvtrace's admitted lookups
(``vllm_counter_reconciliation.sql``). Each
``Mechanism`` owns a set of causes (each cause names its owner where it is defined:
``causes.CAUSE_MECHANISMS``, the table ``kvtrace why`` and the report read too, so the three
never disagree). A mechanism whose share
of the missed prefill reaches the threshold is a finding; the others are ruled out, with
their share. A finding with a ``Change`` gets a prediction: the run's source replayed with the
change, against the same replay without it: the caller's ``predict`` (analysis never runs a
replay; ``kvtrace doctor`` does: docs/commands/doctor.md; a page per finding in docs/doctor/).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtrace.analysis.causes import CAUSE_MECHANISMS
from kvtrace.analysis.queries import Result, run_query
from kvtrace.analysis.vllm_counters import QUERY as COUNTERS  # vLLM's counters, the trace
from kvtrace.errors import ConfigError

DEFAULT_THRESHOLD = 0.05  # of the missed prefill: below it, a mechanism is ruled out
COUNTER_POINTS = 0.01  # vLLM's counter off kvtrace's hit rate by this much: a finding
_COUNTING = {"admission": "at admission", "lookup": "at every lookup, retries included",
             "either": "at admission or at every lookup (too few retries to tell)"}
EXAMPLES = 3


@dataclass(frozen=True)
class Change:
    """What a finding suggests that a replay can run: ``replay`` options (in-process) and
    the same as command-line flags (for the evidence)."""

    description: str
    flags: tuple[str, ...]
    variant: str | None = None  # replay this variant instead of the run's
    pool_factor: int = 0  # replay with this many times the pool
    overrides: dict[str, Any] = field(default_factory=dict)  # engine_config.Overrides fields


@dataclass(frozen=True)
class Mechanism:
    id: str
    name: str  # what it is, as a title
    mechanism: str  # how it loses hits, one sentence
    reference: str  # the public vLLM reports and fixes
    action: str  # what to change
    change: Change | None = None  # the replay that predicts the action's effect

    @property
    def causes(self) -> tuple[str, ...]:
        """The miss attribution's causes it explains (first admissions): each cause names its
        owner (causes.DEFINITIONS)."""
        return tuple(cause for cause, owner in CAUSE_MECHANISMS.items() if owner == self.id)


DENSE_RETENTION = Change("dense Mamba retention (a state kept at every block)",
                         ("--retention", "none"), overrides={"retention_interval": None})
DOUBLE_POOL = Change("twice the KV pool", (), pool_factor=2)

MECHANISMS = (
    Mechanism(
        "unique-prompts", "Prompts share little",
        "no earlier request had computed these tokens, so no cache of any size or policy "
        "could have hit them",
        "not a cache problem (docs/doctor/unique-prompts.md)",
        "Nothing to tune in the cache: put what requests share first (the system prompt, tool "
        "definitions) and route requests that share a prefix to the same engine."),
    Mechanism(
        "hash-unit-exceeds-prompts", "The hash unit is longer than what requests share",
        "only whole hash units (in align mode the block, hundreds to thousands of tokens) hit, "
        "and the last token never does: prompts shorter than a unit, their tails and shared "
        "prefixes that end inside a block are recomputed",
        "vllm #40696, #53749, #48401; RFC #45702 (PRs #45939, #46251)",
        "A finer hash unit where the release supports it (hash_block_size with partial hits, "
        "vLLM 0.32+), longer shared prefixes, and max_model_len above the block. kvtrace "
        "cannot replay a finer unit: a trace carries one hash per unit."),
    Mechanism(
        "mamba-state-not-retained", "No recurrent state where the shared prefix ends",
        "the attention blocks of a shared prefix were cached, but no Mamba/KDA state was kept "
        "at its end (retention 0 keeps states only at prompt ends, in request-unique tokens), "
        "and a hybrid hit needs both",
        "vllm #45238, #54504; fixes #43447 (retention interval), #47782, #52527",
        "Keep states inside prompts: a prefix-cache retention interval, dense retention, or "
        "--mamba-cache-mode all.", DENSE_RETENTION),
    Mechanism(
        "checkpoint-pushout", "Transient checkpoints crowd hot prefixes out",
        "mid-prompt Mamba checkpoints that no later request reuses sat cached in the LRU and "
        "pushed out hot prefixes that later requests needed",
        "vllm PR #56794",
        "A release with #56794's gate, which keeps transient checkpoints out of the prefix "
        "cache (variant fixed).",
        Change("#56794's gate (variant fixed)", ("--variant", "fixed"), variant="fixed")),
    Mechanism(
        "prompt-end-keys-stripped", "The checkpoint gate strips prompt-end keys",
        "the variant kept checkpoints request-local or stripped their keys, among them the "
        "prompt-end states a repeated prompt would have hit (vLLM 0.30.0's gate strips them "
        "where the hash unit is the block; 0.31 and later do not)",
        "vllm PR #56794 and its follow-ups in 0.31.0 (docs/doctor/prompt-end-keys-stripped.md)",
        "Run vLLM 0.31 or later, whose gate keeps prompt-end keys (variant upstream here).",
        Change("vLLM 0.33's own checkpoint logic (variant upstream)", ("--variant", "upstream"),
               variant="upstream")),
    Mechanism(
        "pool-pressure", "Pool pressure",
        "reusable prefixes were evicted by LRU reuse before they were needed again: every "
        "request takes blocks in every KV-cache group of one pool, and a miss in one group "
        "voids the hit in all",
        "vllm #42948 (a variant of #32802)",
        "A larger KV pool (gpu_memory_utilization, a smaller max_model_len), fewer concurrent "
        "long prefills, or KV offloading.", DOUBLE_POOL),
    Mechanism(
        "eagle-dropped-unit", "Speculative decoding drops a unit",
        "EAGLE/MTP drops the last matched block from every hit, so a repeated short prompt "
        "hits nothing and longer ones a block less",
        "vllm #53504 (fixed by #53945, #54713; opt-out #53388); vllm-ascend #16639",
        "vLLM 0.33's lookahead block hashes, on by default (do not set "
        "disable_lookahead_block_hashes), which hash each block with the token after it "
        "instead of dropping it.",
        Change("0.33's lookahead block hashes", ("--lookahead-block-hashes",),
               overrides={"lookahead_block_hashes": True})),
    Mechanism(
        "preemption-recompute", "Preempted requests prefill again",
        "requests preempted under memory pressure lost their blocks and prefilled everything "
        "their resumed lookup did not hit",
        "vLLM's docs on preemption (recompute mode: docs.vllm.ai, Optimization and Tuning)",
        "A larger KV pool, or fewer requests at once (max_num_seqs, max_num_batched_tokens).",
        DOUBLE_POOL),
    Mechanism(
        "metric-overcount", "vLLM's hit counter is not the hit rate",
        "vLLM's counters, recorded beside the capture, read another hit rate than kvtrace's "
        "admitted lookups: a release that records its prefix-cache stats at the lookup counts "
        "a lookup retried after a failed admission again (0.30-0.33 record them at admission, "
        "and agree). Its size is the prompt tokens the counter's rate misreports",
        "vllm #43736, #43711, #25780, PR #48860",
        "Read the hit rate per admitted lookup (kvtrace's), not vllm:prefix_cache_hits over "
        "vllm:prefix_cache_queries."),
)
BY_ID = {mechanism.id: mechanism for mechanism in MECHANISMS}
PREEMPTION, OVERCOUNT = "preemption-recompute", "metric-overcount"


def mechanism_of(cause: str, resumed: bool) -> str | None:
    """The finding a lookup's tokens lost to ``cause`` go under: a resumed lookup's, all of
    them, under preemption-recompute; None for a cause no mechanism owns."""
    return PREEMPTION if resumed else CAUSE_MECHANISMS.get(cause)


@dataclass
class Prediction:
    change: str
    hit_rate_before: float  # first admissions, as kvtrace replay counts them
    hit_rate_after: float
    missed_before: int  # prompt tokens the first admissions recomputed
    missed_after: int
    preemptions_before: int
    preemptions_after: int
    command: str


@dataclass
class Finding:
    id: str
    tokens: int
    share_of_missed: float
    gpu_seconds: float | None = None
    gpu_seconds_per_hour: float | None = None
    examples: list[int] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    predicted: Prediction | None = None
    note: str = ""  # why there is no prediction, or what the counter said

    @property
    def mechanism(self) -> Mechanism:
        return BY_ID[self.id]

    @property
    def action(self) -> str:
        """The mechanism's action, and, where the replay of its change says it does not help
        on this traffic, that it does not."""
        action = self.mechanism.action
        predicted = self.predicted
        if predicted is not None and predicted.hit_rate_after <= predicted.hit_rate_before:
            action += (" On this traffic, though, the replay predicts it does not help: look "
                       "at the next finding, or at `kvtrace sweep` for a pool where it pays.")
        return action

    def to_json(self, run: int) -> dict[str, Any]:
        mechanism = self.mechanism
        return {"run": run, "id": self.id, "name": mechanism.name, "tokens": self.tokens,
                "share_of_missed": round(self.share_of_missed, 6),
                "gpu_seconds": self.gpu_seconds, "gpu_seconds_per_hour":
                    self.gpu_seconds_per_hour, "examples": self.examples,
                "evidence": self.evidence, "reference": mechanism.reference,
                "mechanism": mechanism.mechanism, "action": self.action,
                "predicted": None if self.predicted is None
                else dataclasses.asdict(self.predicted), "note": self.note}


@dataclass
class Diagnosis:
    """One run's diagnosis: its findings, most tokens first, and the mechanisms ruled out."""

    run: int
    variant: str
    path: str
    hit_rate: float
    missed_tokens: int
    findings: list[Finding]
    ruled_out: list[Finding]
    unexplained: dict[str, int]  # causes no mechanism owns (rekeyed, invalidated, other)
    threshold: float
    lookups: int  # admitted lookups (first and resumed): none in a workload not replayed

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def run_json(self) -> dict[str, Any]:
        return {"run": self.run, "variant": self.variant, "path": self.path,
                "hit_rate": round(self.hit_rate, 6), "missed_tokens": self.missed_tokens,
                "threshold": self.threshold, "lookups": self.lookups,
                "unexplained": self.unexplained}


def diagnoses_json(diagnoses: list[Diagnosis]) -> dict[str, Any]:
    """``kvtrace doctor --json``: every run's findings (ranked within the run) and the
    mechanisms ruled out, each naming its run, and the runs themselves."""
    return {"findings": [f.to_json(d.run) for d in diagnoses for f in d.findings],
            "ruled_out": [{"run": d.run, "id": f.id, "tokens": f.tokens,
                           "share_of_missed": round(f.share_of_missed, 6), "note": f.note}
                          for d in diagnoses for f in d.ruled_out],
            "runs": [d.run_json() for d in diagnoses]}


def diagnose(connection, db: str, *, threshold: float = DEFAULT_THRESHOLD,
             pricing: dict[str, str] | None = None,
             predict: Callable[[Diagnosis, Finding], Prediction | str] | None = None
             ) -> list[Diagnosis]:
    """The diagnosis of every run in ``connection`` (a loaded database at ``db``).
    ``predict(diagnosis, finding)`` gives a finding with a change its prediction, or a
    sentence saying why there is none (``kvtrace.cli.doctor.replay_predictor``)."""
    rows = run_query(connection, "diagnosis", pricing or {})
    counters = {row["run"]: row for row in _dicts(run_query(connection, COUNTERS))
                if row["vllm_hit_rate"] is not None}
    runs = {row[0]: row for row in connection.execute(
        "SELECT run, variant, path FROM runs ORDER BY run").fetchall()}
    per_run: dict[int, list[dict]] = {}
    for row in _dicts(rows):
        per_run.setdefault(row["run"], []).append(row)
    diagnoses = []
    for run, (_, variant, path) in runs.items():
        diagnosis = _diagnose_run(run, variant, path, per_run.get(run, []), counters.get(run),
                                  threshold, db)
        if predict is not None:
            for finding in diagnosis.findings:
                if finding.mechanism.change is not None:
                    outcome = predict(diagnosis, finding)
                    if isinstance(outcome, Prediction):
                        finding.predicted = outcome
                    else:
                        finding.note = outcome
        diagnoses.append(diagnosis)
    return diagnoses


def _dicts(result: Result) -> list[dict]:
    return [dict(zip(result.columns, row)) for row in result.rows]


def _diagnose_run(run: int, variant: str, path: str, rows: list[dict], counter: dict | None,
                  threshold: float, db: str) -> Diagnosis:
    kinds = {row["lookups"]: row for row in rows}
    first, resumed = kinds.get("first"), kinds.get("resumed")
    query = first["query_tokens"] if first else 0
    hit = first["hit_tokens"] if first else 0
    resumed_missed = resumed["query_tokens"] - resumed["hit_tokens"] if resumed else 0
    missed = query - hit + resumed_missed
    findings: dict[str, Finding] = {m.id: Finding(m.id, 0, 0.0) for m in MECHANISMS}
    unexplained: dict[str, int] = {}
    for row in rows:
        mechanism = mechanism_of(row["cause"], row["lookups"] == "resumed")
        if mechanism is None:
            unexplained[row["cause"]] = unexplained.get(row["cause"], 0) + row["tokens"]
            continue
        finding = findings[mechanism]
        finding.tokens += row["tokens"]
        if row["gpu_seconds"] is not None:
            finding.gpu_seconds = (finding.gpu_seconds or 0.0) + row["gpu_seconds"]
            if row["traffic_hours"]:
                finding.gpu_seconds_per_hour = finding.gpu_seconds / row["traffic_hours"]
        finding.examples = _merged_examples(finding.examples, row["examples"])
    overcount = findings[OVERCOUNT]
    counter_points = 0.0
    if counter is None:
        overcount.note = ("no vLLM counters were recorded beside this trace (kvtrace capture "
                          "--vllm-metrics); vLLM 0.30-0.33 record theirs at admission, once "
                          "per request until it is preempted: they read kvtrace's hit rate")
    else:
        counter_points = abs(counter["vllm_hit_rate"] - (counter["hit_rate"] or 0.0))
        overcount.tokens = round(counter_points * query)  # prompt tokens misreported
        overcount.note = (
            f"vLLM's counters read {counter['vllm_hit_rate']:.2%} over "
            f"{counter['vllm_query_tokens']:,} query tokens, counted "
            f"{_COUNTING.get(counter['counting'], 'by no rule kvtrace knows')}; kvtrace's "
            f"{counter['admitted_lookups']:,} admitted lookups {counter['hit_rate'] or 0:.2%}")
    for finding in findings.values():
        finding.share_of_missed = finding.tokens / missed if missed else 0.0
        finding.evidence = _evidence(finding, db, path)

    def found(finding: Finding) -> bool:
        if finding.id == OVERCOUNT and counter_points < COUNTER_POINTS:
            return False
        return finding.tokens > 0 and finding.share_of_missed >= threshold
    ranked = sorted(findings.values(), key=lambda f: (-f.tokens, f.id))
    lookups = sum(row["num_lookups"] for row in kinds.values())
    return Diagnosis(run, variant, path, hit / query if query else 0.0, missed,
                     [f for f in ranked if found(f)], [f for f in ranked if not found(f)],
                     unexplained, threshold, lookups)


def _merged_examples(examples: list[int], more: list[int] | None) -> list[int]:
    merged = list(examples)
    for req in more or ():
        if req not in merged and len(merged) < EXAMPLES:
            merged.append(req)
    return merged


QUERIES = {"unique-prompts": "miss_attribution_summary",
           "hash-unit-exceeds-prompts": "miss_attribution_summary",
           "mamba-state-not-retained": "miss_attribution_summary",
           "checkpoint-pushout": "checkpoint_pushouts",
           "prompt-end-keys-stripped": "checkpoint_publications",
           "pool-pressure": "eviction_causes",
           "eagle-dropped-unit": "miss_attribution_summary",
           "preemption-recompute": "miss_attribution_summary",
           "metric-overcount": COUNTERS}


def _evidence(finding: Finding, db: str, path: str) -> list[str]:
    """The commands that show a finding: its query, and ``kvtrace why`` of its examples."""
    from kvtrace.analysis.queries import sql_command

    commands = [sql_command(db, QUERIES[finding.id])]
    commands += [f"kvtrace why {path} --request {req}" for req in finding.examples]
    return commands


def check_threshold(threshold: float) -> None:
    if not 0 <= threshold < 1:
        raise ConfigError(f"--threshold {threshold} is not a share of the missed prefill",
                          "Use a number from 0 to below 1, e.g. 0.05 for 5%.")



# --- text ---------------------------------------------------------------------------------------


def render_text(diagnoses: list[Diagnosis]) -> str:
    """What ``kvtrace doctor`` prints: per run, its findings ranked, then what is ruled out."""
    lines: list[str] = []
    for diagnosis in diagnoses:
        lines.append(f"run {diagnosis.run} ({diagnosis.variant}, {diagnosis.path}): hit rate "
                     f"{diagnosis.hit_rate:.2%} at first admissions, "
                     f"{diagnosis.missed_tokens:,} prefill tokens missed")
        if not diagnosis.lookups:
            lines.append("  no admitted prefix lookup: a workload (kvtrace synth / import) has "
                         "none until it is replayed (kvtrace replay WORKLOAD -o runs/)")
        elif not diagnosis.findings:
            lines.append("  no mechanism reaches "
                         f"{diagnosis.threshold:.0%} of the missed prefill")
        for rank, finding in enumerate(diagnosis.findings, 1):
            lines += [f"  {rank}. {finding.id}: {finding.mechanism.name}",
                      f"     {_size(finding)}"]
            lines.append(f"     {finding.mechanism.mechanism}.")
            if finding.note:
                lines.append(f"     {finding.note}.")
            lines.append(f"     evidence: {'; '.join(finding.evidence)}")
            lines.append(f"     reference: {finding.mechanism.reference}")
            lines.append(f"     action: {finding.action}")
            if finding.predicted is not None:
                lines.append(f"     predicted: {prediction_phrase(finding.predicted)}")
        if diagnosis.ruled_out:
            lines.append(f"  ruled out (below {diagnosis.threshold:.0%} of the missed "
                         "prefill): " + ", ".join(
                             f"{f.id} {f.share_of_missed:.1%}" for f in diagnosis.ruled_out))
        if diagnosis.unexplained:
            lines.append("  not a mechanism kvtrace names: " + ", ".join(
                f"{cause} {tokens:,} tokens" for cause, tokens in diagnosis.unexplained.items()))
        lines.append("")
    return "\n".join(lines)


def _size(finding: Finding) -> str:
    what = "prompt tokens misreported" if finding.id == OVERCOUNT else "tokens"
    size = f"{finding.tokens:,} {what}, {finding.share_of_missed:.1%} of the missed prefill"
    if finding.gpu_seconds is not None:
        size += f", {finding.gpu_seconds:,.3g} GPU-seconds"
        if finding.gpu_seconds_per_hour is not None:
            size += f" ({finding.gpu_seconds_per_hour:,.3g} per hour of traffic)"
    return size


def prediction_phrase(prediction: Prediction) -> str:
    change = (prediction.hit_rate_after - prediction.hit_rate_before) * 100
    verdict = ("it helps" if change > 0 else "it does not help on this traffic")
    phrase = (f"{verdict}: with {prediction.change}, hit rate {prediction.hit_rate_before:.2%} -> "
              f"{prediction.hit_rate_after:.2%} ({change:+.2f} points), "
              f"{prediction.missed_before:,} -> {prediction.missed_after:,} prompt tokens "
              "recomputed")
    if prediction.preemptions_before or prediction.preemptions_after:
        phrase += (f", {prediction.preemptions_before:,} -> {prediction.preemptions_after:,} "
                   "preemptions")
    return f"{phrase} ({prediction.command})"
