"""``kvtrace sweep`` on the real vLLM 0.33.0 cache: its rows are the figures of individual
``kvtrace replay`` runs, however the configurations are run (this process, local processes,
Ray), and a grid that cannot run is refused before any work."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.engine_config import KEEP
from kvtrace.errors import ConfigError
from kvtrace.events import EngineConfig, KVCacheGroup, RequestArrived, TraceHeader
from kvtrace import ray_cluster
from kvtrace.replay import backend as backend_module
from kvtrace.replay import sweep as sweep_module
from kvtrace.replay.source import read_source
from kvtrace.replay.sweep import SweepGrid, default_backend, plan_sweep, run_sweep
from kvtrace.traceio import write_trace

# 12 requests, one at a time: 3 shared prefixes of 256 tokens used round-robin, each followed
# by 256 unique tokens, 4 output tokens. Hash unit = attention block = 16 tokens, so the
# distinct attention blocks are 3 x 16 shared + 12 x 16 unique = 240 (output blocks: none
# filled). One request needs 1 null + ceil(516 / 16) = 33 attention + 2 + 1 checkpoint Mamba
# blocks = 37.
PROMPTS, PREFIX, SUFFIX, UNIT, REQUESTS, OUTPUT = 3, 256, 256, 16, 12, 4
DISTINCT_BLOCKS = PROMPTS * PREFIX // UNIT + REQUESTS * SUFFIX // UNIT
ONE_REQUEST_BLOCKS = 1 + -(-(PREFIX + SUFFIX + OUTPUT) // UNIT) + 3


def workload(path: Path) -> Path:
    config = EngineConfig(
        kv_cache_groups=[
            KVCacheGroup(kind="full_attention", block_size=UNIT),
            KVCacheGroup(kind="mamba", block_size=4 * UNIT, mamba_cache_mode="align",
                         num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=UNIT),
        ],
        hash_block_size=UNIT, num_gpu_blocks=500, retention_interval=0,
        max_num_batched_tokens=192, max_num_seqs=4)
    next_id = PROMPTS * PREFIX // UNIT
    records = []
    for req in range(REQUESTS):
        prefix = req % PROMPTS * PREFIX // UNIT
        hash_ids = list(range(prefix, prefix + PREFIX // UNIT))
        hash_ids += range(next_id, next_id + SUFFIX // UNIT)
        next_id += SUFFIX // UNIT
        records.append(RequestArrived(req=req, prompt_len=PREFIX + SUFFIX, hash_ids=hash_ids,
                                      max_tokens=OUTPUT, arrival_ns=req * 10**9))
    write_trace(path, TraceHeader(kvtrace_version="test", created_ns=0, source="test",
                                  config=config), records)
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return workload(tmp_path_factory.mktemp("sweep") / "hot.kvtrace")


@pytest.fixture(scope="session", autouse=True)
def vllm_imported():
    """Import vLLM (~7 s) once for the session, not inside whichever test runs first."""
    import vllm.v1.core.kv_cache_manager  # noqa: F401


GRID = ("--pool-fraction", "0.2,0.5", "--variant", "unfixed,fixed", "--retention", "0",
        "--retention", "none", "--backend", "vllm")


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def figures(rows: list[dict]) -> list[dict]:
    """Rows without their timings: what every way of running must agree on."""
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


@pytest.fixture(scope="module")
def swept(source, tmp_path_factory) -> tuple[Path, dict]:
    outdir = tmp_path_factory.mktemp("out") / "sweep"
    result = run("sweep", str(source), *GRID, "-j", "1", "-o", str(outdir))
    assert result.exit_code == 0, result.output
    return outdir, json.loads((outdir / "sweep.json").read_text())


def test_rows_are_the_figures_of_individual_replays(source, swept, tmp_path):
    outdir, sweep = swept
    rows = sweep["rows"]
    assert [(r["variant"], r["retention_interval"], r["num_gpu_blocks"]) for r in rows] == [
        (variant, retention, blocks) for variant in ("unfixed", "fixed")
        for retention in (0, None) for blocks in (48, 120)]
    assert sweep["backend"] == "vllm" and sweep["distinct_attention_blocks"] == DISTINCT_BLOCKS
    for blocks, retention in [(48, "0"), (120, "0"), (48, "none"), (120, "none")]:
        summary_path = tmp_path / f"{blocks}-{retention}.json"
        result = run("replay", str(source), "--variant", "unfixed", "--variant", "fixed",
                     "--num-gpu-blocks", str(blocks), "--retention", retention,
                     "-o", str(tmp_path / "runs"), "--summary-json", str(summary_path))
        assert result.exit_code == 0, result.output
        for variant, summary in json.loads(summary_path.read_text())["variants"].items():
            [row] = [r for r in rows if (r["variant"], r["num_gpu_blocks"]) == (variant, blocks)
                     and r["retention_interval"] == (None if retention == "none" else 0)]
            assert row["evictions"] == summary["evictions"].get("lru_reuse", 0)
            for name in ("requests", "prompt_tokens", "hit_tokens", "hit_rate",
                         "checkpoints_published", "checkpoints_suppressed", "preemptions"):
                assert row[name] == summary[name], (row, name)
    # The grid matters: the small pool evicts, and the variants publish differently.
    by_key = {(r["variant"], r["retention_interval"], r["num_gpu_blocks"]): r for r in rows}
    assert by_key["unfixed", 0, 48]["evictions"] > by_key["unfixed", 0, 120]["evictions"]
    assert by_key["fixed", 0, 48]["checkpoints_suppressed"] > 0
    assert by_key["unfixed", 0, 48]["checkpoints_suppressed"] == 0
    # No replay trace per configuration: only the sweep's own outputs.
    assert sorted(p.name for p in outdir.iterdir()) == [
        "sweep.duckdb", "sweep.html", "sweep.json", "sweep.png"]


def test_outputs_hold_every_row(swept):
    outdir, sweep = swept
    assert (outdir / "sweep.png").read_bytes().startswith(b"\x89PNG")
    page = (outdir / "sweep.html").read_text()
    assert page.count("<tr>") == len(sweep["rows"]) + 1 and "data:image/png;base64," in page
    connection = duckdb.connect(str(outdir / "sweep.duckdb"), read_only=True)
    columns = [c[0] for c in connection.execute("SELECT * FROM sweep LIMIT 0").description]
    loaded = connection.execute(
        "SELECT * FROM sweep ORDER BY variant DESC, retention_interval NULLS LAST, "
        "num_gpu_blocks").fetchall()
    connection.close()
    assert [dict(zip(columns, row))["hit_tokens"] for row in loaded] == [
        r["hit_tokens"] for r in sweep["rows"]]
    assert {dict(zip(columns, row))["source_digest"] for row in loaded} == {
        sweep["source_digest"]}


def test_local_processes_give_the_same_rows(source, swept):
    plan = plan_sweep(SweepGrid(str(source), ("unfixed", "fixed"), (0, None), (0.2, 0.5),
                                backend="vllm"))
    result = run_sweep(plan, jobs=2)
    assert result.runner == "2 local processes"
    assert figures(result.rows) == figures(swept[1]["rows"])


def test_the_model_backend_counts_the_same_rows(source, swept, monkeypatch):
    """On the model backend a sweep's replays make no record: the backend counts the figures
    itself. The rows are the vllm backend's all the same."""
    import kvtrace.replay.model as model

    counting = []
    real = model.open_counting_model_backend

    def spy(config, variant, summary, snapshot=None):
        counting.append(variant)
        return real(config, variant, summary, snapshot)

    monkeypatch.setattr(model, "open_counting_model_backend", spy)
    plan = plan_sweep(SweepGrid(str(source), ("unfixed", "fixed"), (0, None), (0.2, 0.5),
                                backend="model"))
    result = run_sweep(plan, jobs=1)
    assert len(counting) == len(plan.tasks)
    assert figures(result.rows) == figures(swept[1]["rows"])


