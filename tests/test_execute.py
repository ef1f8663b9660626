"""Execute mode: the KDA recurrence, the state pool that follows the replay's records, the hits it
verifies (the seed's wrong-state scenario), the FLOPs cost model and the GPU-seconds query.

GPU tests run where torch sees a CUDA device (``scripts/device-check`` runs them on a lent
GPU machine); elsewhere they are skipped with the reason."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import StaleKeyLeft
from kvtrace.replay.execute import ExecuteOptions
from kvtrace.geometry.families import architecture_of
from kvtrace.geometry.presets import resolve_model
from kvtrace.replay.execute.executor import StateExecutor
from kvtrace.replay.execute.inputs import UnitInputs
from kvtrace.replay.execute.kda import TorchKernel, chunk_kda_state, fla_kernel, recurrent_kda_state
from kvtrace.replay.execute.model import state_shape
from kvtrace.replay.execute.recurrence import Recurrence, TrueStates, check_kernel
from vllm_support import (  # noqa: F401 (vllm_backend_class is a fixture)
    SEED_HASH_IDS, prefill_chunks, seed_config, vllm_backend_class)

NO_CUDA = "no CUDA device on this machine"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


def random_inputs(rows: int, tokens: int, key_dim: int, value_dim: int, seed: int = 0,
                  device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=generator, dtype=torch.float64).to(device)

    k = torch.nn.functional.normalize(rand(rows, tokens, key_dim) * 2 - 1, dim=-1)
    v = rand(rows, tokens, value_dim) * 2 - 1
    g = -0.05 * rand(rows, tokens, key_dim)
    beta = 0.1 + 0.8 * rand(rows, tokens)
    state = rand(rows, key_dim, value_dim) - 0.5
    return state, k, v, g, beta


# --- the recurrence ---------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,chunk", [(64, 16), (100, 16), (37, 8), (5, 16), (48, 48)])
def test_chunked_recurrence_equals_the_token_by_token_recurrence(tokens, chunk):
    state, k, v, g, beta = random_inputs(3, tokens, 8, 6)
    expected = recurrent_kda_state(state, k, v, g, beta)
    got = chunk_kda_state(state, k, v, g, beta, chunk)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # ... and the recurrence is not a no-op on these inputs.
    assert (expected - state).abs().max() > 0.1


def test_state_after_a_hit_plus_the_rest_equals_a_full_recompute():
    """What a request computes from a hit's state over the rest of its prompt is what a
    request computing the whole prompt from scratch gets, at every split."""
    inputs = UnitInputs(rows=4, key_dim=8, value_dim=8, unit=32, dtype=torch.float32,
                        device=torch.device("cpu"))
    recurrence = Recurrence(inputs, TorchKernel(16))
    zeros = torch.zeros(4, 8, 8)
    prompt = [11, 12, 13, 14, 15, 16, 17]
    full = recurrence.run(zeros, prompt)
    for hit_units in range(1, len(prompt)):
        at_hit = recurrence.run(zeros, prompt[:hit_units])
        resumed = recurrence.run(at_hit, prompt[hit_units:])
        torch.testing.assert_close(resumed, full, rtol=1e-5, atol=1e-6)
    # Another prefix ends elsewhere: the state tells prefixes apart.
    other = recurrence.run(zeros, prompt[:-1] + [99])
    assert (other - full).abs().max() > 0.01


def test_unit_inputs_are_a_pure_function_of_the_hash_id():
    def make():
        return UnitInputs(rows=3, key_dim=8, value_dim=4, unit=16, dtype=torch.float32,
                          device=torch.device("cpu"))

    first, second = make()([7, 1 << 62]), make()([7, 1 << 62])
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    k, v, g, beta = first
    assert k.shape == (3, 32, 8) and v.shape == (3, 32, 4) and beta.shape == (3, 32)
    torch.testing.assert_close(k.norm(dim=-1), torch.ones(3, 32))
    assert -0.05 <= g.min() and g.max() <= -0.001 and 0.1 <= beta.min() and beta.max() <= 0.9
    assert not torch.equal(k[:, :16], k[:, 16:])  # another id, other inputs
    assert not torch.equal(k[0], k[1])  # another row (layer, head or group), other inputs


def test_true_states_are_memoised_within_the_budget_and_stay_right():
    inputs = UnitInputs(rows=2, key_dim=8, value_dim=8, unit=16, dtype=torch.float32,
                        device=torch.device("cpu"))
    recurrence = Recurrence(inputs, TorchKernel(16))
    zeros = torch.zeros(2, 8, 8)
    state_bytes = zeros.numel() * zeros.element_size()
    true_states = TrueStates(recurrence, zeros, every_units=2, budget_bytes=3 * state_bytes)
    chain = list(range(100, 110))
    true_states.learn(chain, 0)
    for end in (10, 4, 7, 10, 1):
        expected = recurrence.run(zeros, chain[:end])
        torch.testing.assert_close(true_states.state(chain[end - 1]), expected)
        assert len(true_states.memo) <= 3


# --- the seed's scenario on the real vLLM cache ----------------------------------------------


def run_seed_scenario(backend_class, variant: str) -> tuple[dict, list]:
    """The seed (reference §6) at retention 0, with its junction at 96, then two readers:
    request 2 shares the first 96 tokens (the key ``naive`` leaves on the slot that holds the
    state at 112), request 3 the whole 240-token prompt (its prompt-end checkpoint)."""
    config = seed_config(0)
    records = []
    with StateExecutor(config, ExecuteOptions(device="cpu", model="kimi-linear-48b-a3b")) as engine:
        def sink(record):
            records.append(record)
            engine(record)

        backend = backend_class(config, variant, sink)
        backend.add_request(1, 128, SEED_HASH_IDS[:6] + [900, 901], 1)
        step = prefill_chunks(backend, 1, [128]) + 1
        backend.free(1)
        backend.add_request(0, 240, SEED_HASH_IDS, 4)
        step = prefill_chunks(backend, 0, [128, 112], step) + 1
        backend.free(0)
        for req, hash_ids in ((2, SEED_HASH_IDS[:6] + [950, 951, 952, 953]),
                              (3, SEED_HASH_IDS + [960, 961])):
            backend.add_request(req, 16 * len(hash_ids), hash_ids, 1)
            backend.new_step(step, step)
            hit, _ = backend.get_computed_blocks(req)
            assert backend.allocate_slots(req, 16 * len(hash_ids) - hit, hit)
            backend.advance(req, 16 * len(hash_ids) - hit)
            backend.free(req)
            step += 1
        backend.close()
        return engine.finish(), records


def test_naive_serves_a_wrong_state_where_its_stale_key_is_read(vllm_backend_class):
    figures, records = run_seed_scenario(vllm_backend_class, "naive")
    stale = [r for r in records if isinstance(r, StaleKeyLeft)]
    assert [(r.key_num_tokens, r.state_num_tokens) for r in stale] == [(96, 112)]
    assert figures["wrong_state_hits"] >= 1
    assert figures["stale_key_reads"] == figures["wrong_state_stale_key_reads"] == 1
    assert figures["first_wrong_state_hit"] == {
        "req": 2, "group": 1, "block_id": stale[0].block_id, "depth": 96,
        "holds": {"req": 0, "num_tokens": 112}}
    assert figures["verified_hits"] >= 1  # request 3's hit at 224 is right
    assert figures["anomalies"] == {}


@pytest.mark.parametrize("variant", ["fixed", "unfixed", "upstream"])
def test_the_other_variants_serve_only_right_states(vllm_backend_class, variant):
    figures, _ = run_seed_scenario(vllm_backend_class, variant)
    assert figures["wrong_state_hits"] == 0
    assert figures["verified_hits"] >= 1
    assert figures["max_verified_error"] <= figures["tolerance"]
    assert figures["anomalies"] == {}


# --- the state shapes (the cost model: test_cost_model.py) ------------------------------------


def test_state_shapes_scale_every_dimension():
    kimi_linear = architecture_of(resolve_model("kimi-linear-48b-a3b"))
    full = state_shape(kimi_linear, 3, 1.0)
    assert (full.layers, full.heads, full.key_dim, full.value_dim) == (7, 32, 128, 128)
    assert full.nbytes == 7 * 32 * 128 * 128 * 4  # fp32: 14 MiB a block per group
    small = state_shape(kimi_linear, 1, 1 / 16)
    assert (small.layers, small.heads, small.key_dim, small.value_dim) == (2, 2, 8, 8)
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="--state-scale"):
            state_shape(kimi_linear, 1, bad)


# --- the replay command ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """A small shared-prompt workload replayed with --execute under unfixed and fixed, in a
    pool large enough that nothing is preempted."""
    work = tmp_path_factory.mktemp("execute")
    workload = work / "w.kvtrace"
    runner = CliRunner()
    result = runner.invoke(cli, ["synth", "--preset", "shared-prompt", "--requests", "20",
                                 "--seed", "7", "-o", str(workload)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = work / "summary.json"
    result = runner.invoke(cli, ["replay", str(workload), "--execute", "--num-gpu-blocks", "4000",
                                 "--gpu", "350", "-o", str(work / "runs"), "--summary-json",
                                 str(summary), "--db", str(work / "w.duckdb")],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return work, result.output, json.loads(summary.read_text())["variants"]


def test_replay_execute_reports_its_figures_per_variant(executed):
    _, output, variants = executed
    assert set(variants) == {"unfixed", "fixed"}
    for figures in variants.values():
        execute = figures["execute"]
        assert execute["device"] == "cpu" and execute["kernel"] == "torch-chunk"
        assert execute["wrong_state_hits"] == 0 and execute["anomalies"] == {}
        assert execute["verified_hits"] > 0
        assert figures["preemptions"] == 0 and execute["resumed_recomputed_tokens"] == 0
        assert execute["recomputed_tokens"] == figures["prompt_tokens"] - figures["hit_tokens"]
        assert execute["measured_prefill_s"] > 0
        assert execute["estimated_gpu_s"] == pytest.approx(
            execute["recompute_flops"] / 350e12, rel=1e-5)
    assert "wrong st" in output and "gpu s" in output and "torch-chunk" in output


def test_the_gpu_seconds_query_prices_the_difference_between_the_variants(executed):
    """Summed over prefixes, what each variant recomputed where the other hit deeper is the
    difference of their whole recompute costs (the cost of [h, T) is additive in h)."""
    from kvtrace.analysis.database import open_database
    from kvtrace.analysis.queries import run_query

    work, _, variants = executed
    connection = open_database(work / "w.duckdb")
    try:
        result = run_query(connection, "recompute_gpu_seconds",
                           {"gpu_flops_per_s": "350e12"})  # the replay's --gpu
    finally:
        connection.close()
    rows = [dict(zip(result.columns, row)) for row in result.rows]
    assert rows and {row["cost_model"] for row in rows} == {"kimi-k3"}  # synth's default
    spent = {name: sum(r["gpu_seconds"] for r in rows if r["variant"] == name)
             for name in variants}
    estimated = {name: figures["execute"]["estimated_gpu_s"]
                 for name, figures in variants.items()}
    assert spent["unfixed"] - spent["fixed"] == pytest.approx(
        estimated["unfixed"] - estimated["fixed"], abs=1e-5)


def test_the_report_shows_the_gpu_seconds_per_variant(executed):
    from kvtrace.analysis.report import report_database

    work, _, _ = executed
    text = report_database(str(work / "w.duckdb"))
    section = text.partition("== GPU-seconds recomputing hits the other variant kept ==")[2]
    section = section.partition("\n== ")[0]
    rows = [line.split() for line in section.splitlines() if line.startswith("w.kvtrace")]
    assert {(row[1], row[2]) for row in rows} <= {("unfixed", "fixed"), ("fixed", "unfixed")}
    assert rows and all(row[-1] == "kimi-k3" for row in rows)
    assert "== Top prefixes by GPU-seconds recomputed ==" in text


@pytest.mark.parametrize("args,message", [
    (["--device", "cpu"], "--device applies to execute mode only"),
    (["--execute", "--gpu", "a100"], "neither a device preset"),
    (["--execute", "--state-scale", "2"], "--state-scale must be in"),
])
def test_bad_execute_options_are_refused(executed, args, message):
    work, _, _ = executed
    result = CliRunner().invoke(cli, ["replay", str(work / "w.kvtrace"), "-o",
                                      str(work / "refused"), *args])
    assert result.exit_code != 0
    assert message in result.output
    assert not (work / "refused").exists() or not any((work / "refused").iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_device_is_a_clear_error():
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        StateExecutor(seed_config(0), ExecuteOptions(device="cuda", model="kimi-linear-48b-a3b"))


def test_the_replay_driver_imports_no_torch():
    code = "import sys, kvtrace.replay.run; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


# --- GPU ------------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_recurrence_matches_the_cpu_reference():
    state, k, v, g, beta = random_inputs(4, 100, 64, 64)
    expected = recurrent_kda_state(state, k, v, g, beta)
    got = chunk_kda_state(*(x.cuda() for x in (state, k, v, g, beta)), 16)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-8, atol=1e-8)


@needs_cuda
def test_fla_chunk_kda_matches_the_torch_reference():
    kernel = fla_kernel()
    if kernel is None:
        pytest.skip("flash-linear-attention (fla) is not importable here")
    error = check_kernel(kernel, TorchKernel(16), torch.device("cuda"))
    assert error <= 1e-2


@needs_cuda
def test_the_seed_scenario_on_cuda_gives_the_cpu_verdicts():
    """The cache replay needs vLLM (on the CPU), the state runs on the GPU; a GPU machine
    without vLLM checks the same on prepared traces (benchmarks/execute.py traces)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/device-check "
                                       "compares CPU and CUDA on prepared traces instead)")
    from kvtrace.replay.vllm_backend import VllmBackend

    for variant in ("naive", "fixed"):
        cpu, records = run_seed_scenario(VllmBackend, variant)
        with StateExecutor(seed_config(0), ExecuteOptions(device="cuda", model="kimi-linear-48b-a3b")) as engine:
            assert engine.pool.device.type == "cuda"
            for record in records:
                engine(record)
            cuda = engine.finish()
        for key in ("verified_hits", "wrong_state_hits", "stale_key_reads",
                    "recomputed_tokens", "first_wrong_state_hit"):
            assert cuda[key] == cpu[key], key


