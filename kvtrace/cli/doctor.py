"""``kvtrace doctor``: why the hybrid prefix cache misses, the mechanism behind it, what to do."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import click

from kvtrace.cli.model_options import hf_overrides_option


@click.command("doctor")
@click.argument("sources", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True,
              help="Print the diagnosis as JSON: per run, findings (id, tokens, "
                   "share_of_missed, evidence, reference, action, predicted) and ruled_out.")
@click.option("--threshold", type=float, default=None, metavar="SHARE",
              help="The share of the missed prefill below which a mechanism is ruled out "
                   "[default: 0.05].")
@click.option("--no-predict", is_flag=True,
              help="Do not replay the suggested changes (faster; no predicted figures).")
@click.option("--backend", default=None, metavar="NAME",
              help="The backend the predictions replay on (default: each run's own; a "
                   "capture's, vllm).")
@click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
              help="Keep the database the sources are loaded into here (default: a temporary "
                   "one; ignored when SOURCES is a database).")
@click.option("--gpu", default="h200", show_default=True, metavar="h200|h100|b200|TFLOPS",
              help="The GPU that prices recomputed tokens, as for kvtrace report.")
@click.option("--model", "model", default=None, metavar="NAME|CONFIG.json",
              help="The model that prices the runs whose header names none.")
@hf_overrides_option
def command(sources: tuple[str, ...], as_json: bool, threshold: float | None, no_predict: bool,
            backend: str | None, db_path: str | None, gpu: str, model: str | None) -> None:
    """Name why the prefix cache of each run in SOURCES misses, ranked by the prefill it costs.

    SOURCES are traces (a capture, a ring dump, a replay output), `kvtrace replay` output
    directories, or one database made by `kvtrace load`. Each finding names the mechanism,
    its share of the missed prefill (tokens, and GPU-seconds where the model is known), the
    query and `kvtrace why` commands that show it, the public vLLM report that describes it,
    what to change, and what a replay of that change predicts. Mechanisms below --threshold
    are listed as ruled out. docs/doctor/ has a page per finding.

    \b
    Examples:
        kvtrace doctor capture.kvtrace
        kvtrace doctor runs/ --json > diagnosis.json
        kvtrace doctor prod.duckdb --no-predict
    """
    import msgspec

    from kvtrace.analysis.database import is_database_file, open_database
    from kvtrace.analysis.diagnosis import (DEFAULT_THRESHOLD, check_threshold, diagnose,
                                            diagnoses_json, render_text)
    from kvtrace.analysis.load import load_traces
    from kvtrace.analysis.pricing import pricing_for
    from kvtrace.cli.common import terminal_safe
    from kvtrace.files import check_output_dir, refuse_overwrite
    from kvtrace.replay.backend import BACKENDS
    from kvtrace.errors import ConfigError

    threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    check_threshold(threshold)
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", f"Known backends: {', '.join(BACKENDS)}.")
    pricing = pricing_for(gpu, model).params()
    given_database = len(sources) == 1 and is_database_file(sources[0], "kvtrace doctor reads it")
    with tempfile.TemporaryDirectory(prefix="kvtrace-doctor-") as scratch:
        if given_database:
            db = sources[0]
        else:
            if db_path:
                refuse_overwrite([("--db", db_path)], list(sources))
                check_output_dir(db_path, "--db")
            db = db_path or os.path.join(scratch, "doctor.duckdb")
            load_traces(list(sources), db, option="--db")
        connection = open_database(db)
        try:
            shown = db if given_database or db_path else "doctor.duckdb"
            diagnoses = diagnose(connection, shown, threshold=threshold, pricing=pricing,
                                 predict=None if no_predict else replay_predictor(connection,
                                                                                  backend))
        finally:
            connection.close()
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(diagnoses_json(diagnoses)),
                                       indent=2))
        return
    if not given_database and not db_path:
        click.echo(terminal_safe("kvtrace: the evidence's queries read doctor.duckdb: keep it "
                                 "with --db doctor.duckdb"), err=True)
    click.echo(terminal_safe(render_text(diagnoses)), nl=False)


# --- predictions: the run's source replayed with the change (analysis runs no replay) ----------


@dataclass(frozen=True)
class RunSource:
    """What a run replays: its source trace, the variant, backend and mode to replay it with."""

    path: str
    variant: str
    backend: str


def run_source(connection, run: int) -> RunSource:
    """The source and variant that reproduce ``run``: a replay's own source and variant, or
    a capture or workload itself under the engine's variant."""
    import msgspec

    from kvtrace.events import TraceHeader
    from kvtrace.replay.options import CAPTURED_VARIANT

    path, header_json = connection.execute(
        "SELECT path, header_json FROM runs WHERE run = ?", [run]).fetchone()
    header = msgspec.json.decode(header_json, type=TraceHeader)
    if header.replay is not None:
        return RunSource(header.replay.source_path, header.replay.variant, header.replay.backend)
    return RunSource(path, header.params.get("variant", CAPTURED_VARIANT), "vllm")


