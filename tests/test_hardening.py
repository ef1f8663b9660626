"""The adversarial suite: every finding of the hardening issue (its data / bad-input half),
reproduced as an attacker or a careless user would meet it, and asserted refused or clean.

Names follow the issue: D (a command destroys its input), W (wrong or doubled figures),
H (hangs and memory), C (a traceback instead of an error), M (misc. consistency). Each bad
outcome is one error line plus a hint, exit 1 (2 for a usage error), and nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import duckdb
import pytest
from bad_traces import (
    SMALL_CONFIG,
    SPECIAL_OUTPUTS,
    TERMINAL_ESCAPE,
    crafted_databases,
    header,
    ill_typed_traces,
    impossible_configs,
    node_kind,
    requests,
    special_output,
    trace,
    unknown_enum_records,
)
from click.testing import CliRunner
from test_replay_cli import hot_prefix_workload

from kvtrace.cli import cli
from kvtrace.events import BlockRemoved, ReplayInfo, StepStarted
from kvtrace.replay.sweep import _descendants
from kvtrace.traceio import TraceWriter, read_records

KVTRACE = [str(Path(sys.executable).with_name("kvtrace"))]  # the console script


@pytest.fixture(scope="module", autouse=True)
def vllm_imported():
    import vllm.v1.core.kv_cache_manager  # noqa: F401


def run(*args) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_error(result, message: str, code: int = 1) -> None:
    """One ``kvtrace: error:`` line holding ``message`` and one hint, exit ``code``."""
    assert result.exit_code == code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvtrace: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "kvtrace: hint: " in result.stderr and "Traceback" not in result.output


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture
def workload(tmp_path) -> Path:
    return trace(tmp_path / "w.kvtrace", requests())


@pytest.fixture
def replayed(tmp_path, workload) -> Path:
    """A replay output: a trace with captured calls and effects, as lockstep reads one."""
    assert run("replay", workload, "--variant", "fixed", "-o", tmp_path / "runs").exit_code == 0
    return tmp_path / "runs" / "w.fixed.kvtrace"


def cut(path: Path, to: Path) -> Path:
    """``path`` without its closing frame: a writer that was killed."""
    data = path.read_bytes()
    to.write_bytes(data[:len(data) - 40])
    reader, _ = read_records(to)
    assert reader.truncated
    return to


@pytest.fixture
def immutable_dir(tmp_path):
    """A directory nobody, root included, can add to (chattr +i; root ignores modes)."""
    directory = tmp_path / "ro"
    directory.mkdir()
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("chattr +i is not allowed here")
    yield directory
    subprocess.run(["chattr", "-i", str(directory)], check=True)


# --- D: no command destroys its input ------------------------------------------------------


@pytest.mark.parametrize("spelling", ["same", "dot", "link"])
def test_d1_load_onto_its_own_input_is_refused(tmp_path, workload, spelling):
    before = workload.read_bytes()
    output = {"same": workload, "dot": tmp_path / "." / workload.name,
              "link": tmp_path / "link.kvtrace"}[spelling]
    if spelling == "link":
        output.symlink_to(workload)
    assert_error(run("load", workload, "-o", output), "is the input")
    assert workload.read_bytes() == before


def test_d1_replay_db_or_summary_onto_the_source_is_refused(tmp_path, workload):
    before = workload.read_bytes()
    out = tmp_path / "runs"
    assert_error(run("replay", workload, "-o", out, "--db", workload), "--db")
    assert_error(run("replay", workload, "-o", out, "--summary-json", workload), "is the input")
    assert_error(run("replay", workload, "-o", out, "--db", tmp_path / "x.json",
                     "--summary-json", tmp_path / "x.json"), "both name")
    assert workload.read_bytes() == before and not out.exists()


def test_d1_replay_db_onto_a_replay_trace_is_refused(tmp_path, workload, replayed):
    before = replayed.read_bytes()
    assert_error(run("replay", workload, "--variant", "fixed", "-o", replayed.parent,
                     "--db", replayed), "in OUTDIR")
    assert replayed.read_bytes() == before


def test_d1_other_outputs_onto_their_inputs_are_refused(tmp_path, workload):
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


def test_d2_concurrent_loads_into_one_database_all_succeed(tmp_path):
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


def test_d2_two_outputs_to_one_path_stage_under_distinct_names(tmp_path):
    from kvtrace.files import StagedOutput

    first, second = StagedOutput(tmp_path / "x"), StagedOutput(tmp_path / "x")
    assert first.path != second.path
    Path(first.path).write_text("first")
    Path(second.path).write_text("second")
    first.publish()
    second.publish()
    assert [p.name for p in tmp_path.iterdir()] == ["x"] and (tmp_path / "x").read_text() == "second"


# --- W: no figure is doubled or mixed ------------------------------------------------------


def lost_hits(db: Path) -> list[tuple]:
    result = run("sql", db, "--query", "lost_hits_by_prefix", "--json")
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_w1_the_same_trace_loaded_twice_is_loaded_once(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    runs = tmp_path / "runs"
    assert run("replay", source, "-o", runs).exit_code == 0
    once, twice = tmp_path / "once.duckdb", tmp_path / "twice.duckdb"
    assert run("load", runs, "-o", once).exit_code == 0
    result = run("load", runs, runs / "hot.fixed.kvtrace", runs, "-o", twice)
    assert result.exit_code == 0
    assert result.stderr.count("the same content as") == 3
    assert lost_hits(twice) == lost_hits(once) and lost_hits(once)[0]["net_tokens_lost"] > 0
    with duckdb.connect(str(twice), read_only=True) as connection:
        digests = connection.execute("SELECT digest FROM runs").fetchall()
    assert len(digests) == len(set(digests)) == 2


def test_w1b_runs_under_different_engines_are_never_paired(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    for blocks in (140, 1000):
        assert run("replay", source, "-o", tmp_path / f"p{blocks}", "--num-gpu-blocks",
                   blocks).exit_code == 0
    big_only, mixed = tmp_path / "big.duckdb", tmp_path / "mixed.duckdb"
    assert run("load", tmp_path / "p1000", "-o", big_only).exit_code == 0
    # fixed and unfixed at 1000 blocks, plus unfixed at 140: the 140-block run has no partner
    assert run("load", tmp_path / "p1000", tmp_path / "p140" / "hot.unfixed.kvtrace",
               "-o", mixed).exit_code == 0
    assert lost_hits(mixed) == lost_hits(big_only)
    assert sum(row["tokens_lost"] for row in lost_hits(big_only)) == 0
    both = tmp_path / "both.duckdb"
    assert run("load", tmp_path / "p1000", tmp_path / "p140", "-o", both).exit_code == 0
    pairs = {(row["fixed_run"], row["unfixed_run"]) for row in lost_hits(both)}
    assert pairs == {(0, 1), (2, 3)}  # each pool size with itself


@pytest.mark.parametrize("lockstep", [False, True])
def test_w2_a_truncated_source_is_replayed_with_a_warning(tmp_path, replayed, lockstep):
    source = cut(replayed, tmp_path / "cut.kvtrace")
    result = run("replay", source, *(["--lockstep"] if lockstep else []), "--variant", "fixed",
                 "-o", tmp_path / "again")
    assert result.exit_code == 0
    assert "kvtrace: warning:" in result.stderr and "is truncated" in result.stderr
    assert ("only the calls" if lockstep else "only the requests") in result.stderr


@pytest.mark.parametrize("rows", [False, True], ids=["columns", "rows"])
def test_w3_unknown_enum_values_are_kept_warned_and_read_past(tmp_path, rows):
    records = requests(2) + unknown_enum_records() + [StepStarted(step=9, ts_ns=0)]
    path = tmp_path / "newer.kvtrace"
    with TraceWriter(path, header(), rows=rows) as writer:
        writer.write_many(records)
    result = run("cat", path)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == len(records) and lines[-1]["record"] == "step_started"
    assert [line.get("reason") for line in lines if line["record"] == "block_removed"] == [
        "9", "LRU_REUSE"]
    assert result.stderr.count("kvtrace: warning:") == 2  # one per field, not per record
    assert "reason this kvtrace does not know (9: 1)" in result.stderr
    info = run("info", path)
    assert info.exit_code == 0 and "kind this kvtrace does not know (7: 1)" in info.stdout
    db = tmp_path / "newer.duckdb"
    loaded = run("load", path, "-o", db)
    assert loaded.exit_code == 0 and "reason this kvtrace does not know" in loaded.stderr
    with duckdb.connect(str(db), read_only=True) as connection:
        assert connection.execute("SELECT reason FROM block_removed ORDER BY seq").fetchall() == [
            ("9",), ("LRU_REUSE",)]
        assert connection.execute("SELECT kind FROM block_stored ORDER BY seq").fetchall() == [
            ("FULL",), ("7",)]
    assert [r.reason for r in read_records(path)[1] if type(r) is BlockRemoved] == [9, 0]


# --- H: nothing hangs or runs out of memory ------------------------------------------------


def test_h1_replay_of_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "w.kvtrace"
    os.mkfifo(fifo)
    done = subprocess.run([*KVTRACE, "replay", str(fifo), "-o", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "is not a regular file" in done.stderr


@pytest.mark.parametrize("flag, value", [("--rate", "inf"), ("--rate", "nan"),
                                         ("--rate", "1e-300"), ("--zipf", "nan"),
                                         ("--length-sigma", "nan"), ("--think-time", "inf"),
                                         ("--max-prompt-len", "1000000000000"),
                                         ("--requests", str(10**25)),
                                         ("--system-prompts", str(10**12))])
def test_h2_synth_refuses_numbers_it_cannot_draw_from(tmp_path, flag, value):
    done = subprocess.run([*KVTRACE, "synth", "--preset", "chat", "--requests", "5", flag, value,
                           "-o", str(tmp_path / "w.kvtrace")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("kvtrace: error:"), done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", [["synth", "--preset", "chat", "--requests", "2"],
                                     ["import", "mooncake", "LOG"]])
@pytest.mark.parametrize("groups", [2**63, 10**6])
def test_h2_mamba_groups_beyond_any_engine_are_refused(tmp_path, command, groups):
    """A what-if geometry is built as a list of groups: 2**63 overflowed it, 10**6 filled
    memory with managers."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n')
    command = [log if arg == "LOG" else arg for arg in command]
    assert_error(run(*command, "--mamba-groups", groups, "--allow-unreal-geometry",
                     "-o", tmp_path / "w.kvtrace"), "--mamba-groups must be from 1 to 255")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