def test_a_kernel_that_disagrees_is_refused():
    class Wrong:
        name = "wrong"

        def __call__(self, state, k, v, g, beta):
            return state

    with pytest.raises(KvtraceError, match="disagrees with the torch reference"):
        check_kernel(Wrong(), TorchKernel(16), torch.device("cpu"))


@pytest.mark.parametrize("model, state", [
    ("nemotron-h-8b", "1 layers x 8 heads x 8 x 8 float32"),  # Mamba2: 24 layers in 6 groups
    ("qwen3-next-80b-a3b", "1 layers x 2 heads x 8 x 8 bfloat16"),  # GDN: 36 layers in 12
])
def test_execute_mode_runs_every_family_on_its_own_state(tmp_path, model, state):
    """Not only the Kimi family: each model's recurrent state (shape and dtype, from the one
    architecture description) is re-executed, and every hit verified."""
    workload = tmp_path / "w.kvtrace"
    runner = CliRunner()
    result = runner.invoke(cli, ["synth", "--preset", "shared-prompt", "--requests", "12",
                                 "--seed", "3", "--model", model, "-o", str(workload)])
    assert result.exit_code == 0, result.output
    summary = tmp_path / "s.json"
    result = runner.invoke(cli, ["replay", str(workload), "--execute", "--backend", "model",
                                 "--num-gpu-blocks", "2000", "--variant", "fixed", "-o",
                                 str(tmp_path / "runs"), "--summary-json", str(summary)])
    assert result.exit_code == 0, result.output
    execute = json.loads(summary.read_text())["variants"]["fixed"]["execute"]
    assert execute["model"] == model and execute["state"].startswith(state)
    assert execute["verified_hits"] > 0 and execute["wrong_state_hits"] == 0
    assert execute["anomalies"] == {}


def test_execute_mode_needs_the_model_of_a_source_that_names_none():
    with pytest.raises(ConfigError, match="names none"):
        StateExecutor(seed_config(0), ExecuteOptions(device="cpu"))
