"""The one architecture description (geometry/architecture.py, read by families.py) and the
prefill cost model built on it: each bundled model's price of a recomputed token, computed by
hand from its config.json, and the description checked against the geometry's own readings."""

from __future__ import annotations

import json

import pytest

from kvtrace.errors import ConfigError
from kvtrace.geometry.architecture import MAMBA, Attention, Mamba2
from kvtrace.geometry.bundled import PRESET_TENSOR_PARALLEL, geometry_for
from kvtrace.geometry.cost import (
    UTILISATION,
    CostModel,
    FlopsPerToken,
    cost_model,
    flops_per_token,
    gpu_throughput,
)
from kvtrace.geometry.families import architecture_of, family_of
from kvtrace.geometry.presets import preset_names, resolve_model
from kvtrace.geometry.weights import model_weights

H200 = 989.4e12 * UTILISATION  # the default GPU, effective FLOP/s


def architecture(name: str):
    return architecture_of(resolve_model(name))


def price_by_hand(constant: int, per_position: int, hit: int, tokens: int) -> float:
    """GPU-seconds of prefilling [hit, tokens): each token t costs constant + per_position * (t+1)."""
    return sum(constant + per_position * (t + 1) for t in range(hit, tokens)) / H200


# --- each bundled model, by hand from its config.json ------------------------------------------


def test_kimi_linear_flops_per_token_by_hand():
    """Kimi-Linear-48B-A3B (config.json), token at depth 8191 (8,192 positions attended)."""
    d = 2304
    mla = (d * 32 * (128 + 64)  # q_proj (no q_lora)
           + d * (512 + 64)  # kv_a_proj_with_mqa
           + 512 * 32 * (128 + 128)  # kv_b_proj
           + 32 * 128 * d)  # o_proj
    assert mla == 29_114_368
    kda = (3 * d * 4096  # q, k, v
           + 2 * (d * 128 + 128 * 4096)  # f_a, f_b, g_a, g_b
           + d * 32  # b_proj
           + 4096 * d)  # o_proj
    assert kda == 39_460_864
    kda_extra = 2 * 4 * 3 * 4096 + 7 * 32 * 128 * 128  # short convs, recurrence
    moe = d * 256 + (8 + 1) * 3 * d * 1024  # router, 8 routed + 1 shared expert
    dense = 3 * d * 9216  # layer 0's MLP
    constant = 2 * (20 * kda + 7 * mla + 26 * moe + dense) + 20 * kda_extra
    per_position = 7 * 2 * 32 * (128 + 64 + 128)
    assert (constant, per_position) == (5_531_926_528, 143_360)
    flops = flops_per_token(architecture("kimi-linear-48b-a3b"))
    assert flops == FlopsPerToken(constant, per_position)
    assert flops.at_depth(8191) == 6_706_331_648
    assert cost_model("kimi-linear-48b-a3b").gpu_seconds(1024, 8192) == pytest.approx(
        price_by_hand(constant, per_position, 1024, 8192), rel=1e-12)


def test_kimi_k3_price_by_hand_at_tensor_parallel_16():
    """Kimi-K3 (text_config), served at TP 16: every rank computes the replicated matrices
    whole (the MLA latents, KDA's f_a, the router, the latent MoE's down / up projections)."""
    d, tp = 7168, 16
    proj = 96 * 128
    kda = 3 * d * proj + 128 * proj + d * proj + d * 96 + proj * d  # q/k/v, f_b, g_proj, b, o
    kda_replicated = d * 128  # f_a
    kda_extra = 2 * 4 * 3 * proj + 7 * 96 * 128 * 128
    mla = (1536 * 96 * 192  # q_b_proj
           + 512 * 96 * (128 + 128)  # kv_b_proj
           + d * 96 * 128  # g_proj (mla_use_output_gate)
           + 96 * 128 * d)  # o_proj
    mla_replicated = d * 1536 + d * (512 + 64)  # q_a_proj, kv_a_proj_with_mqa
    moe = 16 * 3 * 3584 * 3072 + 3 * d * 2 * 3072  # 16 routed experts in 3584, 2 shared
    moe_replicated = d * 896 + 2 * d * 3584  # router, latent down and up projections
    dense = 3 * d * 33792  # layer 0
    matrices = (69 * (kda + tp * kda_replicated) + 24 * (mla + tp * mla_replicated)
                + 92 * (moe + tp * moe_replicated) + dense)
    constant = 2 * matrices + 69 * kda_extra
    per_position = 24 * 2 * 96 * (128 + 64 + 128)
    model = cost_model("kimi-k3")
    assert model.tensor_parallel_size == PRESET_TENSOR_PARALLEL["kimi-k3"] == tp
    assert model.flops == FlopsPerToken(constant, per_position)
    assert model.gpu_seconds(1024, 8192) == pytest.approx(
        price_by_hand(constant, per_position, 1024, 8192), rel=1e-12)
    single = cost_model("kimi-k3", tensor_parallel_size=1).flops.constant
    assert constant - single == 2 * (tp - 1) * (
        69 * kda_replicated + 24 * mla_replicated + 92 * moe_replicated)