def test_h3_a_pool_this_machine_cannot_hold_is_refused_with_the_figure(tmp_path, workload):
    result = run("replay", workload, "--num-gpu-blocks", 10**12, "-o", tmp_path / "runs")
    assert_error(result, "a pool of 1,000,000,000,000 blocks needs about 232.8 TiB")
    assert "this machine has available" in result.stderr


def test_h3_an_impossibly_long_imported_request_is_refused(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 0, "input_length": 20, "output_length": 9223372036854775807, '
                   '"hash_ids": [1]}\n')
    assert_error(run("import", "mooncake", log, "-o", tmp_path / "m.kvtrace"),
                 "request line-1 has 9,223,372,036,854,775,827 tokens, more than the")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


def test_h3_the_memory_rule_covers_the_real_vllm_pool():
    """REPLAY_BYTES_PER_BLOCK against vLLM's own pool: building it costs less than the
    figure (which leaves room for a keyed block's prefix-cache entry), and not far less."""
    import msgspec

    from kvtrace.engine_config import REPLAY_BYTES_PER_BLOCK
    from kvtrace.replay.backend import open_backend

    num_blocks = 200_000
    config = msgspec.structs.replace(SMALL_CONFIG, num_gpu_blocks=num_blocks)
    tracemalloc.start()
    try:
        with open_backend("vllm", config, "fixed", lambda record: None):
            per_block = tracemalloc.get_traced_memory()[0] / num_blocks
    finally:
        tracemalloc.stop()
    assert REPLAY_BYTES_PER_BLOCK / 3 < per_block < REPLAY_BYTES_PER_BLOCK - 64, per_block