def test_the_source_is_read_once_per_process(source, monkeypatch):
    reads = []

    def counted(path):
        reads.append(path)
        return read_source(path)

    monkeypatch.setattr(sweep_module, "read_source", counted)
    monkeypatch.setattr(sweep_module, "_cached_source", None)
    plan = plan_sweep(SweepGrid(str(source), ("unfixed", "fixed"), num_gpu_blocks=(60, 90),
                                backend="vllm"))
    assert len(run_sweep(plan, jobs=1).rows) == 4
    assert reads == [str(source)]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Ray is not installed (pip install 'kvtrace[ray]')")
def test_ray_gives_the_same_rows(source, swept, tmp_path):
    outdir = tmp_path / "ray"
    result = run("sweep", str(source), *GRID, "--ray", "local", "-j", "2", "-o", str(outdir))
    assert result.exit_code == 0, result.output
    sweep = json.loads((outdir / "sweep.json").read_text())
    assert sweep["runner"] == "a local Ray instance"
    assert figures(sweep["rows"]) == figures(swept[1]["rows"])


def test_db_gets_one_sweep_per_run_even_an_older_db(source, tmp_path):
    db = tmp_path / "prod.duckdb"
    assert run("load", str(source), "-o", str(db)).exit_code == 0
    connection = duckdb.connect(str(db))
    connection.execute("DROP TABLE sweep")  # as a database written before sweeps existed
    connection.close()
    for _ in range(2):
        result = run("sweep", str(source), "--num-gpu-blocks", "60", "--variant", "fixed",
                     "-j", "1", "--backend", "vllm", "-o", str(tmp_path / "out"), "--db", str(db))
        assert result.exit_code == 0, result.output
    assert not (tmp_path / "out" / "sweep.duckdb").exists()
    connection = duckdb.connect(str(db), read_only=True)
    assert connection.execute(
        "SELECT sweep_id, num_gpu_blocks, variant FROM sweep ORDER BY sweep_id").fetchall() == [
        (0, 60, "fixed"), (1, 60, "fixed")]
    assert connection.execute("SELECT count(*) FROM runs").fetchone() == (1,)
    connection.close()


