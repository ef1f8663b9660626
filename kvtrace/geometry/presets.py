"""Which model a geometry is computed for: a bundled preset or any Hugging Face ``config.json``,
with vLLM's ``--hf-overrides`` applied on top as vLLM applies them.

Presets are the models' own published ``config.json`` fields, shipped as package data under
``presets/`` with a ``_source`` entry that names where every value was read. A model with
overrides is named as vLLM was told it, ``NAME --hf-overrides JSON`` (``model_spec``): that
text resolves to the same model wherever it goes (a replay's header, a report), and a capture
records the model its engine served in that form. Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtrace.errors import ConfigError

PRESET_DIR = Path(__file__).with_name("presets")
SOURCE_KEY = "_source"
HF_OVERRIDES = " --hf-overrides "  # between a model's name and its overrides (model_spec)
# Config keys whose value is a nested config, which vLLM updates key by key (its
# ``_update_nested``) where another dict-valued key is replaced whole.
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "speech_config")
# transformers' ``attribute_map`` of the config classes vLLM 0.33 loads these model types with
# (an override sets the attribute it maps to), for the keys a layout reads.
ATTRIBUTE_MAPS = {"nemotron_h": {"layer_types": "layers_block_type",
                                 "num_local_experts": "n_routed_experts"}}


@dataclass(frozen=True)
class ModelSource:
    """A model's ``config.json`` (without ``_source``) and where it came from."""

    name: str  # the preset name, or the path given (with its overrides: ``model_spec``)
    config: dict[str, Any] = field(repr=False)
    source: dict[str, str] = field(default_factory=dict)  # a preset's _source; {} for a path
    hf_overrides: dict[str, Any] = field(default_factory=dict)  # applied to ``config``

    @property
    def base_name(self) -> str:
        """The preset name or path, without its overrides."""
        return self.name.partition(HF_OVERRIDES)[0]

    @property
    def architecture(self) -> str:
        architectures = self.config.get("architectures") or [""]
        return architectures[0]

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's fields (multimodal configs nest them in ``text_config``)."""
        return self.config.get("text_config") or self.config


def preset_names() -> list[str]:
    """The bundled configs (``presets/NAME.json``; ``NAME.geometry.json`` are their computed
    geometries, see ``bundled``)."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.json") if "." not in path.stem)


def resolve_model(name_or_path: str | Path,
                  hf_overrides: dict[str, Any] | str | None = None) -> ModelSource:
    """A preset by name, else a ``config.json`` file (or a folder holding one), else the preset
    read from that Hugging Face repository (``moonshotai/Kimi-K3``: the name vLLM serves a model
    as unless told otherwise, which a capture records); with vLLM's ``--hf-overrides`` applied
    on top (``apply_hf_overrides``): those ``name_or_path`` names, as ``model_spec`` writes
    them, then ``hf_overrides`` (a dict, or its JSON text). The config is read in the form
    vLLM 0.33 reads it (``vllm_form``: e.g. Kimi-Linear as transformers 5 saves it)."""
    text, _, named = str(name_or_path).partition(HF_OVERRIDES)
    overrides = {**(parse_hf_overrides(named) if named else {}),
                 **(parse_hf_overrides(hf_overrides) if isinstance(hf_overrides, str)
                    else hf_overrides or {})}
    name = preset_named(text)
    if name in preset_names():
        config = _read_json(PRESET_DIR / f"{name}.json")
        source = config.pop(SOURCE_KEY)
    else:
        path = Path(name)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"unknown model {name!r}: neither a preset, a config.json file nor the Hugging "
                "Face repository of a preset",
                f"Use a preset ({', '.join(preset_names())}), the Hugging Face repository one "
                "was read from, or the path of a Hugging Face config.json (or of the folder "
                "that holds it).")
        config = _read_json(path)
        config.pop(SOURCE_KEY, None)
        source = {}
    if overrides:
        config = apply_hf_overrides(config, overrides)
    return ModelSource(model_spec(name, overrides), vllm_form(config), source, overrides)


def model_spec(name: str, hf_overrides: dict[str, Any]) -> str:
    """A model as vLLM is told it: ``NAME``, or ``NAME --hf-overrides JSON`` with overrides
    (which ``resolve_model`` reads back)."""
    if not hf_overrides:
        return name
    return f"{name}{HF_OVERRIDES}{json.dumps(hf_overrides, sort_keys=True)}"


def parse_hf_overrides(text: str) -> dict[str, Any]:
    """``--hf-overrides`` as vLLM takes it: a JSON object."""
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--hf-overrides {text!r} is not JSON: {error}",
                          "Give a JSON object, as to vLLM: --hf-overrides "
                          "'{\"num_hidden_layers\": 8}'.") from None
    if not isinstance(overrides, dict):
        raise ConfigError(f"--hf-overrides {text!r} is not a JSON object",
                          "Give a JSON object, as to vLLM: --hf-overrides "
                          "'{\"num_hidden_layers\": 8}'.")
    return overrides


def apply_hf_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a config.json's fields) as vLLM 0.33 has it after ``--hf-overrides``
    (``ModelConfig.__post_init__``, ``get_config``): a key whose value is not a dict is set on
    the config (``config.update``); a dict goes into a nested config (``SUB_CONFIGS``) key by
    key, dicts in it merged alike (``_update_nested``), and replaces any other dict-valued
    field whole (``_apply_dict_overrides``). A key the config class maps to another
    (``ATTRIBUTE_MAPS``) sets that one. Nemotron-H's legacy ``hybrid_override_pattern`` is read
    into ``layers_block_type`` by transformers 5 and cannot be set afterwards."""
    config = json.loads(json.dumps(config))  # a deep copy, whatever the caller keeps
    aliases = ATTRIBUTE_MAPS.get(str(config.get("model_type")), {})
    for key, value in overrides.items():
        key = aliases.get(key, key)
        if config.get("model_type") == "nemotron_h":
            if key == "hybrid_override_pattern":
                raise ConfigError(
                    "--hf-overrides sets hybrid_override_pattern, which transformers 5's "
                    "Nemotron-H config derives from layers_block_type and cannot set: vLLM 0.33 "
                    "stops on it",
                    "Override layers_block_type (a list of mamba / attention / mlp / moe).")
            if key == "layers_block_type":
                config.pop("hybrid_override_pattern", None)
        if isinstance(value, dict) and (key in SUB_CONFIGS or "model_type" in (
                config.get(key) if isinstance(config.get(key), dict) else ())):
            config[key] = _update_nested(dict(config.get(key) or {}), value)
        else:
            config[key] = value
    return config


