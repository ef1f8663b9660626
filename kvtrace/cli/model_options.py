"""``--hf-overrides``: vLLM's own overrides of a model's config.json, beside the commands'
``--model``, folded into the model's name as vLLM was told it (``presets.model_spec``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import click

HF_OVERRIDES_HELP = ("vLLM's --hf-overrides of the --model's config.json, as the engine was "
                     "served with them: a JSON object (e.g. '{\"num_hidden_layers\": 8}').")


def hf_overrides_option(command: Callable) -> Callable:
    """Add ``--hf-overrides JSON`` to ``command``, which takes a ``model`` argument: with it,
    ``model`` becomes ``NAME --hf-overrides JSON``, which every reader of a model resolves
    with the overrides applied as vLLM applies them."""

    @functools.wraps(command)
    def with_overrides(*args, hf_overrides: str | None = None, **kwargs):
        if hf_overrides is not None:
            kwargs["model"] = with_hf_overrides(kwargs.get("model"), hf_overrides)
        return command(*args, **kwargs)

    return click.option("--hf-overrides", "hf_overrides", default=None, metavar="JSON",
                        help=HF_OVERRIDES_HELP)(with_overrides)


def with_hf_overrides(model: str | None, hf_overrides: str) -> str:
    """``model`` named with ``hf_overrides`` (a JSON object, checked here)."""
    from kvtrace.geometry.presets import HF_OVERRIDES, model_spec, parse_hf_overrides

    if not model:
        raise click.UsageError("--hf-overrides applies to a --model: give the model too")
    name, flag, named = model.partition(HF_OVERRIDES)
    overrides = parse_hf_overrides(named) if flag else {}
    return model_spec(name, {**overrides, **parse_hf_overrides(hf_overrides)})