def test_nemotron_h_8b_price_by_hand():
    """Nemotron-H-8B: 24 Mamba2 mixers, 4 attention layers, 24 squared-ReLU MLPs."""
    pattern = resolve_model("nemotron-h-8b").config["hybrid_override_pattern"]
    assert (pattern.count("M"), pattern.count("*"), pattern.count("-")) == (24, 4, 24)
    d = 4096
    inner, groups_state = 128 * 64, 8 * 128
    mamba = d * (2 * inner + 2 * groups_state + 128) + inner * d  # in_proj, out_proj
    mamba_extra = 2 * 4 * (inner + 2 * groups_state) + 5 * 128 * 64 * 128  # conv, SSD
    attention = d * 32 * 128 + 2 * d * 8 * 128 + 32 * 128 * d  # q, k and v (8 KV heads), o
    mlp = 2 * d * 21504  # up, down
    constant = 2 * (24 * mamba + 4 * attention + 24 * mlp) + 24 * mamba_extra
    per_position = 4 * 2 * 32 * (128 + 128)
    model = cost_model("nemotron-h-8b")
    assert model.tensor_parallel_size == 1
    assert model.flops == FlopsPerToken(constant, per_position) == FlopsPerToken(
        14_178_713_600, 65_536)
    assert model.gpu_seconds(1024, 8192) == pytest.approx(
        price_by_hand(constant, per_position, 1024, 8192), rel=1e-12)


def test_qwen3_next_price_by_hand_at_tensor_parallel_2():
    """Qwen3-Next-80B-A3B at TP 2: 36 Gated DeltaNet and 12 gated-attention layers, every one
    with a MoE of 512 experts (10 routed, 1 shared); the router and the shared expert's scalar
    gate run whole on both ranks; 2 KV heads split over 2 ranks need no copies."""
    d, tp = 2048, 2
    key, value = 16 * 128, 32 * 128
    gdn = d * (2 * key + 2 * value) + d * 2 * 32 + value * d  # in_proj_qkvz, in_proj_ba, out
    gdn_extra = 2 * 4 * (2 * key + value) + 7 * 32 * 128 * 128
    attention = d * 2 * 16 * 256 + 2 * d * 2 * 256 + 16 * 256 * d  # gated q, k, v, o
    moe = 10 * 3 * d * 512 + 3 * d * 512  # routed, shared
    moe_replicated = d * 512 + d  # router, shared_expert_gate
    constant = (2 * (36 * gdn + 12 * attention + 48 * (moe + tp * moe_replicated))
                + 36 * gdn_extra)
    per_position = 12 * 2 * 16 * (256 + 256)
    model = cost_model("qwen3-next-80b-a3b")
    assert model.tensor_parallel_size == PRESET_TENSOR_PARALLEL["qwen3-next-80b-a3b"] == tp
    assert model.flops == FlopsPerToken(constant, per_position)
    assert model.gpu_seconds(1024, 8192) == pytest.approx(
        price_by_hand(constant, per_position, 1024, 8192), rel=1e-12)


def test_every_bundled_model_has_a_hand_computed_price():
    """The four tests above cover the presets; a new preset needs its own."""
    assert set(preset_names()) == {"kimi-linear-48b-a3b", "kimi-k3", "nemotron-h-8b",
                                   "qwen3-next-80b-a3b"}


