"""Which model a geometry is computed for: a bundled preset or any Hugging Face ``config.json``.

Presets are the models' own published ``config.json`` fields, shipped as package data under
``presets/`` with a ``_source`` entry that names where every value was read. Nothing here
imports vLLM.
"""

from __future__ import annotations

import json
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
    """A preset by name, else a ``config.json`` file (or a folder holding one)."""
    text = str(name_or_path)
    preset = PRESET_DIR / f"{text}.json"
    if text in preset_names():
        config = _read_json(preset)
        return ModelSource(text, config, config.pop(SOURCE_KEY))
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"unknown model {text!r}: neither a preset nor a config.json file",
            f"Use a preset ({', '.join(preset_names())}) or the path of a Hugging Face "
            "config.json (or of the folder that holds it).")
    config = _read_json(path)
    config.pop(SOURCE_KEY, None)
    return ModelSource(text, config)


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
