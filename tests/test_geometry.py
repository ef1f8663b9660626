"""``kvtrace geometry``: the cache geometry vLLM 0.33 builds for real hybrid models.

Expected figures are computed by hand from each preset's config fields (state shapes from
vLLM's MambaStateShapeCalculator formulas, written out here) and the block-size rule; the
reproduced parts are checked against the installed vLLM where its code runs on CPU.
The tests that import vLLM and build its configs are marked slow (the first ModelConfig per
architecture inspects the model class in a subprocess, ~30 s).
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.errors import ConfigError
from kvtrace.geometry.bundled import PRESET_TENSOR_PARALLEL, geometry_for
from kvtrace.geometry import compute_geometry, preset_names, resolve_model
from kvtrace.geometry.architecture import ATTENTION, MAMBA, MLA
from kvtrace.geometry.families import (FLASHINFER_GDN_CHECKPOINT_ALIGNMENT,
                                       FLASHKDA_CHECKPOINT_ALIGNMENT, family_of)
from kvtrace.geometry.rule import SM90_BACKENDS, SM90_KERNEL_BLOCK, hybrid_block_size
from kvtrace.geometry.weights import model_weights

GIB = 1 << 30
BF16, FP32 = 2, 4
ENGINE_MODEL = Path(__file__).parent.parent / "kvtrace" / "engine" / "engine_model"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- hand-computed geometry per preset ------------------------------------------------------
#
# state bytes: conv state (dim x (kernel - 1)) in the model dtype + the recurrent state;
# attention page per token: MLA kv_lora_rank + qk_rope_head_dim (one latent, no V), full
# attention kv_heads x (K + V) x head_dim; block: alignment x cdiv(state, alignment x page).

def kimi_state(linear: dict, tp: int) -> int:
    projection = linear["num_heads"] * linear["head_dim"]
    conv = 3 * projection // tp * (linear["short_conv_kernel_size"] - 1) * BF16
    recurrent = linear["num_heads"] // tp * linear["head_dim"] ** 2 * FP32  # KDA state: fp32
    return conv + recurrent


def hand_expectations(name: str, tp: int) -> dict:
    source = resolve_model(name)
    t = source.text_config
    if name in ("kimi-linear-48b-a3b", "kimi-k3"):
        state = kimi_state(t["linear_attn_config"], tp)
        attn = (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * BF16  # MLA: not split by TP
        alignment = 128  # the MLA rule
        kda, full = (len(t["linear_attn_config"][k]) for k in ("kda_layers", "full_attn_layers"))
        groups = [("mamba", n) for n in _split(kda, full)] + [("mla_attention", full)]
        checkpoint = 16 if name == "kimi-k3" else None  # FlashKDA; Kimi-Linear runs Triton
    elif name == "qwen3-next-80b-a3b":
        key = t["linear_num_key_heads"] * t["linear_key_head_dim"]
        value = t["linear_num_value_heads"] * t["linear_value_head_dim"]
        state = ((2 * key + value) // tp * (t["linear_conv_kernel_dim"] - 1) * BF16
                 + t["linear_num_value_heads"] // tp * t["linear_value_head_dim"]
                 * t["linear_key_head_dim"] * BF16)  # GDN state in the model dtype
        attn = t["num_key_value_heads"] // tp * 2 * t["head_dim"] * BF16
        alignment = math.lcm(16, 64)  # FlashAttention 16, FlashInfer GDN checkpoints 64
        groups = [("mamba", 12)] * 3 + [("full_attention", 12)]
        checkpoint = "block"  # the prefix-cache grid: the Mamba block itself
    else:
        inner = t["mamba_num_heads"] * t["mamba_head_dim"]
        conv_dim = inner + 2 * t["n_groups"] * t["ssm_state_size"]
        state = (conv_dim // tp * (t["conv_kernel"] - 1) * BF16
                 + t["mamba_num_heads"] // tp * t["mamba_head_dim"] * t["ssm_state_size"]
                 * FP32)  # Nemotron-H's SSM state defaults to float32 in vLLM
        attn = t["num_key_value_heads"] // tp * 2 * t["head_dim"] * BF16
        alignment = 16
        groups = [("mamba", 4)] * 6 + [("full_attention", 4)]
        checkpoint = 1  # mamba_mixer2
    block = alignment * cdiv(state, alignment * attn)
    weights = model_weights(source.architecture, source.config).nbytes
    kv_bytes = int(H200_CUDA_BYTES * 0.9) - cdiv(weights, tp) - 6 * GIB
    bytes_per_block = max(n for _, n in groups) * block * attn
    return dict(block=block, state=state, attn=attn, groups=groups, bytes_per_block=bytes_per_block,
                num_gpu_blocks=kv_bytes // bytes_per_block,
                checkpoint=block if checkpoint == "block" else checkpoint)


# What CUDA reports for an H200 (torch total_memory 143,156 MiB), which vLLM plans with.
H200_CUDA_BYTES = 143_156 << 20


def _split(num_state_layers: int, num_attention_layers: int) -> list[int]:
    """vLLM's uniform-page grouping: groups of the attention layer count, strided."""
    groups = cdiv(num_state_layers, num_attention_layers)
    return [len(range(i, num_state_layers, groups)) for i in range(groups)]