# --- the description against the geometry's own readings -----------------------------------------


@pytest.mark.parametrize("name", preset_names())
def test_the_architecture_serves_the_geometry_layers(name):
    """The cache layers the geometry builds are the architecture's blocks that keep a cache,
    and every recurrent block is a Mamba-kind layer."""
    source = resolve_model(name)
    model = architecture_of(source)
    plans = family_of(source.architecture).layers(source.text_config)
    assert [p.name for p in plans] == [b.path for b in model.blocks if b.part.cache_kind]
    assert sum(p.kind == MAMBA for p in plans) == model.recurrent_layers


@pytest.mark.parametrize("name", preset_names())
def test_the_architectures_matrices_are_the_models_parameters(name):
    """Summed with every expert, the matrices plus the embeddings are the parameters
    geometry/weights.py counts (checked there against the published totals) within 0.05%:
    what is left is norms, convolutions, biases, scalar gates and Kimi-K3's vision tower."""
    source = resolve_model(name)
    text = source.text_config
    embeddings = text["vocab_size"] * text["hidden_size"] * (
        1 if text.get("tie_word_embeddings") else 2)
    counted = sum(linear.weights for linear in architecture_of(source).linears(
        every_expert=True)) + embeddings
    parameters = model_weights(source.architecture, source.config).parameters
    assert 0 <= parameters - counted <= 5e-4 * parameters


def test_recurrent_states_and_dtypes_per_family():
    """What execute mode re-executes: KDA's heads x 128 x 128 in fp32, Qwen3-Next's Gated
    DeltaNet per value head in the model's bf16, Nemotron-H's Mamba2 heads x state x head_dim
    in fp32 (vLLM's defaults under --mamba-ssm-cache-dtype auto)."""
    figures = {name: (architecture(name).recurrent_layers,
                      tuple(vars(architecture(name).recurrent_state).values()),
                      architecture(name).state_dtype) for name in preset_names()}
    assert figures == {
        "kimi-linear-48b-a3b": (20, (32, 128, 128), "float32"),
        "kimi-k3": (69, (96, 128, 128), "float32"),
        "nemotron-h-8b": (24, (128, 128, 64), "float32"),
        "qwen3-next-80b-a3b": (36, (32, 128, 128), "bfloat16"),
    }


def test_tensor_parallelism_copies_what_vllm_copies():
    """KV heads fewer than ranks are copied (QKVParallelLinear), so are Mamba2's B and C when
    its groups do not divide over the ranks; split matrices cost the same at any size."""
    attention = Attention(heads=16, kv_heads=2, head_dim=128)
    assert [l.outputs for l in attention.linears(1024, tp=8)][1:3] == [8 * 128, 8 * 128]
    assert [l.outputs for l in attention.linears(1024, tp=2)][1:3] == [2 * 128, 2 * 128]
    mixer = Mamba2(heads=8, head_dim=64, n_groups=1, state_size=128, conv_kernel=4)
    assert [l.replicated for l in mixer.linears(1024, tp=2)] == [False, True, False]
    assert not any(l.replicated for l in mixer.linears(1024, tp=1))
    nemotron = architecture("nemotron-h-8b")
    assert flops_per_token(nemotron, 2).constant == flops_per_token(nemotron, 1).constant


