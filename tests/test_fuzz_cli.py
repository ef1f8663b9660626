"""Fuzzing every command with generated options and hand-built inputs: no traceback, ever.

Each command of ``kvtrace.cli.COMMAND_MODULES`` is invoked in-process (click's CliRunner with
``catch_exceptions=False``, so any exception fails the test) with arguments drawn by
hypothesis: options valid and invalid (out of range, NaN, infinite, beyond 64 bits, not a
number), inputs from a pool of real and broken files (a workload, a replay trace, a truncated
one, values from a newer writer, ill-typed records, impossible engines, garbage, a newer
format, a directory, databases sound and damaged, and crafted ones: table and column names
that are SQL, a view that reads a file, ``runs.path`` a FIFO or NULL, schema versions newer,
older and negative), and outputs that can and cannot be written (new, in a missing directory,
under /proc, onto an input, and a device, a link, a FIFO or a socket, each of which must be
left as it was). The outcome must be exit 0, or 1 with one ``kvtrace: error:`` line, or 2 with
click's usage error.

Inputs are generated, not their sizes: counts that only make a valid run longer (requests,
pool blocks, prompt lengths, execute mode's state scale) are drawn small, so the file runs in
about a minute. ``capture`` gets only pids and endpoints no process can own, ``engine`` only
broken workloads, ``demo``/``geometry`` only settings that fail before any work and
``sweep --ray`` only addresses refused at once: valid ones would attach to a live process,
become an engine core, import vLLM's model code or start a Ray cluster.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pytest
from bad_traces import (
    SPECIAL_OUTPUTS,
    closing_frame,
    crafted_databases,
    header,
    header_frame,
    ill_typed_traces,
    impossible_configs,
    node_kind,
    requests,
    ring,
    special_output,
    trace,
    unknown_enum_records,
    write_frames,
)
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtrace.cli import COMMAND_MODULES, cli
from kvtrace.events import TAG_TO_TYPE
from kvtrace.traceio import TraceWriter

# --- the inputs: files every command may be given ------------------------------------------


@dataclass(frozen=True)
class In:
    """An input from the pool, by name."""

    name: str


@dataclass(frozen=True)
class Out:
    """An output path: ``kind`` says where (one that works, or one that cannot)."""

    kind: str
    suffix: str = ""


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz-inputs")
    files: dict[str, Path] = {"workload": trace(root / "w.kvtrace", requests(4))}
    runner = CliRunner()
    runs = root / "runs"
    assert runner.invoke(cli, ["replay", str(files["workload"]), "-o", str(runs)]).exit_code == 0
    files["replayed"] = runs / "w.fixed.kvtrace"
    files["runs-dir"] = runs
    data = files["replayed"].read_bytes()
    (root / "cut.kvtrace").write_bytes(data[:len(data) * 2 // 3])
    files["truncated"] = root / "cut.kvtrace"
    with TraceWriter(root / "newer.kvtrace", header(), rows=True) as writer:
        writer.write_many(requests(2) + unknown_enum_records())
    files["newer-values"] = root / "newer.kvtrace"
    files.update(ill_typed_traces(root))
    for name in ("zero hash unit", "huge pool", "unknown group kind", "negative budget"):
        config = impossible_configs()[name]
        files[name] = trace(root / f"{name.replace(' ', '_')}.kvtrace", requests(2),
                            header(config))
    files["no config"] = trace(root / "noconfig.kvtrace", requests(2), header(None))
    files["newer format"] = write_frames(root / "v9.kvtrace", header_frame(header()),
                                         closing_frame(0), major=9)
    (root / "empty.kvtrace").write_bytes(b"")
    files["empty"] = root / "empty.kvtrace"
    (root / "garbage.kvtrace").write_bytes(os.urandom(4096))
    files["garbage"] = root / "garbage.kvtrace"
    db = root / "w.duckdb"
    assert runner.invoke(cli, ["load", str(files["replayed"]), str(files["workload"]),
                               "-o", str(db)]).exit_code == 0
    files["db"] = db
    shutil.copy(db, root / "damaged.duckdb")
    with duckdb.connect(str(root / "damaged.duckdb")) as connection:
        connection.execute("UPDATE kvtrace_meta SET value = 'two' WHERE key = "
                           "'db_schema_version'")
    files["damaged db"] = root / "damaged.duckdb"
    with duckdb.connect(str(root / "other.duckdb")) as connection:
        connection.execute("CREATE TABLE t AS SELECT 1 AS a")
    files["other db"] = root / "other.duckdb"
    (root / "secret").write_text("root's secret\n")
    files.update(crafted_databases(root, db, root / "secret"))
    (root / "log.jsonl").write_text("".join(
        f'{{"timestamp": {i * 100}, "input_length": {600 + i}, "output_length": 4, '
        f'"hash_ids": [1, {i + 2}]}}\n' for i in range(5)))
    files["log"] = root / "log.jsonl"
    (root / "badlog.jsonl").write_text('{"timestamp": 0, "input_length": -3}\nnot json\n')
    files["bad log"] = root / "badlog.jsonl"
    (root / "config.json").write_text('{"architectures": ["Nothing"], "hidden_size": "x"}')
    files["bad model config"] = root / "config.json"
    files["a directory"] = root
    files["missing"] = root / "missing.kvtrace"
    files["ring"] = ring(root / "ring")
    files["empty ring"] = root / "empty-ring"
    files["empty ring"].mkdir(mode=0o700)
    files["open ring"] = ring(root / "open-ring")
    files["open ring"].chmod(0o777)
    files["garbage ring"] = ring(root / "garbage-ring", num_segments=2)
    shutil.copy(files["garbage"], min(files["garbage ring"].iterdir()))
    return {name: str(path) for name, path in files.items()}


TRACES = ["workload", "replayed", "truncated", "newer-values", "str in an int column",
          "int in a list column", "list in an int column", "int where a string goes",
          "too few columns", "str in a row", "a header of the wrong shape", "zero hash unit",
          "huge pool", "unknown group kind", "negative budget", "no config", "newer format",
          "empty", "garbage", "missing", "a directory", "db", "log"]
BROKEN_TRACES = [name for name in TRACES if name not in ("workload", "replayed", "truncated",
                                                         "newer-values")]
CRAFTED_DATABASES = ["table named as SQL", "columns named as SQL", "partition value as a path",
                     "a view that reads a file", "runs.path a FIFO", "runs.path NULL",
                     "strings that drive a terminal", "a newer schema", "schema v1",
                     "a negative schema"]
DATABASES = ["db", "damaged db", "other db", "workload", "missing", "empty", "a directory",
             *CRAFTED_DATABASES]


def resolve(value, pool: dict[str, str], scratch: Path, inputs: list[str],
            specials: dict[Path, tuple]) -> str:
    if isinstance(value, In):
        inputs.append(pool[value.name])
        return pool[value.name]
    if isinstance(value, Out) and value.kind in SPECIAL_OUTPUTS:
        path = scratch / f"out{value.suffix}"
        if not path.exists() and not path.is_symlink():
            victim = scratch / "victim"
            victim.write_text("precious")
            try:
                special_output(value.kind, path, victim)
            except PermissionError:  # no mknod here (not root): a FIFO stands in
                special_output("FIFO", path, victim)
            specials[path] = node_kind(path)
        return str(path)
    if isinstance(value, Out):
        return {
            "new": str(scratch / f"out{value.suffix}"),
            "missing dir": str(scratch / "no" / "such" / f"out{value.suffix}"),
            "proc": f"/proc/kvtrace-fuzz{value.suffix}",
            "existing dir": str(scratch),
            "under a file": str(Path(pool["log"]) / f"out{value.suffix}"),
            "an input": inputs[0] if inputs else str(scratch / f"out{value.suffix}"),
        }[value.kind]
    return str(value)


# --- values: each option has valid ones and invalid ones ------------------------------------


@dataclass(frozen=True)
class Opt:
    """An option's values; ``valid=None`` makes it a flag, ``required`` always given."""

    valid: st.SearchStrategy | None
    invalid: st.SearchStrategy | None = None
    required: bool = False