# The smallest tensor-parallel size at which each preset fits one H200 with room for a cache.
PRESET_TP = PRESET_TENSOR_PARALLEL
# The figures the hand arithmetic above gives (docs/commands/geometry.md quotes them).
HAND_BLOCKS = {"kimi-linear-48b-a3b": 1920, "nemotron-h-8b": 1040, "qwen3-next-80b-a3b": 576,
               "kimi-k3": 384}


def test_the_presets_are_the_issues_models_with_their_sources():
    assert set(PRESET_TP) <= set(preset_names())
    for name in preset_names():
        source = resolve_model(name)
        assert "_source" not in source.config
        assert source.source["url"].startswith("https://huggingface.co/")
        assert source.source["read_from"]


@pytest.mark.parametrize("name", sorted(PRESET_TP))
def test_hand_arithmetic_gives_the_documented_block_sizes(name):
    """The rule reproduction on hand-computed pages equals the hand arithmetic."""
    hand = hand_expectations(name, PRESET_TP[name])
    assert hand["block"] == HAND_BLOCKS[name]
    use_mla = name.startswith("kimi")
    layer_alignment = 64 if name == "qwen3-next-80b-a3b" else None
    assert hybrid_block_size(
        attn_page_per_token=hand["attn"], mamba_page=hand["state"], block_size=16,
        kernel_block=16, backend_kernel_blocks=[16], use_mla=use_mla,
        checkpoint_alignment=layer_alignment) == hand["block"]


def test_the_rule_reproduces_a_published_start_up_log():
    """vllm issue #24280, NVIDIA-Nemotron-Nano-9B-v2: "Setting attention block size to 672
    tokens". 128 Mamba heads x 80, 8 groups x state 128, conv 4, bf16 SSM state (that
    vLLM's default then); 8 KV heads x 128 at bf16; FlashAttention's 16-token kernel block."""
    inner = 128 * 80
    state = (inner + 2 * 8 * 128) * 3 * BF16 + 128 * 80 * 128 * BF16
    assert hybrid_block_size(attn_page_per_token=8 * 2 * 128 * BF16, mamba_page=state,
                             block_size=16, kernel_block=16, backend_kernel_blocks=[16],
                             use_mla=False, checkpoint_alignment=None) == 672