def test_a_user_config_is_priced_from_its_own_fields(tmp_path):
    """A config.json that is not a preset: half the layers of Nemotron-H-8B's pattern cost what
    their blocks cost; one missing a field the layout needs is a clear error."""
    config = resolve_model("nemotron-h-8b").config
    config["hybrid_override_pattern"] = "M-M*-"
    (tmp_path / "config.json").write_text(json.dumps(config))
    small = cost_model(str(tmp_path))
    full = architecture("nemotron-h-8b")
    mamba, attention, mlp = (next(b.part for b in full.blocks if type(b.part).__name__ == kind)
                             for kind in ("Mamba2", "Attention", "DenseMlp"))
    by_part = {part: 2 * sum(l.weights for l in part.linears(4096)) + part.token_flops()
               for part in (mamba, attention, mlp)}
    assert small.flops.constant == 2 * by_part[mamba] + by_part[attention] + 2 * by_part[mlp]
    del config["n_groups"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no 'n_groups', which the Nemotron-H layout needs"):
        cost_model(str(tmp_path))


@pytest.mark.parametrize("name", preset_names())
def test_a_preset_is_priced_by_the_repository_vllm_serves_it_as(name):
    """`vllm serve moonshotai/Kimi-K3` serves the model by that name, which a capture records:
    the preset read from that repository, in any case, at the preset's tensor-parallel size; a
    repository kvtrace has no preset of is an error that says what it takes."""
    repository = "/".join(resolve_model(name).source["url"].split("/")[3:5])
    for served in (repository, repository.upper()):
        assert resolve_model(served).name == name
        assert cost_model(served) == cost_model(name)
    assert cost_model(repository).tensor_parallel_size == PRESET_TENSOR_PARALLEL.get(name, 1)
    assert geometry_for(repository) == geometry_for(name)  # the shipped one, at that size
    with pytest.raises(ConfigError, match="nor the Hugging Face repository of a preset"):
        resolve_model(repository + "-FP8")


def test_a_source_that_names_a_presets_repository_is_priced_as_that_preset(tmp_path):
    """A replay of a source whose header names the model as vLLM served it (the repository)
    prices its lookups as the preset, without --model."""
    import msgspec.structs

    from kvtrace.replay.options import ReplayOptions
    from kvtrace.replay.run import replay
    from kvtrace.traceio import TraceReader, read_records, write_trace
    from kvtrace.workloads.synth import synthesize
    from kvtrace.workloads.workload import EngineShape, write_workload

    shape = EngineShape(model="nemotron-h-8b")
    workload = tmp_path / "w.kvtrace"
    write_workload(workload, synthesize("chat", 5, 0, shape.hash_block_size), shape)
    reader, records = read_records(workload)
    assert reader.header.params["model"] == "nemotron-h-8b"
    header = msgspec.structs.replace(reader.header, params={
        **reader.header.params, "model": "nvidia/Nemotron-H-8B-Base-8K"})
    served = tmp_path / "served.kvtrace"
    write_trace(served, header, records)
    result = replay(ReplayOptions(source=str(served), outdir=str(tmp_path / "runs"),
                                  variants=("unfixed",), backend="model"))
    params = TraceReader(str(result.variants[0].output)).header.params
    assert params["cost.model"] == "nemotron-h-8b"
    assert params["cost.flops_per_token"] == str(cost_model("nemotron-h-8b").flops.constant)


# --- GPUs and the arithmetic -----------------------------------------------------------------------


def test_recompute_flops_sum_the_tokens_recomputed():
    flops = flops_per_token(architecture("kimi-linear-48b-a3b"))
    assert flops.recompute(96, 1000) == sum(flops.at_depth(t) for t in range(96, 1000))
    assert flops.recompute(500, 500) == flops.recompute(600, 500) == 0


def test_gpu_presets_and_overrides():
    h200 = gpu_throughput("H200")
    assert h200.flops_per_s == pytest.approx(989.4e12 * UTILISATION)
    assert "989.4 TFLOP/s" in h200.source and f"{UTILISATION:.0%}" in h200.source
    assert h200.title == "an NVIDIA H200 SXM"
    assert gpu_throughput("b200").flops_per_s == pytest.approx(2250e12 * UTILISATION)
    assert gpu_throughput("350").flops_per_s == 350e12
    for bad in ("a100", "0", "-5", "inf", "nan"):
        with pytest.raises(ConfigError, match="neither a device preset"):
            gpu_throughput(bad)
    cost = CostModel(architecture("kimi-linear-48b-a3b"), 1, gpu_throughput("350"))
    assert cost.gpu_seconds(0, 1000) == pytest.approx(cost.flops.recompute(0, 1000) / 350e12)
    params = cost.header_params()
    assert params == {"cost.model": "kimi-linear-48b-a3b", "cost.tensor_parallel_size": "1",
                      "cost.flops_per_token": "5531926528",
                      "cost.flops_per_token_per_position": "143360"}