JUNK = st.sampled_from(["", "x", "-", "nan", "inf", "-inf", "1e400", "0x10", " 3", "☃", "--"])
HUGE = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**25])
BAD_INT = st.one_of(st.integers(-3, 0), HUGE, JUNK)
BAD_FLOAT = st.one_of(st.sampled_from(["-1", "0", "nan", "inf", "-inf", "1e-320", "1e308"]),
                      JUNK)
FLAG = Opt(None)


def ints(low: int, high: int) -> Opt:
    return Opt(st.integers(low, high), BAD_INT)


def floats(*valid: str) -> Opt:
    return Opt(st.sampled_from(valid), BAD_FLOAT)


def choice(valid: list, invalid: list | None = None) -> Opt:
    return Opt(st.sampled_from(valid), st.sampled_from(invalid) if invalid else JUNK)


def files(valid: list[str], invalid: list[str]) -> Opt:
    return Opt(st.builds(In, st.sampled_from(valid)), st.builds(In, st.sampled_from(invalid)))


def output(suffix: str = "", required: bool = False) -> Opt:
    return Opt(st.just(Out("new", suffix)), st.builds(Out, st.sampled_from(
        ["missing dir", "proc", "existing dir", "under a file", "an input", *SPECIAL_OUTPUTS]),
        st.just(suffix)), required)