def test_layer_layouts_follow_the_configs():
    def kinds(name):
        plans = family_of(resolve_model(name).architecture).layers(resolve_model(name).text_config)
        return [p.kind for p in plans]

    kimi = kinds("kimi-linear-48b-a3b")
    assert [i for i, k in enumerate(kimi) if k == MLA] == [3, 7, 11, 15, 19, 23, 26]
    assert kimi.count(MAMBA) == 20
    assert kinds("kimi-k3").count(MLA) == 24 and kinds("kimi-k3").count(MAMBA) == 69
    qwen = kinds("qwen3-next-80b-a3b")
    assert [i for i, k in enumerate(qwen) if k == ATTENTION] == list(range(3, 48, 4))
    nemotron = kinds("nemotron-h-8b")  # MLP blocks hold no cache
    assert (nemotron.count(MAMBA), nemotron.count(ATTENTION)) == (24, 4)


def test_weights_match_the_published_checkpoint_totals():
    """Parameter totals of the checkpoints' safetensors (docs/commands/geometry.md names the sources);
    Kimi-K3's routed experts are MXFP4: 4 bits a weight + a scale byte per 32."""
    def weights(name):
        source = resolve_model(name)
        return model_weights(source.architecture, source.config)

    assert weights("kimi-linear-48b-a3b").parameters == 49_122_681_728
    assert weights("nemotron-h-8b").parameters == 8_100_852_736
    # 1,453.66 GiB of tensors; the checkpoint stores the short convolutions and a few gate
    # vectors in fp32 where kvtrace counts the config's bf16 (about 0.02 GiB).
    assert abs(weights("kimi-k3").nbytes / GIB - 1453.66) < 0.05


def test_checkpoint_constants_are_vllms():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.kda_checkpoint import (
        kda_prefill_checkpoint_alignment)
    from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT as gdn

    assert FLASHINFER_GDN_CHECKPOINT_ALIGNMENT == gdn
    assert FLASHKDA_CHECKPOINT_ALIGNMENT == kda_prefill_checkpoint_alignment("flashkda")
    assert kda_prefill_checkpoint_alignment("triton") is None


VLLM = Path(__import__("importlib.util").util.find_spec("vllm").origin).parent


