"""Real configs (issue 29, part 5): every bundled preset's architecture read from its
config.json as current transformers saves it (and Kimi-K3's as vLLM's own config class saves
it: transformers has none), and from vLLM's ``--hf-overrides`` applied on top as vLLM applies
them. The layout kvtrace derives is checked against the saved config's own fields, and the
overrides against vLLM 0.33's own code applying them."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.errors import ConfigError
from kvtrace.geometry import resolve_model
from kvtrace.geometry.architecture import ATTENTION, MAMBA, MLA
from kvtrace.geometry.cost import cost_model
from kvtrace.geometry.families import family_of
from kvtrace.geometry.presets import apply_hf_overrides, model_spec, vllm_form
from kvtrace.geometry.weights import model_weights


def kinds(source) -> list[str]:
    return [plan.kind for plan in family_of(source.architecture).layers(source.text_config)]


def saved(config, folder: Path, architecture: str) -> Path:
    """The folder ``config`` (a config class instance) is saved into, as ``save_pretrained``
    writes it, naming ``architecture`` (a model's checkpoint does)."""
    config.architectures = [architecture]
    config.save_pretrained(folder)
    return folder


# --- configs as the installed transformers saves them ----------------------------------------


def test_qwen3_next_as_transformers_saves_it(tmp_path):
    """transformers 5 writes ``layer_types`` and no ``full_attention_interval``: each layer's
    cache kind is its own type's, and the model is the preset's."""
    from transformers import Qwen3NextConfig

    preset = resolve_model("qwen3-next-80b-a3b")
    folder = saved(Qwen3NextConfig(**preset.config), tmp_path, "Qwen3NextForCausalLM")
    fields = json.loads((folder / "config.json").read_text())
    assert "full_attention_interval" not in fields and len(fields["layer_types"]) == 48
    read = resolve_model(folder)
    assert kinds(read) == [ATTENTION if t == "full_attention" else MAMBA
                           for t in fields["layer_types"]]
    assert kinds(read) == kinds(preset)
    assert (model_weights(read.architecture, read.config)
            == model_weights(preset.architecture, preset.config))


def test_nemotron_h_as_transformers_saves_it(tmp_path):
    """``layers_block_type`` (no ``hybrid_override_pattern``, no ``num_hidden_layers``): a
    Mamba2 cache per linear_attention block, attention per full_attention block, none for
    mlp / moe."""
    from transformers import NemotronHConfig

    preset = resolve_model("nemotron-h-8b")
    folder = saved(NemotronHConfig(**preset.config), tmp_path, "NemotronHForCausalLM")
    fields = json.loads((folder / "config.json").read_text())
    assert "hybrid_override_pattern" not in fields and "num_hidden_layers" not in fields
    read = resolve_model(folder)
    cache = {"linear_attention": MAMBA, "full_attention": ATTENTION}
    assert set(fields["layers_block_type"]) == {*cache, "mlp"}
    assert kinds(read) == [cache[t] for t in fields["layers_block_type"] if t in cache]
    assert kinds(read) == kinds(preset)
    assert (model_weights(read.architecture, read.config).parameters
            == model_weights(preset.architecture, preset.config).parameters == 8_100_852_736)


def kimi_linear_as_transformers_makes_it(preset) -> dict:
    """Kimi-Linear-48B-A3B's fields the way transformers 5's own ``KimiLinearConfig`` takes
    them (a config made with transformers, not loaded from the checkpoint): ``layer_types``,
    ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim`` and
    ``mlp_layer_types`` in place of ``linear_attn_config``, ``first_k_dense_replace`` and
    ``moe_layer_freq``."""
    fields = {key: value for key, value in preset.config.items()
              if key not in ("linear_attn_config", "first_k_dense_replace", "moe_layer_freq",
                             "rope_scaling", "architectures")}
    linear = preset.config["linear_attn_config"]
    count = preset.config["num_hidden_layers"]
    return {**fields,
            "layer_types": ["linear_attention" if i + 1 in linear["kda_layers"]
                            else "full_attention" for i in range(count)],
            "mlp_layer_types": ["dense" if i < preset.config["first_k_dense_replace"]
                                else "sparse" for i in range(count)],
            "linear_num_heads": linear["num_heads"], "linear_head_dim": linear["head_dim"],
            "linear_conv_kernel_dim": linear["short_conv_kernel_size"]}


def test_kimi_linear_as_transformers_saves_it(tmp_path):
    """transformers 5 saves Kimi-Linear without ``linear_attn_config``, which is all vLLM
    0.33 reads its KDA layers from: kvtrace read every layer as MLA. Now a KDA cache per
    linear_attention layer, MLA per full_attention layer, MoE per sparse one, and the model
    is the checkpoint's (its published parameter count)."""
    from transformers import KimiLinearConfig

    preset = resolve_model("kimi-linear-48b-a3b")
    folder = saved(KimiLinearConfig(**kimi_linear_as_transformers_makes_it(preset)), tmp_path,
                   "KimiLinearForCausalLM")
    fields = json.loads((folder / "config.json").read_text())
    assert "linear_attn_config" not in fields and "first_k_dense_replace" not in fields
    read = resolve_model(folder)
    assert kinds(read) == [MAMBA if t == "linear_attention" else MLA
                           for t in fields["layer_types"]]
    assert kinds(read) == kinds(preset)
    blocks = family_of(read.architecture).blocks(read.text_config)
    moe = [block.layer for block in blocks if type(block.part).__name__ == "MixtureOfExperts"]
    assert moe == [i for i, t in enumerate(fields["mlp_layer_types"]) if t == "sparse"]
    assert model_weights(read.architecture, read.config).parameters == 49_122_681_728
    assert cost_model(str(folder)).flops == cost_model("kimi-linear-48b-a3b", 1).flops


def test_a_kimi_linear_loaded_from_its_checkpoint_and_saved_keeps_the_checkpoints_fields(
        tmp_path):
    from transformers import KimiLinearConfig

    preset = resolve_model("kimi-linear-48b-a3b")
    read = resolve_model(saved(KimiLinearConfig(**preset.config), tmp_path,
                               "KimiLinearForCausalLM"))
    assert read.text_config["linear_attn_config"] == preset.config["linear_attn_config"]
    assert kinds(read) == kinds(preset)


@pytest.mark.slow  # imports vLLM
def test_kimi_k3_as_vllms_config_class_saves_it(tmp_path):
    """transformers has no Kimi-K3: vLLM's own ``KimiK3Config`` saves it, its text config
    nested."""
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

    preset = resolve_model("kimi-k3")
    folder = saved(KimiK3Config(**preset.config), tmp_path, "KimiK3ForConditionalGeneration")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    read = resolve_model(folder)
    kda = set(text["linear_attn_config"]["kda_layers"])
    assert kinds(read) == [MAMBA if i + 1 in kda else MLA
                           for i in range(text["num_hidden_layers"])]
    assert kinds(read) == kinds(preset)


def test_a_layer_type_kimi_does_not_have_is_one_error():
    with pytest.raises(ConfigError, match="layer_types has a layer 'sliding_attention'"):
        vllm_form({"model_type": "kimi_linear", "layer_types": ["sliding_attention"]})
    with pytest.raises(ConfigError, match="is not dense layers then sparse ones"):
        vllm_form({"model_type": "kimi_linear", "layer_types": ["linear_attention"] * 3,
                   "mlp_layer_types": ["dense", "sparse", "dense"]})


# --- vLLM's --hf-overrides -------------------------------------------------------------------

OVERRIDES = [
    ("qwen3-next-80b-a3b", {"num_hidden_layers": 8}),
    ("kimi-linear-48b-a3b", {"num_hidden_layers": 8}),
    ("kimi-k3", {"text_config": {"num_hidden_layers": 12}}),
    ("kimi-k3", {"text_config": {"linear_attn_config": {"kda_layers": [1, 2, 3]}}}),
    ("nemotron-h-8b", {"layers_block_type": ["mamba", "attention", "mamba", "mlp"]}),
    ("nemotron-h-8b", {"layer_types": ["mamba", "attention"]}),
    ("nemotron-h-8b", {"num_hidden_layers": 8}),  # transformers 5 ignores it: the pattern rules
]


def vllm_applied(config: dict, overrides: dict, folder: Path) -> dict:
    """``config`` with ``overrides`` applied by vLLM 0.33's own code: ``get_config`` (the
    flat ones, ``config.update``) and ``ModelConfig._apply_dict_overrides`` (dicts)."""
    from vllm.config import ModelConfig
    from vllm.transformers_utils.config import get_config

    (folder / "config.json").write_text(json.dumps(config))
    hf_config = get_config(folder, trust_remote_code=False, hf_overrides_kw={
        key: value for key, value in overrides.items() if not isinstance(value, dict)})
    model_config = types.SimpleNamespace()  # the two methods use nothing else of it
    model_config._update_nested = lambda target, updates: ModelConfig._update_nested(
        model_config, target, updates)
    ModelConfig._apply_dict_overrides(model_config, hf_config, {
        key: value for key, value in overrides.items() if isinstance(value, dict)})
    return {**hf_config.to_dict(), "architectures": config["architectures"]}


@pytest.mark.slow
@pytest.mark.parametrize("preset, overrides", OVERRIDES,
                         ids=[f"{p}-{next(iter(o))}-{i}" for i, (p, o) in enumerate(OVERRIDES)])
def test_hf_overrides_give_the_model_vllm_builds(preset, overrides, tmp_path):
    """kvtrace's overrides and vLLM's give the same layers and weights; the model is named
    as vLLM was told it, which resolves to the same model again."""
    source = resolve_model(preset)
    applied = resolve_model(preset, overrides)
    by_vllm = vllm_applied(source.config, overrides, tmp_path)
    text = vllm_form(by_vllm).get("text_config") or vllm_form(by_vllm)
    family = family_of(source.architecture)
    assert kinds(applied) == [plan.kind for plan in family.layers(text)]
    assert (model_weights(applied.architecture, applied.config)
            == model_weights(source.architecture, vllm_form(by_vllm)))
    assert applied.name == model_spec(preset, overrides)
    assert resolve_model(applied.name).config == applied.config


def test_hf_overrides_change_the_layer_count_as_vllm_builds_it():
    """Qwen3-Next keeps its ``layer_types`` and builds the first ``num_hidden_layers``; Kimi
    counts ``kda_layers`` within them; a nested config is updated key by key."""
    assert kinds(resolve_model("qwen3-next-80b-a3b", {"num_hidden_layers": 8})) == (
        [MAMBA] * 3 + [ATTENTION] + [MAMBA] * 3 + [ATTENTION])
    assert kinds(resolve_model("kimi-linear-48b-a3b", '{"num_hidden_layers": 8}')) == (
        [MAMBA] * 3 + [MLA] + [MAMBA] * 3 + [MLA])
    k3 = resolve_model("kimi-k3", {"text_config": {"num_hidden_layers": 12}})
    assert k3.text_config["hidden_size"] == 7168 and len(kinds(k3)) == 12
    assert kinds(resolve_model("nemotron-h-8b", {"num_hidden_layers": 8})) == kinds(
        resolve_model("nemotron-h-8b"))


def test_overrides_vllm_cannot_apply_are_refused():
    with pytest.raises(ConfigError, match="sets hybrid_override_pattern"):
        resolve_model("nemotron-h-8b", {"hybrid_override_pattern": "M*"})
    with pytest.raises(ConfigError, match="is not JSON"):
        resolve_model("nemotron-h-8b", "{num_hidden_layers: 8}")
    with pytest.raises(ConfigError, match="is not a JSON object"):
        resolve_model("nemotron-h-8b", "[8]")
    with pytest.raises(ConfigError, match="layer_types names 48 layers and its "
                                          "num_hidden_layers 50"):
        kinds(resolve_model("qwen3-next-80b-a3b", {
            "num_hidden_layers": 50, "layer_types": ["linear_attention"] * 48}))


def test_a_dict_override_replaces_a_dict_field_and_merges_into_a_nested_config():
    """vLLM's rule: a dict sets a dict-valued field whole, but goes key by key into a
    nested config (``_update_nested``, dicts in it merged alike)."""
    config = {"model_type": "x", "rope_scaling": {"type": "yarn", "factor": 4},
              "text_config": {"model_type": "y", "a": 1, "inner": {"b": 2, "c": 3}}}
    applied = apply_hf_overrides(config, {"rope_scaling": {"factor": 2},
                                          "text_config": {"inner": {"b": 5}}})
    assert applied["rope_scaling"] == {"factor": 2}
    assert applied["text_config"] == {"model_type": "y", "a": 1, "inner": {"b": 5, "c": 3}}
    assert config["text_config"]["inner"] == {"b": 2, "c": 3}, "the input is left as it was"


def test_the_clis_model_options_take_hf_overrides(tmp_path):
    """geometry, replay, report, synth and import take ``--hf-overrides`` beside ``--model``,
    and name the model with them; without ``--model`` it is a usage error."""
    from kvtrace.cli.model_options import with_hf_overrides

    assert with_hf_overrides("qwen3-next-80b-a3b", '{"num_hidden_layers": 8}') == (
        'qwen3-next-80b-a3b --hf-overrides {"num_hidden_layers": 8}')
    assert with_hf_overrides('q --hf-overrides {"a": 1}', '{"b": 2}') == (
        'q --hf-overrides {"a": 1, "b": 2}')
    runner = CliRunner()
    for command in (["geometry"], ["replay"], ["report"], ["synth"], ["import", "mooncake"]):
        assert "--hf-overrides JSON" in runner.invoke(cli, [*command, "--help"]).output
    result = runner.invoke(cli, ["report", str(tmp_path / "no.duckdb"), "--hf-overrides",
                                 '{"num_hidden_layers": 8}'])
    assert result.exit_code == 2 and "--hf-overrides applies to a --model" in result.output
    bad = runner.invoke(cli, ["geometry", "--model", "qwen3-next-80b-a3b", "--hf-overrides",
                              "8 layers"])
    assert bad.exit_code == 1 and "--hf-overrides '8 layers' is not JSON" in bad.stderr


@pytest.mark.slow  # vLLM's code computes the geometry (tens of seconds)
def test_a_workload_for_a_model_with_overrides_names_it_so(tmp_path):
    """``synth --model M --hf-overrides J``: the workload's geometry is that of M with J (vLLM's
    code computes it), and its header names the model as vLLM was told it, which a replay
    prices with."""
    pytest.importorskip("vllm")
    path = tmp_path / "w.kvtrace"
    result = CliRunner().invoke(cli, [
        "synth", "--preset", "shared-prompt", "--requests", "5", "--model",
        "qwen3-next-80b-a3b", "--hf-overrides", '{"num_hidden_layers": 8}', "-o", str(path)])
    assert result.exit_code == 0, result.output + result.stderr
    from kvtrace.traceio import TraceReader

    header = TraceReader(str(path)).header
    assert header.params["model"] == 'qwen3-next-80b-a3b --hf-overrides {"num_hidden_layers": 8}'
    groups = [group.kind for group in header.config.kv_cache_groups]
    assert groups.count("full_attention") == 1 and groups.count("mamba") == 3  # 2 + 6 layers


@pytest.mark.slow  # vLLM's code computes the geometry (tens of seconds)
def test_vllms_code_computes_the_shipped_geometry_from_kimi_linear_as_transformers_saves_it(
        tmp_path):
    """vLLM 0.33 is handed the config in the form it reads (``linear_attn_config``): its own
    code gives the preset's shipped geometry, block for block."""
    from transformers import KimiLinearConfig

    from kvtrace.geometry.bundled import PRESET_TENSOR_PARALLEL, geometry_for
    from kvtrace.geometry.compute import H200_GIB, compute_geometry

    preset = resolve_model("kimi-linear-48b-a3b")
    folder = saved(KimiLinearConfig(**kimi_linear_as_transformers_makes_it(preset)), tmp_path,
                   "KimiLinearForCausalLM")
    computed = compute_geometry(folder, gpu_memory_gib=H200_GIB, cache_dir=tmp_path / "cache",
                                tensor_parallel_size=PRESET_TENSOR_PARALLEL[preset.name])
    shipped = geometry_for(preset.name)
    assert [(g.kind, g.num_layers, g.block_size) for g in computed.groups] == [
        (g.kind, g.num_layers, g.block_size) for g in shipped.groups]
    assert (computed.block_size, computed.num_gpu_blocks, computed.hash_block_size) == (
        shipped.block_size, shipped.num_gpu_blocks, shipped.hash_block_size)


def test_a_capture_names_the_model_with_the_overrides_its_engine_applied():
    """The capture's header names the model as the engine was told it; a replay prices the
    recomputed tokens with that model (``cost_model`` of the header's name)."""
    from kvtrace.capture.live_engine import served_model

    def scheduler(overrides):
        model_config = types.SimpleNamespace(served_model_name="Qwen/Qwen3-Next-80B-A3B-Instruct",
                                             hf_overrides=overrides)
        return types.SimpleNamespace(vllm_config=types.SimpleNamespace(model_config=model_config))

    named = served_model(scheduler({"num_hidden_layers": 8}))["model"]
    assert named == 'Qwen/Qwen3-Next-80B-A3B-Instruct --hf-overrides {"num_hidden_layers": 8}'
    priced = cost_model(named)
    assert len(kinds(resolve_model(named))) == 8
    assert priced.tensor_parallel_size == cost_model("qwen3-next-80b-a3b").tensor_parallel_size
    assert priced.flops.constant < cost_model("qwen3-next-80b-a3b").flops.constant
    assert served_model(scheduler({}))["model"] == "Qwen/Qwen3-Next-80B-A3B-Instruct"
    assert served_model(scheduler(lambda config: config))["model"] == (
        "Qwen/Qwen3-Next-80B-A3B-Instruct")  # a function (Python's LLM API) is no JSON