def test_pool_fractions_are_shares_of_the_distinct_attention_blocks(source):
    plan = plan_sweep(SweepGrid(str(source), ("fixed",), (KEEP,), (0.5, 1.0, 1.5),
                                backend="vllm"))
    assert plan.distinct_attention_blocks == DISTINCT_BLOCKS
    assert [t.num_gpu_blocks for t in plan.tasks] == [120, 240, 360]
    assert [t.retention_interval for t in plan.tasks] == [0, 0, 0]  # the source's


def test_default_backend_is_the_model_one_once_registered(monkeypatch, source):
    monkeypatch.setitem(backend_module.BACKENDS, "model", "kvtrace.replay.vllm_backend:VllmBackend")
    assert default_backend() == "model"
    plan = plan_sweep(SweepGrid(str(source), num_gpu_blocks=(60,)))
    assert (plan.backend, plan.notes) == ("model", [])
    monkeypatch.delitem(backend_module.BACKENDS, "model")
    plan = plan_sweep(SweepGrid(str(source), num_gpu_blocks=(60,)))
    assert plan.backend == "vllm" and "'model' backend is not available" in plan.notes[0]


def assert_refused(source: Path, tmp_path: Path, args: list[str], message: str,
                   hint: str = "") -> None:
    outdir = tmp_path / "refused"
    result = run("sweep", str(source), *args, "-o", str(outdir))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert lines[-2].startswith("kvtrace: error: ") and message in lines[-2], result.output
    assert lines[-1].startswith("kvtrace: hint: ") and hint in lines[-1], result.output
    assert not outdir.exists()


