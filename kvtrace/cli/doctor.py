"""``kvtrace doctor``: why the hybrid prefix cache misses, the mechanism behind it, what to do."""

from __future__ import annotations

import os
import tempfile

import click

from kvtrace.analysis.diagnosis import DEFAULT_THRESHOLD
from kvtrace.cli.model_options import hf_overrides_option


@click.command("doctor")
@click.argument("sources", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True,
              help="Print the diagnosis as JSON: per run, findings (id, tokens, "
                   "share_of_missed, evidence, reference, action, predicted) and ruled_out.")
@click.option("--threshold", type=float, default=DEFAULT_THRESHOLD, show_default=True,
              help="The share of the missed prefill below which a mechanism is ruled out.")
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
def command(sources: tuple[str, ...], as_json: bool, threshold: float, no_predict: bool,
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
    from kvtrace.analysis.diagnosis import (check_threshold, diagnose, diagnoses_json,
                                            render_text, replay_predictor)
    from kvtrace.analysis.load import load_traces
    from kvtrace.analysis.report import pricing_for
    from kvtrace.cli.common import terminal_safe
    from kvtrace.files import check_output_dir, refuse_overwrite
    from kvtrace.replay.backend import BACKENDS
    from kvtrace.errors import ConfigError

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