def replay_predictor(connection, backend: str | None = None) -> Callable[[Any, Any], Any]:
    """Predict by replaying: the run's source, rescheduled, with and without the change, on
    the run's backend (``backend`` to choose another). A change of the cache itself (the
    pool, retention, drafter) starts both from an empty cache: a capture's start snapshot
    cannot describe it (``Overrides.changes_cache``). Each baseline runs once."""
    from kvtrace.analysis.diagnosis import Prediction
    from kvtrace.engine_config import Overrides
    from kvtrace.errors import KvtraceError

    baselines: dict[tuple[int, bool], dict[str, Any]] = {}

    def predict(diagnosis, finding):  # a Diagnosis and its Finding: a Prediction, or why none
        source = run_source(connection, diagnosis.run)
        if not source.path or not os.path.exists(source.path):
            return (f"no prediction: the run's source {source.path or '(unnamed)'} is not "
                    "where it was replayed from")
        change = finding.mechanism.change
        if change.variant == source.variant:
            return f"no prediction: the run already runs {change.description}"
        chosen = backend or source.backend
        overrides = dict(change.overrides)
        warm = not (change.pool_factor or Overrides(**overrides).changes_cache)
        try:
            if (diagnosis.run, warm) not in baselines:
                baselines[(diagnosis.run, warm)] = _replayed(source.path, source.variant,
                                                             chosen, {}, warm)
            before = baselines[(diagnosis.run, warm)]
            if change.pool_factor:
                overrides["num_gpu_blocks"] = before["num_gpu_blocks"] * change.pool_factor
            after = _replayed(source.path, change.variant or source.variant, chosen, overrides,
                              warm)
        except KvtraceError as error:
            return f"no prediction: {error}"
        flags = list(change.flags)
        if change.pool_factor:
            flags += ["--num-gpu-blocks", str(overrides["num_gpu_blocks"])]
        if not change.variant:
            flags = ["--variant", source.variant, *flags]
        command = " ".join(["kvtrace", "replay", source.path, *flags, "--backend", chosen,
                            "-o", "doctor-runs/"])
        return Prediction(change.description, before["hit_rate"], after["hit_rate"],
                          before["missed"], after["missed"], before["preemptions"],
                          after["preemptions"], command)

    return predict


def _replayed(path: str, variant: str, backend: str, overrides: dict[str, Any], warm: bool
              ) -> dict[str, Any]:
    """A rescheduled replay's figures: hit rate, missed prefill tokens, the pool."""
    from kvtrace.engine_config import Overrides
    from kvtrace.replay.options import ReplayOptions
    from kvtrace.replay.run import replay

    with tempfile.TemporaryDirectory(prefix="kvtrace-doctor-") as outdir:
        result = replay(ReplayOptions(path, outdir, (variant,), backend=backend,
                                      overrides=Overrides(**overrides), write_traces=False,
                                      warm_start=warm))
    summary = result.variants[0].summary
    missed = summary["prompt_tokens"] - summary["hit_tokens"]
    return {"hit_rate": summary["hit_rate"], "missed": missed,
            "preemptions": summary["preemptions"], "num_gpu_blocks": result.config.num_gpu_blocks}