@pytest.mark.parametrize("args, message, hint", [
    (["--pool-fraction", "0.1"], "pool fraction 0.1 (24 of 240 distinct attention blocks): a "
     "pool of 24 blocks cannot hold request 0", f"smallest usable pool is {ONE_REQUEST_BLOCKS} "
     "blocks: use fractions of at least 0.155"),
    (["--num-gpu-blocks", "60,36"], "a pool of 36 blocks cannot hold request 0",
     f"smallest usable pool is {ONE_REQUEST_BLOCKS} blocks"),
    ([], "a sweep needs pool sizes", ""),
    (["--pool-fraction", "0.5", "--num-gpu-blocks", "60"], "a sweep needs pool sizes", ""),
    (["--pool-fraction", "0,0.5"], "pool fraction 0.0 is not positive", ""),
    (["--pool-fraction", "half"], "--pool-fraction 'half' is not a number", ""),
    (["--num-gpu-blocks", "60", "--variant", "fixed,nope"], "unknown variant 'nope'", ""),
    (["--num-gpu-blocks", "60", "--retention", "0,24"], "retention interval 24 is not 0 or a "
     "multiple of the scheduler block size 64", ""),
    (["--num-gpu-blocks", "60", "--backend", "nope"], "unknown backend 'nope'", ""),
    (["--pool-fraction", "0.499,0.5"], "the grid runs unfixed at retention 0 with 120 blocks "
     "twice (fraction 0.499 = 120 blocks and fraction 0.5 = 120 blocks)", ""),
])
def test_bad_grids_are_refused_before_any_work(source, tmp_path, monkeypatch, args, message,
                                               hint):
    def no_work(*args, **kwargs):
        raise AssertionError("a configuration ran")

    monkeypatch.setattr(sweep_module, "run_configuration", no_work)
    assert_refused(source, tmp_path, args, message, hint)


def test_a_failed_configuration_leaves_nothing(source, tmp_path, monkeypatch):
    db = tmp_path / "prod.duckdb"
    assert run("load", str(source), "-o", str(db)).exit_code == 0
    before = db.read_bytes()
    real = sweep_module.run_configuration
    calls = []

    def fail_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise ConfigError("the pool ran dry", "Give it more blocks.")
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep_module, "run_configuration", fail_second)
    outdir = tmp_path / "out"
    result = run("sweep", str(source), "--num-gpu-blocks", "60,90", "-j", "1", "--backend",
                 "vllm", "-o", str(outdir), "--db", str(db))
    assert result.exit_code == 1 and "the pool ran dry" in result.output
    assert not outdir.exists() or not any(outdir.iterdir())
    assert db.read_bytes() == before


def test_a_worker_s_error_reaches_the_command_with_its_hint():
    """Workers send errors back pickled; a KvtraceError's hint must survive the trip."""
    import pickle

    error = pickle.loads(pickle.dumps(sweep_module.SweepTaskError("fixed at 60 blocks: dry",
                                                                  "Give it more blocks.")))
    assert (str(error), error.hint) == ("fixed at 60 blocks: dry", "Give it more blocks.")


class _Stopped(Exception):
    pass


@pytest.fixture()
def sigterm_raises():
    """SIGTERM raises ``_Stopped`` in this (main) thread, as the CLI's handler raises."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be set in the main thread")

    def stop(signum, frame):
        raise _Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    yield
    signal.signal(signal.SIGTERM, previous)


def _slow_ray(seconds: float, calls: list[str]):
    """Stands in for ``ray`` whose ``init`` takes ``seconds``: only the holding of stops while
    it starts is under test here (the real Ray's: tests/test_hardening.py, r4)."""
    def init(**_options):
        calls.append("init")
        time.sleep(seconds)
        calls.append("started")

    return SimpleNamespace(init=init)


def _sigterm_after(seconds: float, times: int = 1):
    def send():
        for _ in range(times):
            time.sleep(seconds)
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send, daemon=True).start()


def test_a_stop_while_ray_starts_is_raised_once_it_has_started(sigterm_raises):
    calls: list[str] = []
    done = threading.Event()
    _sigterm_after(0.2)
    with pytest.raises(_Stopped):
        ray_cluster.connect_to_ray(_slow_ray(1.0, calls), "local", 1, done)
    assert calls == ["init", "started"]  # the stop waited for the start
    done.set()


def test_a_second_stop_does_not_wait_for_a_hung_start(sigterm_raises):
    calls: list[str] = []
    done = threading.Event()
    _sigterm_after(0.2, times=2)
    began = time.monotonic()
    with pytest.raises(_Stopped):
        ray_cluster.connect_to_ray(_slow_ray(30.0, calls), "local", 1, done)
    assert calls == ["init"] and time.monotonic() - began < 5
    done.set()
