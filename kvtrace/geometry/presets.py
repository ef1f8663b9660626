"""Which model a geometry is computed for: a bundled preset or any Hugging Face ``config.json``.

Presets are the models' own published ``config.json`` fields, shipped as package data under
``presets/`` with a ``_source`` entry that names where every value was read. Nothing here
imports vLLM.
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


@dataclass(frozen=True)
class ModelSource:
    """A model's ``config.json`` (without ``_source``) and where it came from."""

    name: str  # the preset name, or the path given
    config: dict[str, Any] = field(repr=False)
    source: dict[str, str] = field(default_factory=dict)  # a preset's _source; {} for a path

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


def resolve_model(name_or_path: str | Path) -> ModelSource:
    """A preset by name, else a ``config.json`` file (or a folder holding one), else the preset
    read from that Hugging Face repository (``moonshotai/Kimi-K3``: the name vLLM serves a model
    as unless told otherwise, which a capture records)."""
    text = preset_named(name_or_path)
    if text in preset_names():
        config = _read_json(PRESET_DIR / f"{text}.json")
        return ModelSource(text, config, config.pop(SOURCE_KEY))
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"unknown model {text!r}: neither a preset, a config.json file nor the Hugging Face "
            "repository of a preset",
            f"Use a preset ({', '.join(preset_names())}), the Hugging Face repository one was "
            "read from, or the path of a Hugging Face config.json (or of the folder that holds "
            "it).")
    config = _read_json(path)
    config.pop(SOURCE_KEY, None)
    return ModelSource(text, config)


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