POOL_BLOCKS = Opt(st.sampled_from([40, 300, 1000]),  # never a pool that takes long to build
                  st.one_of(st.sampled_from([-1, 0, 1, 10**12]), HUGE, JUNK))
RETENTION = Opt(st.sampled_from(["none", "dense", "0", "64"]),
                st.one_of(st.sampled_from(["70", "-64", "7", str(64 * 10**20)]), JUNK))
VARIANT = choice(["unfixed", "fixed", "naive", "upstream"], ["nope", "", "FIXED"])
BACKEND = choice(["vllm", "model"], ["x", "", "VLLM"])


@st.composite
def arguments(draw, positionals: list[Opt], options: dict[str, Opt], max_options: int = 4):
    """Positionals, the required options and a few optional ones; at most one value (half the
    time none) drawn from its invalid ones."""
    names = [name for name, opt in options.items() if opt.required]
    optional = sorted(name for name, opt in options.items() if not opt.required)
    names += draw(st.lists(st.sampled_from(optional), unique=True, max_size=max_options)) \
        if optional else []
    slots = [i for i, p in enumerate(positionals) if p.invalid is not None] + [
        name for name in names if options[name].invalid is not None]
    bad = draw(st.one_of(st.none(), st.sampled_from(slots))) if slots else None
    argv = []
    for index, positional in enumerate(positionals):
        argv.append(draw(positional.invalid if bad == index else positional.valid))
    for name in names:
        opt = options[name]
        argv += [name] if opt.valid is None else [
            name, draw(opt.invalid if bad == name else opt.valid)]
    return argv


# Presets at their shipped deployment only (no valid --tensor-parallel-size): any other geometry
# is vLLM's to compute (tens of seconds; tests/test_geometry.py covers it).
ENGINE_SHAPE = {
    "--model": Opt(st.sampled_from(["kimi-k3", "nemotron-h-8b", "qwen3-next-80b-a3b",
                                    "kimi-linear-48b-a3b"]), st.sampled_from(
        ["no-such-model", "", "kimi"])),
    "--tensor-parallel-size": Opt(st.sampled_from([0, -1, "x", ""])),
    "--mamba-groups": Opt(st.integers(1, 6), BAD_INT),
    "--hash-unit": choice([16, 384], [7, 0, -1, 10**30]),
    "--attention-block-size": choice([384], [64, 0, 10**30]),
    "--mamba-block-size": choice([384], [128, 0]),
    "--checkpoint-alignment": choice([16, 384], [0, 7, -16]),
    "--retention-interval": RETENTION,
    "--max-num-batched-tokens": ints(512, 8192), "--max-num-seqs": ints(1, 64),
    "--num-gpu-blocks": POOL_BLOCKS, "--pool-fraction": floats("0.1", "0.5", "1"),
    "--allow-unreal-geometry": FLAG,
}
TRACE_IN = files(["workload", "replayed", "truncated", "newer-values"], BROKEN_TRACES)
CAPTURE_OPTIONS = {
    "--method": choice(["auto", "gdb", "lldb", "plugin"]),
    "--duration": choice(["10m", "90", "1h"], ["0", "0s", "1x", "-3", "", "1e9h"]),
    "--no-hash-bytes": FLAG, "--buffer": ints(1024, 4096), "--gpu-interval-ms": ints(0, 100),
    "--topic": choice(["kv", ""]), "--bind": FLAG,
}
DATABASE_IN = files(["db"], ["damaged db", "other db", "workload", "missing", "empty",
                             "a directory", *CRAFTED_DATABASES])