def test_h3_an_execute_state_pool_this_machine_cannot_hold_is_refused(tmp_path, workload):
    """The state pool was allocated as asked: 10**5 blocks at full scale failed inside torch."""
    result = run("replay", workload, "--execute", "--model", "kimi-linear-48b-a3b", "--device",
                 "cpu", "--state-scale", "1", "--num-gpu-blocks", 10**5, "-o", tmp_path / "runs")
    assert_error(result, "--execute's state pool of 100,000 blocks at state scale 1 needs about")
    assert "this machine has available" in result.stderr
    assert not list((tmp_path / "runs").iterdir())


def test_h4_the_source_is_streamed_into_compact_arrivals(tmp_path):
    from kvtrace.events import RequestArrived
    from kvtrace.replay.source import read_source

    num_requests, units = 2000, 100
    path = tmp_path / "wide.kvtrace"
    with TraceWriter(path, header()) as writer:
        writer.write_many(RequestArrived(req=r, prompt_len=units * 16, max_tokens=1,
                                         hash_ids=list(range(r * units + 1000, (r + 1) * units + 1000)))
                          for r in range(num_requests))
    tracemalloc.start()
    try:
        source = read_source(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(source.arrivals) == num_requests
    # Records with int lists cost 36+ bytes an id, twice over with the arrivals' copies.
    assert peak / (num_requests * units) < 30


def test_h4_the_engine_is_checked_before_the_records_are_read(tmp_path, workload):
    damaged = tmp_path / "damaged.kvtrace"
    data = bytearray(workload.read_bytes())
    data[-60] ^= 0xFF  # a byte of the records frame: its checksum fails when read
    damaged.write_bytes(bytes(data))
    assert_error(run("replay", damaged, "--num-gpu-blocks", 1, "-o", tmp_path / "runs"),
                 "num_gpu_blocks is 1")


def test_h_sweep_on_a_ray_address_where_nothing_listens_fails_at_once(tmp_path, workload):
    """Ray itself retried such an address for minutes (still retrying after 4)."""
    import socket

    with socket.socket() as closed:  # bound, never listening: a connection is refused
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        done = subprocess.run([*KVTRACE, "sweep", str(workload), "--num-gpu-blocks", "300",
                               "--ray", address, "-o", str(tmp_path / "sweep")],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"kvtrace: error: cannot connect to Ray at {address}: nothing answers" in done.stderr


# --- C: one error line, never a traceback --------------------------------------------------


def test_c1_replay_into_proc_or_a_read_only_directory(tmp_path, workload, immutable_dir):
    assert_error(run("replay", workload, "-o", "/proc/kvtrace-runs"), "cannot write")
    assert_error(run("replay", workload, "-o", immutable_dir), "cannot write")
    assert_error(run("replay", workload, "-o", immutable_dir / "runs"), "cannot write")
    assert list(immutable_dir.iterdir()) == []


def test_c2_load_into_a_missing_or_read_only_directory(tmp_path, workload, immutable_dir):
    assert_error(run("load", workload, "-o", tmp_path / "missing" / "w.duckdb"), "cannot write")
    assert_error(run("load", workload, "-o", immutable_dir / "w.duckdb"), "cannot write")
    assert_error(run("load", workload, "-o", "/proc/w.duckdb"), "cannot write")


def test_c3_report_html_to_a_path_it_cannot_write(tmp_path, workload):
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    assert_error(run("report", db, "--html", "/proc/report.html"), "cannot write")
    assert_error(run("report", db, "--html", tmp_path / "no" / "report.html"), "cannot write")


@pytest.mark.parametrize("statement", ["", "   ", "\n"])
def test_c4_an_empty_sql_statement(tmp_path, workload, statement):
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    assert_error(run("sql", db, statement), "empty")


@pytest.mark.parametrize("retention", ["99999999999999999999999", str(64 * 10**21)])
def test_c5_a_retention_beyond_64_bits(tmp_path, workload, retention):
    assert_error(run("replay", workload, "--retention", retention, "-o", tmp_path / "runs"),
                 "retention")
    assert not (tmp_path / "runs").exists()


def test_c6_an_imported_timestamp_beyond_the_clock_leaves_nothing(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 9223372036854775807, "input_length": 20, "output_length": 2, '
                   '"hash_ids": [1]}\n')
    assert_error(run("import", "mooncake", log, "-o", tmp_path / "m.kvtrace"),
                 "outside a trace's 64-bit clock")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


def test_c6_a_writer_that_fails_while_closing_leaves_nothing(tmp_path):
    with pytest.raises(OverflowError), TraceWriter(tmp_path / "t.kvtrace", header(),
                                                   atomic=True) as writer:
        writer.write(StepStarted(step=2**64, ts_ns=0))  # encoded only when closing
    assert list(tmp_path.iterdir()) == []


def test_c7_cat_to_a_full_device(tmp_path, workload):
    with open("/dev/full", "w") as full:
        done = subprocess.run([*KVTRACE, "cat", str(workload)], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[0] == ("kvtrace: error: cannot write to standard output: "
                                           "No space left on device"), done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


# --- M: clean-up and consistent checks -----------------------------------------------------


@pytest.mark.slow
def test_m1_sigterm_during_replay_leaves_no_partial_output(tmp_path):
    source = trace(tmp_path / "big.kvtrace", requests(3000))
    out = tmp_path / "runs"
    process = subprocess.Popen([*KVTRACE, "replay", str(source), "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and any(out.iterdir())):  # a variant is being written
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in process.stderr.read()
    assert list(out.iterdir()) == []


def test_m2_an_unwritable_summary_is_refused_before_any_replay(tmp_path, workload):
    out = tmp_path / "runs"
    assert_error(run("replay", workload, "-o", out, "--summary-json",
                     tmp_path / "missing" / "s.json"), "cannot write")
    assert not out.exists()


def test_m2_a_summary_or_database_in_the_outdir_to_be_made_is_written(tmp_path, workload):
    """The early check refused these: OUTDIR did not exist yet, and the replay makes it."""
    out = tmp_path / "runs"
    result = run("replay", workload, "-o", out, "--summary-json", out / "s.json",
                 "--db", out / "w.duckdb")
    assert result.exit_code == 0, result.output
    assert (out / "s.json").is_file() and (out / "w.duckdb").is_file()


def test_m3_capture_duration_zero_is_refused_either_way():
    for source in (["--pid", str(1 << 22)], ["--zmq", "tcp://127.0.0.1:1"]):
        result = run("capture", *source, "--duration", "0", "-o", "/tmp/never.kvtrace")
        assert result.exit_code == 2 and "not a positive duration" in result.stderr


def test_m3_report_bucket_steps_must_be_positive(tmp_path, workload):
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    result = run("report", db, "--bucket-steps", 0)
    assert result.exit_code == 2 and "Division" not in result.output


def test_m3_synth_and_replay_share_the_retention_rule(tmp_path, workload):
    synth = run("synth", "--preset", "chat", "--requests", 5, "--retention-interval", 7,
                "-o", tmp_path / "s.kvtrace")
    replay = run("replay", workload, "--retention", 7, "-o", tmp_path / "runs")
    assert synth.exit_code == replay.exit_code == 1
    assert "retention interval 7 is not 0 or a multiple" in synth.stderr
    assert "retention interval 7 is not 0 or a multiple" in replay.stderr


# --- traces whose frames are sound but whose contents are not ----------------------------


COMMANDS_ON_A_TRACE = {
    "info": lambda path, tmp: ["info", path],
    "cat": lambda path, tmp: ["cat", path],
    "load": lambda path, tmp: ["load", path, "-o", tmp / "x.duckdb"],
    "replay": lambda path, tmp: ["replay", path, "-o", tmp / "runs"],
    "replay --backend model": lambda path, tmp: ["replay", path, "--backend", "model",
                                                 "-o", tmp / "runs"],
    "why": lambda path, tmp: ["why", path, "--request", "0"],
    "sweep": lambda path, tmp: ["sweep", path, "--num-gpu-blocks", "300", "-j", "1",
                                "-o", tmp / "sweep"],
    "engine": lambda path, tmp: ["engine", path, "--autostart", "--speed", "0"],
}


@pytest.mark.parametrize("command", COMMANDS_ON_A_TRACE)
def test_ill_typed_contents_are_one_error_in_every_command(tmp_path, command):
    for name, path in ill_typed_traces(tmp_path).items():
        result = run(*COMMANDS_ON_A_TRACE[command](path, tmp_path))
        assert_error(result, str(path))
        assert not (tmp_path / "runs").exists() and not (tmp_path / "x.duckdb").exists(), name


@pytest.mark.parametrize("command", COMMANDS_ON_A_TRACE)
def test_impossible_configs_are_one_error_where_the_config_is_used(tmp_path, command):
    for name, config in impossible_configs().items():
        path = trace(tmp_path / f"{name.replace(' ', '_')}.kvtrace", requests(), header(config))
        result = run(*COMMANDS_ON_A_TRACE[command](path, tmp_path))
        if command in ("info", "cat"):  # they show the header as it is
            assert result.exit_code == 0, (name, result.output)
            if command == "info":
                assert "its engine config cannot be replayed" in result.stdout, name
        elif command.split()[0] in ("replay", "sweep", "engine") or name not in ("unknown group kind",
                                                                      "huge pool"):
            assert result.exit_code == 1 and result.stderr.count("kvtrace: error:") == 1, (
                name, result.output)
        assert "Traceback" not in result.output


def test_impossible_captured_calls_are_one_error_in_lockstep(tmp_path, replayed):
    from kvtrace.events import RequestFinished

    reader, records = read_records(replayed)
    records.insert(5, RequestFinished(req=12345, status=0))  # a request never added
    path = tmp_path / "impossible.kvtrace"
    with TraceWriter(path, reader.header) as writer:
        writer.write_many(records)
    assert_error(run("replay", path, "--lockstep", "--variant", "fixed", "-o", tmp_path / "x"),
                 "cannot be re-issued")


def test_impossible_requests_are_one_error(tmp_path):
    from kvtrace.events import RequestArrived

    for arrival in (RequestArrived(req=0, prompt_len=0, hash_ids=[], max_tokens=3),
                    RequestArrived(req=0, prompt_len=16, hash_ids=[1], max_tokens=-4),
                    RequestArrived(req=0, prompt_len=2**40, hash_ids=[], max_tokens=1),
                    RequestArrived(req=0, prompt_len=160, hash_ids=[1, 2], max_tokens=1)):
        path = trace(tmp_path / "r.kvtrace", [arrival])
        for command in ("replay", "replay --backend model", "sweep", "engine"):
            result = run(*COMMANDS_ON_A_TRACE[command](path, tmp_path))
            assert_error(result, "request 0")


@pytest.mark.parametrize("version", ["x2", "", "-1", "2.0"])
def test_a_damaged_schema_version_row_is_one_error(tmp_path, workload, version):
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    with duckdb.connect(str(db)) as connection:
        connection.execute("UPDATE kvtrace_meta SET value = ? WHERE key = 'db_schema_version'",
                           [version])
    for args in (["sql", db, "SELECT 1"], ["report", db], ["why", db, "-r", "0"],
                 ["export", db, "--parquet", tmp_path / "parquet"]):
        assert_error(run(*args), "schema version")


def test_a_database_without_kvtrace_columns_is_one_error(tmp_path):
    db = tmp_path / "other.duckdb"
    with duckdb.connect(str(db)) as connection:
        connection.execute("CREATE TABLE kvtrace_meta (k INTEGER)")
    assert_error(run("sql", db, "SELECT 1"), "not a kvtrace forensics database")


# --- h22: issue #24 items 8 (load's memory) and 9 (records the header contradicts) -------------
# (a block of its own, apart from the rest of this suite, to ease merging)

from kvtrace.events import (  # noqa: E402 (this block's own)
    BlockAllocated,
    BlockStored,
    CheckpointClass,
    CheckpointRecorded,
    RemoveReason,
    StoreKind,
)


def one_record_frames(path: Path, count: int) -> Path:
    """A trace of ``count`` frames of one record each (a writer flushing every record)."""
    with TraceWriter(path, header(), batch_size=1) as writer:
        for index in range(count):
            writer.write(BlockAllocated(1 + index % 150, index // 8))
    return path


def test_h8_loading_many_one_record_frames_holds_bounded_memory(tmp_path):
    """#24 item 8: a million one-record frames took 3.6 GB (a numpy chunk kept per frame). Rows
    now gather in fixed-size column buffers: the load's peak memory is that of a process that
    loads a small trace, whatever the number of frames (200,000 frames would have taken about
    720 MB)."""
    peaks = {}
    for count in (2_000, 200_000):
        path = one_record_frames(tmp_path / f"one{count}.kvtrace", count)
        child = subprocess.run(
            [sys.executable, "-c", "import resource, sys; from kvtrace.cli import main; "
             "sys.argv = ['kvtrace', 'load', sys.argv[1], '-o', sys.argv[2]]\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
             str(path), str(tmp_path / f"one{count}.duckdb")],
            capture_output=True, text=True, check=True)
        assert f"loaded {count} records" in child.stdout, child.stdout + child.stderr
        peaks[count] = int(child.stdout.split()[-1]) * 1024
    assert peaks[200_000] < peaks[2_000] + 100 * 2**20, peaks


@pytest.mark.parametrize("core", ["C core", "Python twins"])
@pytest.mark.parametrize("group", [2, 7, -1])
def test_h9_a_record_naming_a_group_the_header_lacks_is_refused(tmp_path, monkeypatch, core,
                                                                  group):
    """#24 item 9: a group id past the header's groups was an IndexError traceback in load and
    why; a negative one was attributed to the wrong group (Python's negative indexing). Both
    are refused, with the record and the groups the header has."""
    from kvtrace.analysis import stream

    if core == "C core" and stream.core is None:
        pytest.skip("kvtrace's C core is not built here (no C compiler at install)")
    if core == "Python twins":
        monkeypatch.setattr(stream, "core", None)
    path = trace(tmp_path / "bad.kvtrace", [
        StepStarted(0, 0), BlockAllocated(3, 0),
        BlockStored(block_id=3, hash_id=5, group=group, num_tokens=16, kind=StoreKind.FULL,
                    req=0)])
    message = (f"record 2 (block_stored) names KV-cache group {group}, but the header has 2 "
               "groups (0 to 1)")
    assert_error(run("load", path, "-o", tmp_path / "bad.duckdb"), message)
    assert not (tmp_path / "bad.duckdb").exists()
    assert_error(run("why", path, "-r", "0"), message)


def test_h9_a_checkpoint_or_a_removal_naming_a_group_the_header_lacks_is_refused(tmp_path):
    for record, kind in ((BlockRemoved(3, 5, 4, 16, RemoveReason.LRU_REUSE), "block_removed"),
                         (CheckpointRecorded(0, -2, 16, 0, CheckpointClass.TRANSIENT),
                          "checkpoint_recorded")):
        path = trace(tmp_path / f"{kind}.kvtrace", [StepStarted(0, 0), record])
        assert_error(run("load", path, "-o", tmp_path / "bad.duckdb"),
                     f"record 1 ({kind}) names KV-cache group")
# --- Round three (issue "Hardening, round three"): R1-R13 ----------------------------------


@pytest.fixture
def loaded(tmp_path, workload) -> Path:
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    return db


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


@pytest.mark.parametrize("kind", SPECIAL_OUTPUTS)
def test_r1_outputs_never_replace_a_device_a_link_a_fifo_or_a_socket(tmp_path, workload,
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


def test_r1_export_never_replaces_a_link(tmp_path, loaded):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    (tmp_path / "exports").symlink_to(elsewhere)
    assert_error(run("export", loaded, "--parquet", tmp_path / "exports", "--overwrite"),
                 "is a symbolic link")
    assert (tmp_path / "exports").is_symlink() and (elsewhere / "keep").read_text() == "x"


def test_r2_export_quotes_table_names_and_writes_only_its_own_directory(tmp_path, loaded):
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    crafted = crafted_databases(tmp_path, loaded, secret)
    assert_error(run("export", crafted["table named as SQL"], "--parquet", tmp_path / "pq"),
                 "cannot be a directory name")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pq").exists()
    result = run("export", crafted["partition value as a path"], "--parquet", tmp_path / "pq")
    assert result.exit_code == 0, result.output
    assert not Path("/tmp/kvtrace-hop").exists()
    hop = list((tmp_path / "pq" / "hop").iterdir())
    assert len(hop) == 1 and hop[0].name.startswith("run=..%2F")  # DuckDB escapes the value


def test_r2_an_identifier_is_quoted_whatever_it_holds(tmp_path):
    """The quoting export uses, against DuckDB itself: the issue's table name stays a name."""
    from kvtrace.analysis.sql_access import sql_identifier

    name = ('x"; COPY x TO (chr(47)||\'' + str(tmp_path).lstrip("/") + "'||chr(47)||'pwned') "
            '(FORMAT CSV); SELECT count(*) FROM "x')
    with duckdb.connect() as connection:
        connection.execute(f"CREATE TABLE {sql_identifier(name)} (a INTEGER)")
        connection.execute(f"INSERT INTO {sql_identifier(name)} VALUES (7)")
        assert connection.execute(f"SELECT sum(a) FROM {sql_identifier(name)}").fetchall() == [
            (7,)]
        assert connection.execute("SHOW TABLES").fetchall() == [(name,)]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("statement", [
    "COPY runs TO '{out}' (FORMAT CSV)",
    "SELECT * FROM read_text('{secret}')",
    "SELECT * FROM read_csv('{secret}')",
    "SELECT * FROM glob('{dir}/*')",
    "ATTACH '{out}' AS other",
    "EXPORT DATABASE '{dir}/exported'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SET allowed_directories = ['/']",
])
def test_r3_sql_reaches_nothing_but_the_database(tmp_path, loaded, statement):
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    sql = statement.format(out=tmp_path / "out.csv", secret=secret, dir=tmp_path)
    result = run("sql", loaded, sql)
    assert result.exit_code == 1 and "root's secret" not in result.output, result.output
    assert "Traceback" not in result.output and result.stderr.count("kvtrace: error:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret", "w.duckdb", "w.kvtrace"]


def test_r3_unsafe_lifts_the_limits(tmp_path, loaded):
    secret = tmp_path / "secret"
    secret.write_text("readable\n")
    refused = run("sql", loaded, f"SELECT content FROM read_text('{secret}')")
    assert_error(refused, "disabled by configuration")
    assert "--unsafe lifts that" in refused.stderr
    result = run("sql", "--unsafe", loaded, f"SELECT content FROM read_text('{secret}')")
    assert result.exit_code == 0 and "readable" in result.stdout
    assert run("sql", "--unsafe", loaded,
               f"COPY runs TO '{tmp_path / 'runs.csv'}'").exit_code == 0
    assert (tmp_path / "runs.csv").read_text().startswith("run,")


def test_r3_a_databases_views_read_no_file_in_report_why_or_export(tmp_path, loaded):
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    crafted = crafted_databases(tmp_path, loaded, secret)["a view that reads a file"]
    for args in (["report", crafted], ["sql", crafted, "--query", "miss_attribution"],
                 ["sql", crafted, "SELECT * FROM lookups"], ["why", crafted, "-r", "0"],
                 ["export", crafted, "--parquet", tmp_path / "pq"]):
        result = run(*args)
        assert_error(result, "disabled by configuration")
        assert "root's secret" not in result.output, args
    assert not (tmp_path / "pq").exists()


def sweep_process(source: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*KVTRACE, "sweep", str(source), "--backend", "vllm",
                             "--pool-fraction", "0.05,0.1,0.15,0.2,0.25,0.3", "-o", str(out),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


def gone(pids: list[int], within: float = 15.0) -> bool:
    """Whether every pid exited (a zombie waiting for its reaper counts) within ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def mooncake_workload(tmp_path_factory) -> Path:
    from third_party_data import MOONCAKE_SYNTHETIC

    path = tmp_path_factory.mktemp("mooncake") / "m.kvtrace"
    assert run("import", "mooncake", MOONCAKE_SYNTHETIC, "-o", path).exit_code == 0
    return path


@pytest.mark.slow
@pytest.mark.parametrize("stop, after", [(signal.SIGTERM, 0.0), (signal.SIGTERM, 1.0),
                                         (signal.SIGINT, 0.5), (signal.SIGKILL, 1.0)])
def test_r4_sweep_workers_stop_with_the_sweep(tmp_path, mooncake_workload, stop, after):
    """SIGTERM was swallowed when it landed while workers were forked (the sweep finished and
    exited 0), and a SIGKILLed sweep left its workers blocked at 430 MB each, forever."""
    process = sweep_process(mooncake_workload, tmp_path / "sweep", "-j", "2")
    deadline = time.monotonic() + 300
    while len(workers := _descendants(process.pid)) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.01)
    time.sleep(after)
    if stop == signal.SIGINT:  # Ctrl-C: the terminal signals the whole process group
        os.killpg(process.pid, stop)
    else:
        process.send_signal(stop)
    code = process.wait(60)
    assert gone(workers), f"workers {workers} outlived the sweep"
    if stop != signal.SIGKILL:
        assert code == 128 + stop
        assert process.stderr.read().splitlines()[-1] == (
            f"kvtrace: stopped by {signal.Signals(stop).name}")
    assert not (tmp_path / "sweep").exists() or not list((tmp_path / "sweep").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("when", ["connecting", "running"])
def test_r4_sweep_on_a_local_ray_stops_with_its_instance(tmp_path, when):
    """A SIGTERM while Ray's driver connected (just after "Started a local Ray instance") was
    raised inside ``ray.init``: the sweep said "stopped by SIGTERM", then died of SIGABRT
    (absl's alarm) or SIGSEGV (a timer of the half-built core worker)."""
    pytest.importorskip("ray", reason="Ray is optional (pip install 'kvtrace[ray]')")
    source = trace(tmp_path / "big.kvtrace", requests(3000))
    process = sweep_process(source, tmp_path / "sweep", "--ray", "local", "-j", "2")
    said = []
    if when == "connecting":
        for line in iter(process.stderr.readline, ""):
            said.append(line)
            if "Started a local Ray instance" in line:
                break
        assert "Started a local Ray instance" in said[-1], "".join(said)
        time.sleep(0.1)
    else:
        deadline = time.monotonic() + 300
        while not any("raylet" in command_line(pid) for pid in _descendants(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.2)
        time.sleep(2)  # Ray still starting, or running the tasks
    ray_processes = _descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 128 + signal.SIGTERM
    assert "kvtrace: stopped by SIGTERM" in "".join(said) + process.stderr.read()
    assert gone(ray_processes, within=30), "the local Ray instance outlived the sweep"


def test_r4_sweep_on_a_ray_client_address_where_nothing_listens_fails_at_once(tmp_path,
                                                                              workload):
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"ray://127.0.0.1:{closed.getsockname()[1]}"
        started = time.monotonic()
        done = subprocess.run([*KVTRACE, "sweep", str(workload), "--num-gpu-blocks", "300",
                               "--ray", address, "-o", str(tmp_path / "sweep")],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "nothing answers" in done.stderr
    assert time.monotonic() - started < 25  # Ray's client retried for 31 s


def test_r5_sweep_never_writes_over_its_source_or_one_file_twice(tmp_path, workload):
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


def test_r5_a_database_replaced_meanwhile_keeps_rows_a_sweep_added(tmp_path, workload, loaded):
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


@pytest.mark.slow
def test_r5_a_concurrent_load_and_sweep_lose_no_sweep(tmp_path, workload):
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


@pytest.fixture
def full_disk(tmp_path):
    """A small file system (tmpfs), filled up: every write there fails with ENOSPC."""
    mount = tmp_path / "full"
    mount.mkdir()
    if os.getuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs",
                                           str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(mount: Path) -> None:
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    with open(mount / "filler", "wb") as filler:
        os.posix_fallocate(filler.fileno(), 0, free)


def test_r6_a_full_disk_is_one_error_and_leaves_no_scratch(tmp_path, workload, loaded,
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


def test_r6_an_abandoned_writer_removes_its_scratch_even_when_its_tail_cannot_be_written(
        full_disk):
    fill(full_disk)
    with pytest.raises(OSError), TraceWriter(full_disk / "t.kvtrace", header(),
                                             atomic=True) as writer:
        writer.write_many(StepStarted(step=i, ts_ns=i) for i in range(100_000))
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_r7_a_stop_during_a_duckdb_query_exits_as_the_signal_says(tmp_path, loaded, stop):
    """DuckDB turned the stop into "RuntimeError: Query interrupted": a traceback, exit 1."""
    process = subprocess.Popen(
        [*KVTRACE, "sql", str(loaded), "SELECT sum(hash(range) % 7) FROM range(10000000000000)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while threads(process.pid) < 3:  # DuckDB's workers: connected, the query next
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1)
    process.send_signal(stop)
    out, err = process.communicate(timeout=30)  # DuckDB's workers are interrupted too
    assert process.returncode == 128 + stop
    assert err == f"kvtrace: stopped by {signal.Signals(stop).name}\n" and not out


def threads(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/status").read_text().split("Threads:")[1].split()[0])
    except (OSError, IndexError):
        return 0


def test_r8_import_reads_a_line_without_end_in_bounded_memory(tmp_path):
    """/dev/zero raised MemoryError; an 889 MB line took 4.8 GB before it was refused."""
    import resource

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = subprocess.run([*KVTRACE, "import", "mooncake", "/dev/zero", "-o",
                           str(tmp_path / "z.kvtrace")], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit_memory)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("kvtrace: error: /dev/zero, line 1: longer than 64 MiB")
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


def test_r8_a_long_line_is_refused_by_its_number(tmp_path):
    log = tmp_path / "log.jsonl"
    with open(log, "w") as file:
        file.write('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n')
        file.write('{"timestamp": 1, "input_length": 20, "output_length": 2, "hash_ids": [1'
                   + ", 1" * (23 << 20) + "]}\n")
    assert_error(run("import", "mooncake", log, "-o", tmp_path / "m.kvtrace"),
                 "line 2: longer than 64 MiB")


def test_r8_the_engines_stdin_reader_skips_a_line_without_end():
    import io
    import queue

    from kvtrace.engine.core import COMMAND_LINE_BYTES, END_OF_INPUT, START, read_commands

    commands: queue.Queue[str] = queue.Queue()
    complaints: list[str] = []
    endless = b"\0" * (10 * COMMAND_LINE_BYTES)
    read_commands(io.BytesIO(endless + b"start\nstart\n" + endless).read, commands,
                  complaints.append)
    assert [commands.get_nowait() for _ in range(commands.qsize())] == [START, END_OF_INPUT]
    assert complaints == [f"a line longer than {COMMAND_LINE_BYTES} bytes, skipped (send start "
                          "or quit)"] * 2


@pytest.mark.slow
def test_r8_an_engine_reading_dev_zero_stays_small(workload):
    """stdin lines were read whole: 8.3 GB in 30 s."""
    with open("/dev/zero", "rb") as zero:
        engine = subprocess.Popen([*KVTRACE, "engine", str(workload)], stdin=zero,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "ready" in engine.stdout.readline()

        def rss() -> int:
            status = Path(f"/proc/{engine.pid}/status").read_text()
            return int(status.split("VmRSS:")[1].split()[0]) << 10

        first = rss()
        time.sleep(3)
        assert rss() - first < 64 << 20
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(60) == 0
        assert engine.stderr.read().count("a line longer than") == 1
    finally:
        engine.kill()


def test_r10_strings_that_drive_a_terminal_are_shown_inert(tmp_path, replayed):
    path = trace(tmp_path / "escape.kvtrace", requests(), header(
        host=TERMINAL_ESCAPE, process_title=TERMINAL_ESCAPE, pid=7, params={"x": TERMINAL_ESCAPE},
        replay=ReplayInfo(variant="fixed" + TERMINAL_ESCAPE, backend="vllm", mode="reschedule")))
    secret = tmp_path / "secret"
    secret.write_text("")
    loaded = tmp_path / "replayed.duckdb"
    assert run("load", replayed, "-o", loaded).exit_code == 0
    crafted = crafted_databases(tmp_path, loaded, secret)
    outputs = [run("info", path), run("load", path, "-o", tmp_path / "e.duckdb"),
               run("report", crafted["strings that drive a terminal"]),
               run("sql", crafted["strings that drive a terminal"], "SELECT variant FROM runs"),
               run("sql", crafted["strings that drive a terminal"], "SELECT variant FROM runs",
                   "--csv"),
               run("sql", crafted["columns named as SQL"], "SELECT * FROM odd"),
               run("info", tmp_path / f"missing{TERMINAL_ESCAPE}.kvtrace")]
    for result in outputs:
        assert result.exit_code in (0, 1), result.output
        assert not any(c in result.output for c in "\x1b\x07\u202e"), repr(result.output)
    assert r"\x1b]0;pwned\x07" in outputs[0].stdout and r"\x1b]0;pwned" in outputs[2].stdout
    assert r"\x1b" in outputs[-1].stderr  # an error line quoting the path


@pytest.mark.parametrize("case, message", [("runs.path a FIFO", "not a regular file"),
                                           ("runs.path NULL", "without a trace path")])
def test_r10_why_reads_no_fifo_a_database_names(tmp_path, loaded, case, message):
    secret = tmp_path / "secret"
    secret.write_text("")
    crafted = crafted_databases(tmp_path, loaded, secret)[case]
    done = subprocess.run([*KVTRACE, "why", str(crafted), "-r", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_r11_an_engine_at_a_speed_that_never_arrives_quits_cleanly(workload):
    engine = subprocess.Popen([*KVTRACE, "engine", str(workload), "--speed", "1e-300",
                               "--autostart"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        lines = [engine.stdout.readline() for _ in range(2)]
        assert "running" in lines[1], lines
        time.sleep(1)
        out, err = engine.communicate("quit\n", timeout=60)
        assert engine.returncode == 0 and "exiting (quit)" in out, err
        assert "Traceback" not in err and "OverflowError" not in err
    finally:
        engine.kill()


@pytest.mark.parametrize("command", ["info", "cat", "replay", "load", "why"])
def test_r11_a_trace_that_fails_to_read_is_one_error(tmp_path, command):
    args = {"info": [], "cat": [], "replay": ["-o", tmp_path / "r"],
            "load": ["-o", tmp_path / "x.duckdb"], "why": ["-r", "0"]}[command]
    result = run(command, "/proc/self/mem", *args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "/proc/self/mem" in result.stderr and "Input/output error" in result.stderr


def test_r11_export_onto_the_working_directory_is_refused(tmp_path, loaded, monkeypatch):
    exports = tmp_path / "exports"
    exports.mkdir()
    (exports / "old").write_text("kept")
    monkeypatch.chdir(exports)
    assert_error(run("export", loaded, "--parquet", ".", "--overwrite"),
                 "holds the working directory")
    monkeypatch.chdir(tmp_path)
    assert (exports / "old").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports", "w.duckdb", "w.kvtrace"]


def test_r11_export_onto_a_mount_point_keeps_it_and_leaves_no_old(tmp_path, loaded, full_disk):
    (full_disk / "old").write_text("kept")
    result = run("export", loaded, "--parquet", full_disk, "--overwrite")
    assert_error(result, "cannot write")
    assert (full_disk / "old").read_text() == "kept"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".full.")]


def model_config(tmp_path: Path, preset: str, **changes) -> Path:
    from kvtrace.geometry.presets import PRESET_DIR

    config = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    config.pop("_source")
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / f"{preset}.config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("preset, tp, field", [("nemotron-h-8b", 1, "n_groups"),
                                               ("qwen3-next-80b-a3b", 2, "linear_num_value_heads")])
def test_r11_a_config_without_a_defaulted_field_takes_the_config_class_default(
        tmp_path, preset, tp, field):
    """The presets set these fields to their HF config class's defaults: leaving them out
    gives the same geometry (it was a KeyError in weights.py)."""
    from kvtrace.geometry import compute_geometry
    from kvtrace.geometry.bundled import geometry_for

    lacking = compute_geometry(model_config(tmp_path, preset, **{field: None}),
                               tensor_parallel_size=tp, cache_dir=tmp_path / "cache")
    shipped = geometry_for(preset, tp)
    assert (lacking.num_gpu_blocks, lacking.block_size, lacking.memory, lacking.groups) == (
        shipped.num_gpu_blocks, shipped.block_size, shipped.memory, shipped.groups)


@pytest.mark.slow
def test_r11_a_config_field_of_the_wrong_type_is_one_error(tmp_path):
    path = model_config(tmp_path, "qwen3-next-80b-a3b", num_hidden_layers="eight")
    done = subprocess.run([*KVTRACE, "geometry", "--model", str(path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "KVTRACE_GEOMETRY_CACHE": "0"})
    assert done.returncode == 1
    assert "kvtrace: error: vLLM 0.33 rejects" in done.stderr
    assert "'num_hidden_layers' expected int, got str (value: 'eight')" in done.stderr
    assert "Traceback" not in done.stderr and "retrying" not in done.stderr


@pytest.mark.slow
def test_r12_an_fp8_cache_for_flash_attention_is_what_an_h200_builds(tmp_path):
    """FA3 takes fp8 on an H200; this CPU host has no flash-attn, so vLLM's own check refused
    it here. The fp8 page halves the attention bytes, so the block doubles."""
    from kvtrace.geometry import compute_geometry

    auto = compute_geometry("nemotron-h-8b", cache_dir=tmp_path)
    fp8 = compute_geometry("nemotron-h-8b", kv_cache_dtype="fp8", cache_dir=tmp_path)
    assert (fp8.attention_backend, fp8.kv_cache_dtype) == ("FLASH_ATTN", "fp8")
    assert fp8.attention_page_bytes_per_token * 2 == auto.attention_page_bytes_per_token == 4096
    assert (fp8.block_size, auto.block_size) == (2080, 1040)
    assert fp8.mamba_state_bytes == auto.mamba_state_bytes


def test_r12_the_default_gpu_memory_is_what_cuda_reports_for_an_h200():
    """141 GiB made block counts 1-4% high: vLLM plans with CUDA's total (143,156 MiB)."""
    from kvtrace.geometry.compute import H200_GIB, default_gpu_memory_gib

    assert H200_GIB * (1 << 30) == 143_156 << 20
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        assert default_gpu_memory_gib() == H200_GIB  # no GPU here: an H200's
        return
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        assert default_gpu_memory_gib() == (info.total - info.reserved) / (1 << 30)
    finally:
        pynvml.nvmlShutdown()


def test_r12_the_shipped_geometries_plan_with_an_h200s_memory():
    from kvtrace.geometry.bundled import PRESET_TENSOR_PARALLEL, geometry_for

    for preset in PRESET_TENSOR_PARALLEL:
        assert geometry_for(preset).memory.gpu_memory_bytes == 143_156 << 20, preset


def test_r13_the_repository_stands_alone():
    """Tests, benchmarks and docs read the data shipped in data/, never a folder beside the
    checkout (a fresh clone failed two tests and skipped three)."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    outside = ("..", "/shared"), ("shared", "/data")  # spelled apart: this file is tracked too
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if tracked.returncode:
        pytest.skip("not a git checkout")
    for name in tracked.stdout.splitlines():
        path = root / name
        if path.suffix in (".py", ".md", ".toml", ".cfg", ".txt", "") and path.is_file():
            text = path.read_text(errors="replace")
            assert not any("".join(words) in text for words in outside), name
    mooncake = root / "data" / "mooncake"
    assert {"LICENSE", "README.md", "UPSTREAM_README.md"} <= {p.name for p in mooncake.iterdir()}
    assert "Apache License" in (mooncake / "LICENSE").read_text()
    assert hashlib.sha256((mooncake / "synthetic_trace.jsonl").read_bytes()).hexdigest() == (
        "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131")