def _function_source(path: Path, name: str, cls: str | None = None) -> ast.AST:
    tree = ast.parse(path.read_text())
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls) if cls \
        else tree
    return next(n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_sm90_backend_choice_is_vllms_priority_list():
    """platforms/cuda.py does not import without libcuda; its _get_backend_priorities is
    compiled from the installed source and run on CPU."""
    import functools

    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    node = _function_source(VLLM / "platforms" / "cuda.py", "_get_backend_priorities")
    namespace = {"cache": functools.cache, "AttentionBackendEnum": AttentionBackendEnum,
                 "DeviceCapability": DeviceCapability, "CacheDType": str}
    exec(compile(ast.Module([node], []), "cuda.py", "exec"), namespace)
    for use_mla in (True, False):
        first = namespace["_get_backend_priorities"](use_mla, DeviceCapability(9, 0))[0]
        assert first.name == SM90_BACKENDS[use_mla]


def test_sm90_kernel_blocks_are_the_backends_declared_sizes():
    """FlashAttention imports on CPU and answers itself; FlashAttnMLABackend's module imports
    FA3 kernels, so its declaration is read from the installed source."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    assert FlashAttentionBackend.get_supported_kernel_block_sizes() == [
        MultipleOf(SM90_KERNEL_BLOCK["FLASH_ATTN"])]
    node = _function_source(VLLM / "v1" / "attention" / "backends" / "mla" / "flashattn_mla.py",
                            "get_supported_kernel_block_sizes", cls="FlashAttnMLABackend")
    returned = next(n for n in ast.walk(node) if isinstance(n, ast.Return)).value
    declared = eval(compile(ast.Expression(returned), "flashattn_mla.py", "eval"),
                    {"MultipleOf": MultipleOf})
    assert declared == [MultipleOf(SM90_KERNEL_BLOCK["FLASH_ATTN_MLA"])]


def test_unknown_model_lists_the_presets():
    with pytest.raises(ConfigError) as error:
        resolve_model("no-such-model")
    assert all(name in error.value.hint for name in preset_names())


def test_a_file_that_is_not_a_model_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="architectures"):
        resolve_model(tmp_path / "config.json")


def test_a_hybrid_architecture_without_a_known_layout_is_refused():
    with pytest.raises(ConfigError, match="layer layout of 'JambaForCausalLM'") as error:
        family_of("JambaForCausalLM")
    assert "KimiLinearForCausalLM" in error.value.hint


# --- vLLM: the real code on CPU ---------------------------------------------------------------

@pytest.fixture(scope="module")
def geometries(tmp_path_factory):
    cache = tmp_path_factory.mktemp("geometry-cache")
    return {name: compute_geometry(name, tensor_parallel_size=tp, cache_dir=cache)
            for name, tp in PRESET_TP.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESET_TP))
def test_each_preset_geometry_equals_the_hand_computed_one(geometries, name):
    geometry, hand = geometries[name], hand_expectations(name, PRESET_TP[name])
    assert geometry.block_size == geometry.mamba_block_size == hand["block"]
    assert geometry.mamba_state_bytes == hand["state"]
    assert geometry.attention_page_bytes_per_token == hand["attn"]
    assert geometry.page_bytes == hand["block"] * hand["attn"]
    assert sorted((g.kind, g.num_layers) for g in geometry.groups) == sorted(hand["groups"])
    assert {g.block_size for g in geometry.groups} == {hand["block"]}
    assert geometry.hash_block_size == geometry.scheduler_block_size == hand["block"]
    assert geometry.checkpoint_alignment == hand["checkpoint"]
    mamba_groups = [g for g in geometry.groups if g.kind == "mamba"]
    assert geometry.checkpoint_bytes == len(mamba_groups) * hand["bytes_per_block"]
    assert geometry.bytes_per_block == hand["bytes_per_block"]
    assert geometry.num_gpu_blocks == hand["num_gpu_blocks"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESET_TP))
def test_the_shipped_geometry_is_what_vllms_code_computes_now(geometries, name):
    """Workload writers read the shipped file instead of importing vLLM: it must not drift
    (regenerate with `python -m kvtrace.geometry.bundled`)."""
    assert geometry_for(name) == geometries[name]
    assert geometry_for(name, PRESET_TP[name]) == geometries[name]


@pytest.mark.slow
def test_engine_groups_are_what_the_replay_builds(geometries):
    groups = geometries["kimi-k3"].engine_groups()
    assert [g.kind for g in groups] == ["mamba"] * 3 + ["full_attention"]  # MLA: full attention
    assert {g.block_size for g in groups} == {384}
    assert all(g.mamba_cache_mode == "align" and g.num_prefill_checkpoint_blocks == 1
               and g.prefill_checkpoint_alignment == 16 for g in groups[:3])
    assert geometries["kimi-linear-48b-a3b"].engine_groups()[0].num_prefill_checkpoint_blocks == 0


@pytest.mark.slow
def test_kimi_linear_groups_are_vllms_get_kv_cache_groups_on_the_same_layer_specs(tmp_path):
    """The CLI's groups against vLLM's get_kv_cache_groups on specs built here by hand:
    7 MLA layers (latent 512 + rope 64, bf16) and 20 KDA layers at the CLI's block size."""
    import torch
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (MambaSpec, MLAAttentionSpec,
                                            get_kv_cache_spec_kind)

    from kvtrace.geometry.compute import Deployment, _vllm_config

    result = CliRunner(env={"XDG_CACHE_HOME": str(tmp_path)}).invoke(
        cli, ["geometry", "--model", "kimi-linear-48b-a3b", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output[result.output.index("{"):])
    block = shown["block_size"]
    assert block == shown["mamba_block_size"] == 1920  # one block size; Mamba = attention
    specs = {}
    for i in range(27):
        if i + 1 in (4, 8, 12, 16, 20, 24, 27):
            specs[f"l{i}"] = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576,
                                              dtype=torch.bfloat16, max_tp_shards=1)
        else:
            specs[f"l{i}"] = MambaSpec(
                shapes=((12288, 3), (32, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                block_size=block, page_size_padded=block * 1152, mamba_cache_mode="align")
    vllm_config = _vllm_config(resolve_model("kimi-linear-48b-a3b"), Deployment(), tmp_path)
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    groups = get_kv_cache_groups(vllm_config, specs)
    expected = [{"kind": get_kv_cache_spec_kind(g.kv_cache_spec).value,
                 "num_layers": len(g.layer_names), "block_size": g.kv_cache_spec.block_size}
                for g in groups]
    assert [{k: g[k] for k in ("kind", "num_layers", "block_size")}
            for g in shown["groups"]] == expected
    assert sorted(g["num_layers"] for g in expected) == [6, 7, 7, 7]  # 1 MLA + 3 KDA groups
    assert {"block_size", "mamba_block_size", "num_gpu_blocks", "page_bytes",
            "checkpoint_alignment", "groups"} <= set(shown)


def _real_rule(vllm_config, backend, layer_alignment, monkeypatch) -> tuple[int, int, int | None]:
    """vLLM's own _align_hybrid_block_size with the two forward-context walks answered: the
    model's non-SSM backends, and the Mamba layers' declared checkpoint alignment."""
    import vllm.model_executor.layers.mamba.abstract as abstract
    from vllm.platforms.interface import Platform

    class H200(Platform):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config):
            return [backend]

    monkeypatch.setattr(abstract, "get_mamba_prefill_checkpoint_alignment",
                        lambda vllm_config: layer_alignment)
    H200._align_hybrid_block_size(vllm_config, backend)
    cache = vllm_config.cache_config
    return cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded


RULE_CASES = [  # model, tp, kv cache dtype, the layers' declared alignment, starting block size
    ("nemotron-h-8b", 1, "auto", None, 16),
    ("nemotron-h-8b", 2, "auto", 48, 16),
    ("nemotron-h-8b", 4, "fp8", 64, 16),
    ("nemotron-h-8b", 1, "auto", None, 2048),  # a start above what the state needs
    ("qwen3-next-80b-a3b", 1, "auto", 64, 16),
    ("qwen3-next-80b-a3b", 2, "fp8", 64, 16),
    ("kimi-linear-48b-a3b", 1, "auto", None, 16),
    ("kimi-linear-48b-a3b", 2, "auto", 48, 16),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, kv_dtype, alignment, start", RULE_CASES)
def test_rule_equals_vllms_align_hybrid_block_size(tmp_path, monkeypatch, name, tp, kv_dtype,
                                                   alignment, start):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, MLAAttentionSpec,
                                            get_kv_quant_mode)

    from kvtrace.geometry.compute import Deployment, _backend_class, _kv_dtype, _vllm_config

    source = resolve_model(name)
    vllm_config = _vllm_config(source, Deployment(tensor_parallel_size=tp,
                                                  kv_cache_dtype=kv_dtype), tmp_path)
    model, cache = vllm_config.model_config, vllm_config.cache_config
    backend_name = SM90_BACKENDS[model.use_mla]
    backend = _backend_class(backend_name)
    spec = (MLAAttentionSpec if model.use_mla else FullAttentionSpec)(
        block_size=1, num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model.get_head_size(), dtype=_kv_dtype(cache.cache_dtype, model.dtype),
        kv_quant_mode=get_kv_quant_mode(cache.cache_dtype))
    with set_current_vllm_config(vllm_config):
        attn_page = (spec if model.use_mla else backend.customize_spec(spec)).page_size_bytes
    model_cls, _ = model.registry.resolve_model_cls(model.architectures, model)
    mamba_page = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                           dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                           block_size=-1).page_size_bytes
    ours = hybrid_block_size(attn_page_per_token=attn_page, mamba_page=mamba_page,
                             block_size=start, kernel_block=SM90_KERNEL_BLOCK[backend_name],
                             backend_kernel_blocks=[SM90_KERNEL_BLOCK[backend_name]],
                             use_mla=model.use_mla, checkpoint_alignment=alignment)
    cache.block_size = start
    block, mamba_block, padded = _real_rule(vllm_config, backend, alignment, monkeypatch)
    assert (block, mamba_block) == (ours, ours)
    assert padded in (None, ours * attn_page)


@pytest.mark.slow
def test_a_pure_attention_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a hybrid") as error:
        compute_geometry(ENGINE_MODEL / "config.json", cache_dir=tmp_path)
    assert "align" in error.value.hint


@pytest.mark.slow
def test_a_config_without_attention_layers_contradicts_align_mode(tmp_path):
    """Align mode sizes the Mamba block by the attention page; a Kimi config whose layers are
    all KDA has none."""
    config = resolve_model("kimi-linear-48b-a3b").config
    config["linear_attn_config"] = {**config["linear_attn_config"],
                                    "kda_layers": list(range(1, 28)), "full_attn_layers": []}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="not a mix of attention and Mamba"):
        compute_geometry(tmp_path, cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_a_tensor_parallel_size_that_splits_no_heads_evenly_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="divisible by tensor parallel size"):
        compute_geometry("kimi-linear-48b-a3b", tensor_parallel_size=3, cache_dir=tmp_path)