# never a Ray cluster: only addresses Ray refuses at once
LOAD_OPTIONS = {"-j": choice([1, 2], [0, -1, "x"]),
                "--ray": Opt(st.sampled_from(["nonsense", "", "-1", "127.0.0.1:1"]))}

COMMANDS: dict[str, tuple[st.SearchStrategy, int]] = {
    # command -> (its arguments, examples)
    "info": (arguments([TRACE_IN], {"--json": FLAG}), 25),
    "cat": (arguments([TRACE_IN], {
        "--kind": choice(sorted(TAG_TO_TYPE)), "--limit": ints(0, 5), "--header": FLAG}), 25),
    "load": (arguments([files(["workload", "replayed", "truncated", "newer-values", "runs-dir"],
                              BROKEN_TRACES), TRACE_IN], {
        "-o": output(".duckdb", True), **LOAD_OPTIONS}), 25),
    "load --parquet": (arguments([files(["workload", "replayed", "truncated", "runs-dir"],
                                        BROKEN_TRACES), TRACE_IN], {
        "--parquet": output(required=True), **LOAD_OPTIONS}), 10),
    "sql": (arguments([DATABASE_IN, choice(["SELECT count(*) FROM runs", "SELECT 1"], [
        "SELECT * FROM nope", "SELECT 1/0", ";", "   ", "", "x"])], {
        "--csv": FLAG, "--json": FLAG, "--unsafe": FLAG}), 25),
    "sql --query": (arguments([DATABASE_IN], {
        "--query": Opt(st.sampled_from(["lost_hits_by_prefix", "hit_rate_timeline",
                                        "checkpoint_pushouts", "miss_attribution"]), JUNK, True),
        "--param": choice(["min_hits=1", "bucket_steps=5", "fixed=fixed"], [
            "bucket_steps=0", "min_hits=99999999999999999999999", "nope=1", "noequals",
            "min_hits=x"]), "--list": FLAG}), 20),
    "report": (arguments([DATABASE_IN], {
        "--html": output(".html"), "--bucket-steps": ints(1, 20), "--min-hits": ints(0, 3),
        "--markdown": FLAG, "--gpu": choice(["h200", "b200", "350"], ["a100", "0", "nan", ""]),
        "--model": choice(["nemotron-h-8b"], ["nope", "", "/"])}, max_options=2), 10),
    "why": (arguments([files(["replayed", "truncated", "db", "runs-dir"],
                             BROKEN_TRACES + CRAFTED_DATABASES)], {
        "--request": Opt(st.sampled_from(["0", "1", "3"]), st.sampled_from(
            ["99", "²", "-1", "", "9" * 30]), True), "--variant": VARIANT}), 20),
    "doctor": (arguments([files(["replayed", "truncated", "db", "runs-dir"],
                                BROKEN_TRACES + CRAFTED_DATABASES)], {
        "--json": FLAG, "--no-predict": FLAG, "--backend": BACKEND,
        "--threshold": floats("0", "0.05", "0.5"), "--db": output(".duckdb"),
        "--gpu": choice(["h100", "400"], ["nope", "-1"])}), 10),
    "export": (arguments([DATABASE_IN], {
        "--parquet": output(required=True), "--overwrite": FLAG}), 6),
    # capture: only pids no process can have, only endpoints no publisher can be behind
    "capture --pid": (arguments([], {
        "--pid": Opt(st.sampled_from([2**22, -1, 0, 2**22 + 1, 10**30]), JUNK, True),
        "-o": output(".kvtrace", True), **CAPTURE_OPTIONS}), 10),
    "capture --stop": (arguments([], {
        "--stop": Opt(st.sampled_from([2**22, -5, 0, 2**22 + 7]), JUNK, True),
        **CAPTURE_OPTIONS}), 5),
    "capture --zmq": (arguments([], {
        "--zmq": Opt(st.sampled_from(["", "nonsense", "tcp://", "tcp://hostonly", "tcp://h:0",
                                      "tcp://h:99999", "inproc://x"]), required=True),
        "-o": output(".kvtrace", True), **CAPTURE_OPTIONS}), 10),
    "capture --ring": (arguments([], {
        "--pid": Opt(st.sampled_from([2**22, 2**22 + 3]), JUNK, True),
        "--ring": Opt(st.sampled_from(["30m", "20s"]), st.sampled_from(["0", "x", ""]), True),
        "--dir": Opt(st.sampled_from(["/tmp/kvtrace-fuzz-ring"]), required=True),
        "--max-size": choice(["2GiB", "500MB", "1g"], ["0", "2XB", "-1G", "1e99G"]),
        "--keyframe-every": choice(["10s", "2m"], ["0", "1h", "x"]),
        "--duration": choice(["10m"], ["0"])}), 10),
    "dump": (arguments([files(["ring"], ["empty ring", "open ring", "garbage ring", "missing",
                                         "workload", "a directory"])], {
        "--last": choice(["10m", "1s", "1h"], ["0", "x", ""]),
        "-o": output(".kvtrace", True)}), 12),
    # top: only --once (else it follows its source until stopped), --pid only pids no process has
    "top": (arguments([files(["workload", "replayed", "truncated", "newer-values", "ring"],
                             BROKEN_TRACES + ["empty ring", "open ring", "garbage ring"])], {
        "--once": Opt(None, required=True), "--interval": floats("0.1", "0.5"),
        "--window": choice(["30s", "5m"], ["0", "x", ""]),
        "--metrics-port": choice([0], [-1, 65536, "x"]),
        "--metrics-host": choice(["127.0.0.1"], ["", "no-such-host.invalid"])}), 15),
    "top --pid": (arguments([], {
        "--pid": Opt(st.sampled_from([2**22, 2**22 - 1]), st.sampled_from([0, -1, 10**30]), True),
        "--once": Opt(None, required=True), "--method": choice(["auto", "ptrace"])}), 3),
    "synth": (arguments([], {
        "--preset": Opt(st.sampled_from(["shared-prompt", "documents", "chat", "agent"]),
                        st.sampled_from(["nope", ""]), required=True),
        "--requests": Opt(st.integers(1, 12), BAD_INT, True), "--seed": Opt(st.integers(-5, 5), JUNK),
        "-o": output(".kvtrace", True), "--rate": floats("0.5", "4", "1000"),
        "--system-prompts": ints(1, 4), "--system-prompt-len": ints(1, 600),
        "--zipf": floats("0", "1", "2.5"), "--prompt-len": ints(1, 300),
        "--output-len": ints(1, 60), "--length-sigma": floats("0", "0.8", "2"),
        "--max-prompt-len": Opt(st.integers(1, 2000), st.one_of(st.just(2**25 + 1), BAD_INT)),
        "--turns": floats("1", "3.5"), "--max-turns": Opt(st.integers(1, 6),
                                                          st.sampled_from([0, 10**6, "x"])),
        "--think-time": floats("0", "2.5"), "--tool-call-len": ints(1, 50),
        "--tool-output-len": ints(1, 50), **ENGINE_SHAPE}, max_options=5), 40),
    "import": (arguments([Opt(st.just("mooncake")), files(["log"], [
        "bad log", "workload", "missing", "a directory", "empty", "garbage"])], {
        "--source-block-size": choice([16, 512], [-1, 0, 7, 10**30]),
        "-o": output(".kvtrace", True), **ENGINE_SHAPE}), 30),
    "replay": (arguments([TRACE_IN], {
        "--variant": VARIANT, "--backend": BACKEND,
        "--num-gpu-blocks": POOL_BLOCKS, "--retention": RETENTION,
        "--max-num-batched-tokens": ints(64, 4096), "--max-num-seqs": ints(1, 8),
        "--long-prefill-token-threshold": ints(0, 512), "--lockstep": FLAG, "--verify": FLAG,
        "-o": output(required=True), "--summary-json": output(".json"),
        "--db": output(".duckdb"), "--execute": FLAG,
        "--device": choice(["auto", "cpu", "cuda"], ["tpu", "", "CPU"]),
        "--state-scale": floats("0.01", "0.1"),  # full scale: gigabytes of state
        "--gpu": choice(["h200", "h100", "b200", "250"], ["a100", "0", "-3", "nan", "inf", "x",
                                                         ""]),
        "--model": choice(["nemotron-h-8b", "kimi-linear-48b-a3b"], ["nope", "", "/"])},
        max_options=5), 40),
    "sweep": (arguments([TRACE_IN], {
        "--pool-fraction": choice(["0.5", "0.5,1"], ["0", "-1", "nan", "inf", "x", "", ","]),
        "--num-gpu-blocks": Opt(st.sampled_from(["300", "200,300"]), st.sampled_from(
            ["0", "1", "x", "1e3", str(10**20)]), required=True),
        "--variant": choice(["fixed", "unfixed,fixed"], ["nope", ","]),
        "--retention": choice(["0", "none", "0,none"], ["7", "x", "-1"]),
        "--backend": BACKEND, "-o": output(required=True),
        "--db": output(".duckdb"), "-j": choice([1], [0, -1, "x"]),
        # never a Ray cluster: only addresses Ray refuses at once
        "--ray": Opt(st.sampled_from(["nonsense", "", "-1", "127.0.0.1:1"]))}), 20),
    "engine": (arguments([files(BROKEN_TRACES, BROKEN_TRACES)], {
        "--variant": VARIANT, "--num-gpu-blocks": POOL_BLOCKS, "--retention": RETENTION,
        "--speed": floats("0", "1", "10"), "--autostart": FLAG,
        "--summary-json": output(".json"),
        # never another installed release: the command would exec it in place of the test
        "--vllm": choice(["0.33.0"], ["0.29.0", "0.34.0", "x", ""])}), 20),
    "geometry": (arguments([], {
        "--model": Opt(st.one_of(st.just("no-such-model"), st.builds(In, st.sampled_from(
            ["bad model config", "a directory", "missing", "log", "empty", "garbage"]))),
            required=True),
        "--gpu-memory-gib": floats("80", "141"), "--gpu-memory-utilization": floats("0.5", "1"),
        "--tensor-parallel-size": ints(1, 8), "--kv-cache-dtype": choice(["auto"], ["x"]),
        "--max-num-batched-tokens": ints(1, 8192), "--non-kv-memory-gib": floats("0", "6"),
        "--json": FLAG}), 20),
    # install only with --dry-run: nothing is ever downloaded
    "vllm install": (arguments([Opt(st.just("install")), choice(
        ["0.30.0", "0.31.0", "0.32.0", "0.33.0"], ["0.29.0", "0.34.0", "latest", "", "-1"])], {
        "--dry-run": Opt(None, required=True), "--all": FLAG}), 10),
    "vllm list": (arguments([Opt(st.just("list"))], {}), 2),
    "demo": (arguments([], {"--workdir": Opt(st.builds(Out, st.sampled_from(
        ["proc", "under a file"])), required=True), "--quick": FLAG}), 4),
}


