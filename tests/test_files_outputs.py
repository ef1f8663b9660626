"""Outputs appear whole or not at all (kvtrace/files.py): no command writes over one of its
inputs, however spelled, nor replaces a device, link, FIFO or socket; two writers of one path
never share a scratch name; an output that cannot be written is one error, before any work,
and leaves no scratch."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import duckdb
import pytest
from bad_traces import SPECIAL_OUTPUTS, header, node_kind, special_output
from cli_runs import (  # noqa: F401 (fixtures)
    KVTRACE,
    assert_error,
    fill,
    full_disk,
    immutable_dir,
    loaded,
    replayed,
    run,
    vllm_imported,
    workload,
)

from kvtrace.events import StepStarted
from kvtrace.traceio import TraceWriter


# --- no output is written over an input -----------------------------------------------------------


# Hardening finding D1.
@pytest.mark.parametrize("spelling", ["same", "dot", "link"])
def test_load_refuses_an_output_that_is_its_input_however_spelled(tmp_path, workload, spelling):
    before = workload.read_bytes()
    output = {"same": workload, "dot": tmp_path / "." / workload.name,
              "link": tmp_path / "link.kvtrace"}[spelling]
    if spelling == "link":
        output.symlink_to(workload)
    assert_error(run("load", workload, "-o", output), "is the input")
    assert workload.read_bytes() == before


# Hardening finding D1.
def test_replay_refuses_a_db_or_summary_onto_its_source_or_both_onto_one_file(tmp_path, workload):
    before = workload.read_bytes()
    out = tmp_path / "runs"
    assert_error(run("replay", workload, "-o", out, "--db", workload), "--db")
    assert_error(run("replay", workload, "-o", out, "--summary-json", workload), "is the input")
    assert_error(run("replay", workload, "-o", out, "--db", tmp_path / "x.json",
                     "--summary-json", tmp_path / "x.json"), "both name")
    assert workload.read_bytes() == before and not out.exists()


# Hardening finding D1.
def test_replay_refuses_a_db_onto_a_trace_of_its_outdir(tmp_path, workload, replayed):
    before = replayed.read_bytes()
    assert_error(run("replay", workload, "--variant", "fixed", "-o", replayed.parent,
                     "--db", replayed), "in OUTDIR")
    assert replayed.read_bytes() == before


# Hardening finding D1.
def test_import_report_engine_and_export_refuse_an_output_onto_their_input(tmp_path, workload):
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n')
    assert_error(run("import", "mooncake", log, "-o", log), "is the input")
    assert log.read_text().startswith('{"timestamp"')
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    before = db.read_bytes()
    assert_error(run("report", db, "--html", db), "is the input")
    assert_error(run("engine", workload, "--summary-json", workload), "is the input")
    exports = tmp_path / "exports"
    exports.mkdir()
    shutil.copy(db, exports / "w.duckdb")
    assert_error(run("export", exports / "w.duckdb", "--parquet", exports, "--overwrite"),
                 "inside")
    assert db.read_bytes() == before and (exports / "w.duckdb").read_bytes() == before


# Hardening round three, R5.
def test_sweep_refuses_an_output_onto_its_source_or_one_file_twice(tmp_path, workload):
    out = tmp_path / "s"
    out.mkdir()
    source = out / "sweep.html"
    shutil.copy(workload, source)
    assert_error(run("sweep", source, "--num-gpu-blocks", "300,400", "-j", 1, "-o", out),
                 "is the input")
    assert source.read_bytes() == workload.read_bytes()
    assert_error(run("sweep", workload, "--num-gpu-blocks", "300,400", "-j", 1, "-o", out,
                     "--db", out / "sweep.json"), "both name")
    assert sorted(p.name for p in out.iterdir()) == ["sweep.html"]


def output_commands(workload: Path, db: Path, log: Path, out: Path) -> dict[str, list]:
    """Every kind of atomic output, writing to ``out``."""
    return {
        "synth -o": ["synth", "--preset", "chat", "--requests", 3, "-o", out],
        "report --html": ["report", db, "--html", out],
        "load -o": ["load", workload, "-o", out],
        "replay --summary-json": ["replay", workload, "-o", out.parent / "runs",
                                  "--summary-json", out],
        "import -o": ["import", "mooncake", log, "-o", out],
        "sweep --db": ["sweep", workload, "--num-gpu-blocks", 300, "-j", 1,
                       "-o", out.parent / "sweep", "--db", out],
    }


# Hardening round three, R1.
@pytest.mark.parametrize("kind", SPECIAL_OUTPUTS)
def test_an_output_never_replaces_a_device_a_link_a_fifo_or_a_socket(tmp_path, workload,
                                                                     loaded, kind):
    """A rename onto the target replaced a device node (as root, -o /dev/null would break the
    host) or a link (--html /dev/stdout); now each is refused, before any work, untouched."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n')
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name, args in output_commands(workload, loaded, log, tmp_path / "out").items():
        try:
            target = special_output(kind, tmp_path / "out", victim)
        except PermissionError:
            pytest.skip("mknod is not allowed here (it needs root and CAP_MKNOD)")
        before = node_kind(target)
        assert_error(run(*args), "kvtrace replaces only regular files")
        assert node_kind(target) == before, name
        assert victim.read_text() == "precious" and not (tmp_path / "runs").exists(), name
        target.unlink()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