def _update_nested(target: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            target[key] = _update_nested(dict(target[key]), value)
        else:
            target[key] = value
    return target


# transformers 5's Kimi-Linear fields (KimiLinearConfig) and the checkpoint's
# ``linear_attn_config`` keys vLLM 0.33 reads them from, with transformers' defaults.
KIMI_LINEAR_FIELDS = {"linear_num_heads": ("num_heads", 32), "linear_head_dim": ("head_dim", 128),
                      "linear_conv_kernel_dim": ("short_conv_kernel_size", 4)}


def vllm_form(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` in the form vLLM 0.33 reads. Kimi-Linear as transformers 5 saves it
    (``KimiLinearConfig``: ``layer_types`` of linear_attention / full_attention,
    ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``, ``mlp_layer_types``
    of dense / sparse, and no ``linear_attn_config``) gets the checkpoint's
    ``linear_attn_config`` (1-based ``kda_layers`` and ``full_attn_layers``) and
    ``first_k_dense_replace`` spelled from them: vLLM's own ``KimiLinearConfig`` reads only
    those (``is_kda_layer``), and would build every layer as MLA. Every other config is
    returned as it is (Qwen3-Next's ``layer_types`` and Nemotron-H's ``layers_block_type`` are
    read by the families themselves)."""
    text = config.get("text_config") or config
    if (text.get("model_type") != "kimi_linear" or text.get("linear_attn_config") is not None
            or not isinstance(text.get("layer_types"), list)):
        return config
    types = text["layer_types"]
    unknown = sorted({str(t) for t in types} - {"linear_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"layer_types has a layer {unknown[0]!r} that the Kimi layout does not "
                          "know (linear_attention, full_attention)",
                          "Give the model's config.json as Hugging Face publishes it.")
    linear = {"kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
              "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"]}
    for key, (checkpoint_key, default) in KIMI_LINEAR_FIELDS.items():
        linear[checkpoint_key] = text.get(key) or default
    text = {**text, "linear_attn_config": linear}
    mlp_types = text.get("mlp_layer_types")
    if text.get("first_k_dense_replace") is None and isinstance(mlp_types, list):
        first_sparse = next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
        if any(t != "sparse" for t in mlp_types[first_sparse:]):
            raise ConfigError(
                f"mlp_layer_types {mlp_types} is not dense layers then sparse ones, the only "
                "layout vLLM 0.33's Kimi reads (first_k_dense_replace, moe_layer_freq 1)",
                "Give the model's config.json as Hugging Face publishes it.")
        text = {**text, "first_k_dense_replace": first_sparse, "moe_layer_freq": 1}
    return {**config, "text_config": text} if "text_config" in config else text


def preset_named(name_or_path: str | Path) -> str:
    """The preset ``name_or_path`` names, by its own name or by the Hugging Face repository it
    was read from (unless a config.json path of that name exists here), else the text as is."""
    text = str(name_or_path)
    if text in preset_names() or Path(text).exists():
        return text
    return presets_by_repository().get(text.lower(), text)


@functools.cache
def presets_by_repository() -> dict[str, str]:
    """Each preset by the Hugging Face repository its config.json was read from, lower-cased
    (``moonshotai/kimi-k3``: ``kimi-k3``)."""
    found = {}
    for name in preset_names():
        url = _read_json(PRESET_DIR / f"{name}.json")[SOURCE_KEY].get("url", "")
        repository = re.match(r"https://huggingface\.co/([^/]+/[^/]+)/", url)
        if repository:
            found[repository.group(1).lower()] = name
    return found


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path} as JSON: {error}",
                          "Give the model's config.json as Hugging Face publishes it.") from error
    if not isinstance(config, dict) or not isinstance(config.get("architectures"), list):
        raise ConfigError(f"{path} is not a Hugging Face model config (no 'architectures' list)",
                          "Give the model's config.json as Hugging Face publishes it.")
    return config