def test_every_command_is_fuzzed():
    assert {name.split()[0] for name in COMMANDS} == set(COMMAND_MODULES.values())


def check_outcome(result) -> None:
    """Exit 0; or 1 with exactly one error line and its hint (or a fidelity verdict); or 2,
    click's usage error. Never a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 1:
        errors = [line for line in result.stderr.splitlines()
                  if line.startswith("kvtrace: error: ")]
        assert len(errors) == 1 or "DIVERGED" in result.stdout, result.output
        assert not errors or "kvtrace: hint: " in result.stderr
    elif result.exit_code == 2:
        assert "Usage:" in result.stderr or "Error:" in result.stderr, result.output
    else:
        assert result.exit_code == 0, result.output


def fuzz(name: str):
    strategy, examples = COMMANDS[name]
    command = name.split()[0]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large])
    @given(argv=strategy, verbose=st.booleans())
    def run(pool, argv, verbose):
        with tempfile.TemporaryDirectory(prefix="kvtrace-fuzz-") as scratch:
            seen: list[str] = []
            specials: dict[Path, tuple] = {}
            args = [resolve(value, pool, Path(scratch), seen, specials) for value in argv]
            result = CliRunner().invoke(cli, ["-v"] * verbose + [command] + args,
                                        catch_exceptions=False)
            check_outcome(result)
            for path, kind in specials.items():  # a device, link, FIFO or socket: as it was
                assert node_kind(path) == kind and result.exit_code != 0, result.output
                assert (Path(scratch) / "victim").read_text() == "precious"
            assert "root's secret" not in result.output
            event(f"exit {result.exit_code}")  # pytest --hypothesis-show-statistics
    return run


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_command_ever_fails_with_a_traceback(pool, command):
    fuzz(command)(pool)