# --- writers of one path -------------------------------------------------------------------------


# Hardening finding D2.
def test_two_outputs_to_one_path_stage_under_distinct_names(tmp_path):
    from kvtrace.files import StagedOutput

    first, second = StagedOutput(tmp_path / "x"), StagedOutput(tmp_path / "x")
    assert first.path != second.path
    Path(first.path).write_text("first")
    Path(second.path).write_text("second")
    first.publish()
    second.publish()
    assert [p.name for p in tmp_path.iterdir()] == ["x"] and (tmp_path / "x").read_text() == "second"


# Hardening finding D2.
def test_concurrent_loads_into_one_database_all_succeed(tmp_path):
    big = tmp_path / "big.kvtrace"
    with TraceWriter(big, header()) as writer:
        writer.write_many(StepStarted(step=i, ts_ns=i) for i in range(400_000))
    db = tmp_path / "same.duckdb"
    loads = [subprocess.Popen([*KVTRACE, "load", str(big), "-o", str(db)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    results = [(load.wait(120), load.stderr.read().decode()) for load in loads]
    assert all(code == 0 and "Traceback" not in err for code, err in results), results
    with duckdb.connect(str(db), read_only=True) as connection:
        assert connection.execute("SELECT count(*) FROM step_started").fetchone() == (400_000,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.kvtrace", "same.duckdb"]


# Hardening round three, R5.
def test_a_load_keeps_the_rows_a_sweep_added_to_its_database_meanwhile(tmp_path, workload, loaded):
    """`load -o X` stages its database while `sweep --db X` adds rows to X in place: the
    load's rename would lose them, so the load refuses to replace X."""
    from kvtrace.files import OutputError, StagedOutput

    staged = StagedOutput(loaded)  # as `kvtrace load -o` starts
    Path(staged.path).write_bytes(b"the new database")
    result = run("sweep", workload, "--num-gpu-blocks", "300", "-j", 1, "-o", tmp_path / "s",
                 "--db", loaded)
    assert result.exit_code == 0, result.output
    with pytest.raises(OutputError, match="changed while this command ran"):
        staged.publish()
    with duckdb.connect(str(loaded), read_only=True) as connection:
        assert connection.execute("SELECT count(*) FROM sweep").fetchone() == (2,)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    replaced = StagedOutput(loaded)  # a database nothing wrote into meanwhile is replaced
    Path(replaced.path).write_bytes(b"the new database")
    replaced.publish()
    assert loaded.read_bytes() == b"the new database"


# Hardening round three, R5.
@pytest.mark.slow
def test_a_load_and_a_sweep_into_one_database_at_once_lose_no_sweep(tmp_path, workload):
    big = tmp_path / "big.kvtrace"
    with TraceWriter(big, header()) as writer:
        writer.write_many(StepStarted(step=i, ts_ns=i) for i in range(1_500_000))
    db = tmp_path / "x.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    load = subprocess.Popen([*KVTRACE, "load", str(big), "-o", str(db)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sweep = subprocess.run([*KVTRACE, "sweep", str(workload), "--num-gpu-blocks", "300", "-j",
                            "1", "-o", str(tmp_path / "s"), "--db", str(db)],
                           capture_output=True, text=True, timeout=300)
    load_code, load_err = load.wait(300), load.stderr.read()
    assert sweep.returncode == 0, sweep.stderr
    assert load_code == 0 or "changed while this command ran" in load_err, load_err
    with duckdb.connect(str(db), read_only=True) as connection:
        assert connection.execute("SELECT count(*) FROM sweep").fetchone() == (2,)


# --- an output that cannot be written ------------------------------------------------------------


# Hardening finding C1.
def test_replay_into_proc_or_an_immutable_directory_is_one_error(tmp_path, workload, immutable_dir):
    assert_error(run("replay", workload, "-o", "/proc/kvtrace-runs"), "cannot write")
    assert_error(run("replay", workload, "-o", immutable_dir), "cannot write")
    assert_error(run("replay", workload, "-o", immutable_dir / "runs"), "cannot write")
    assert list(immutable_dir.iterdir()) == []


# Hardening finding C2.
def test_load_into_a_missing_or_immutable_directory_is_one_error(tmp_path, workload, immutable_dir):
    assert_error(run("load", workload, "-o", tmp_path / "missing" / "w.duckdb"), "cannot write")
    assert_error(run("load", workload, "-o", immutable_dir / "w.duckdb"), "cannot write")
    assert_error(run("load", workload, "-o", "/proc/w.duckdb"), "cannot write")


# Hardening finding C3.
def test_report_html_to_a_path_it_cannot_write_is_one_error(tmp_path, workload):
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    assert_error(run("report", db, "--html", "/proc/report.html"), "cannot write")
    assert_error(run("report", db, "--html", tmp_path / "no" / "report.html"), "cannot write")


# Hardening finding M2.
def test_an_unwritable_summary_is_refused_before_any_replay(tmp_path, workload):
    out = tmp_path / "runs"
    assert_error(run("replay", workload, "-o", out, "--summary-json",
                     tmp_path / "missing" / "s.json"), "cannot write")
    assert not out.exists()


# Hardening finding M2.
def test_a_summary_or_database_in_the_outdir_to_be_made_is_written(tmp_path, workload):
    """The early check refused these: OUTDIR did not exist yet, and the replay makes it."""
    out = tmp_path / "runs"
    result = run("replay", workload, "-o", out, "--summary-json", out / "s.json",
                 "--db", out / "w.duckdb")
    assert result.exit_code == 0, result.output
    assert (out / "s.json").is_file() and (out / "w.duckdb").is_file()


# Hardening round three, R6.
def test_a_full_disk_is_one_error_in_every_command_and_leaves_no_scratch(tmp_path, workload, loaded,
                                                                         full_disk):
    from third_party_data import MOONCAKE_SYNTHETIC

    existing = full_disk / "existing.duckdb"
    shutil.copy(loaded, existing)
    fill(full_disk)
    before = {p: p.read_bytes() for p in (workload, loaded, existing)}
    commands = {
        "load": ["load", workload, "-o", full_disk / "x.duckdb"],
        "replay -o": ["replay", workload, "-o", full_disk / "runs"],
        "replay --db": ["replay", workload, "-o", tmp_path / "runs", "--db",
                        full_disk / "y.duckdb"],
        "synth": ["synth", "--preset", "agent", "--requests", 2000, "-o", full_disk / "s.kvtrace"],
        "import": ["import", "mooncake", MOONCAKE_SYNTHETIC, "-o", full_disk / "m.kvtrace"],
        "sweep": ["sweep", workload, "--num-gpu-blocks", 300, "-j", 1, "-o", full_disk / "sw"],
        "sweep --db": ["sweep", workload, "--num-gpu-blocks", 300, "-j", 1,
                       "-o", tmp_path / "sw", "--db", existing],
        "export": ["export", loaded, "--parquet", full_disk / "pq"],
    }
    for name, args in commands.items():
        assert_error(run(*args), "No space left on device")
        left = [p.name for p in full_disk.rglob("*") if ".partial" in p.name or p.name.endswith(
            ".old")]
        assert not left, (name, left)
    assert {p: p.read_bytes() for p in before} == before
    assert run("sql", existing, "SELECT count(*) FROM runs").exit_code == 0