@pytest.mark.slow
def test_weights_that_leave_no_cache_say_which_tensor_parallel_size_fits(tmp_path):
    with pytest.raises(ConfigError, match="nothing of the") as error:
        compute_geometry("qwen3-next-80b-a3b", cache_dir=tmp_path)
    assert "--tensor-parallel-size (at least 2)" in error.value.hint


@pytest.mark.slow
def test_the_cli_prints_the_figures_and_says_what_it_assumed(tmp_path):
    runner = CliRunner(env={"XDG_CACHE_HOME": str(tmp_path)})
    result = runner.invoke(cli, ["geometry", "--model", "nemotron-h-8b"])
    assert result.exit_code == 0, result.output
    assert "1040 tokens per attention block" in result.output
    assert "6 mamba of 4/4/4/4/4/4 layers, 1 full_attention of 4 layers" in result.output
    assert "(assumed; --non-kv-memory-gib)" in result.output
    unknown = runner.invoke(cli, ["geometry", "--model", "no-such-model"])
    assert unknown.exit_code == 1 and "kimi-linear-48b-a3b" in unknown.output


def test_a_nemotron_h_config_saved_by_transformers_5_reads_as_its_preset(tmp_path):
    """transformers 5 saves Nemotron-H with ``layers_block_type`` and no
    ``hybrid_override_pattern`` (kvtrace refused it: "give --model"): the installed
    transformers round-trips the preset's config, and its layout, weights and cost model are
    the preset's."""
    from transformers import NemotronHConfig

    preset = resolve_model("nemotron-h-8b")
    saved = NemotronHConfig(**preset.config).to_dict()
    assert "hybrid_override_pattern" not in saved and saved["layers_block_type"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**saved, "architectures": preset.config["architectures"]}))
    read = resolve_model(path)
    family = family_of(read.architecture)
    assert ([p.kind for p in family.layers(read.text_config)]
            == [p.kind for p in family.layers(preset.text_config)])
    assert (model_weights(read.architecture, read.config).parameters
            == model_weights(preset.architecture, preset.config).parameters)


def test_a_layer_type_nemotron_h_does_not_have_is_one_error():
    from kvtrace.geometry.families import nemotron_h_pattern

    assert nemotron_h_pattern({"layers_block_type": ["mamba", "attention", "mlp", "moe"]}) == "M*-E"
    with pytest.raises(ConfigError, match="layers_block_type has a block 'sliding'"):
        nemotron_h_pattern({"layers_block_type": ["linear_attention", "sliding"]})
