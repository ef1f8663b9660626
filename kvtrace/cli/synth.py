"""``kvtrace synth``: a synthetic hybrid-KDA workload (shared prompts, chats, agent loops).

Its flags for preset parameters and engine settings are made from the tables in
``kvtrace.workloads`` (one source for code, ``--help`` and docs); they are added when the
command is first used, so ``kvtrace --help`` never imports the replay package.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import click


class LazyOptionsCommand(click.Command):
    """A command whose extra options come from ``make_options()``, built on first use."""

    def __init__(self, *args, make_options: Callable[[], list[click.Option]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._make_options = make_options
        self._options_made = False

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not self._options_made:
            self.params.extend(self._make_options())
            self._options_made = True
        return super().get_params(ctx)


class RetentionInterval(click.ParamType):
    """``none``/``dense`` (None: keep every block's state), 0 (latest-only) or N tokens: the
    same values as ``kvtrace replay --retention``."""

    name = "none|0|N"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        from kvtrace.engine_config import parse_retention
        from kvtrace.errors import ConfigError

        try:
            return parse_retention(str(value))
        except ConfigError as error:
            self.fail(str(error), param, ctx)


def engine_options() -> list[click.Option]:
    """One flag per ``EngineShape`` field, defaults and help from ``workloads``."""
    import dataclasses

    from kvtrace.workloads.workload import ENGINE_HELP, EngineShape

    options = []
    for spec in dataclasses.fields(EngineShape):
        flag = "--" + spec.name.replace("_", "-")
        if spec.name == "retention_interval":
            options.append(click.Option([flag, spec.name], type=RetentionInterval(),
                                        default=spec.default, show_default=True,
                                        help=ENGINE_HELP[spec.name]))
        elif spec.type == "bool":
            options.append(click.Option([flag, spec.name], is_flag=True,
                                        help=ENGINE_HELP[spec.name]))
        elif spec.default is None:
            value_type = float if spec.name == "pool_fraction" else click.IntRange(min=1)
            options.append(click.Option([flag, spec.name], type=value_type, default=None,
                                        help=ENGINE_HELP[spec.name]))
        elif spec.name == "model":
            from kvtrace.cli.model_options import HF_OVERRIDES_HELP

            options.append(click.Option([flag, spec.name], metavar="NAME|CONFIG.json",
                                        default=spec.default, show_default=True,
                                        help=ENGINE_HELP[spec.name]))
            options.append(click.Option(["--hf-overrides", "hf_overrides"], metavar="JSON",
                                        default=None, help=HF_OVERRIDES_HELP))
        else:
            options.append(click.Option([flag, spec.name], type=type(spec.default),
                                        default=spec.default, show_default=True,
                                        help=ENGINE_HELP[spec.name]))
    return options


def engine_shape(options: dict):
    """Pop the engine flags out of a command's keyword arguments into an ``EngineShape``."""
    import dataclasses

    from kvtrace.cli.model_options import with_hf_overrides
    from kvtrace.workloads.workload import EngineShape

    shape = {f.name: options.pop(f.name) for f in dataclasses.fields(EngineShape)}
    hf_overrides = options.pop("hf_overrides", None)
    if hf_overrides is not None:
        shape["model"] = with_hf_overrides(shape["model"], hf_overrides)
    return EngineShape(**shape)


def _preset_options() -> list[click.Option]:
    """One flag per preset parameter; each names its default in every preset using it."""
    import dataclasses

    from kvtrace.workloads.synth import PARAM_HELP, PRESETS

    options = []
    for name, meaning in PARAM_HELP.items():
        defaults = {preset: f.default for preset, p in PRESETS.items()
                    for f in dataclasses.fields(p.params_type) if f.name == name}
        shown = ", ".join(f"{preset} {value}" for preset, value in defaults.items())
        value_type = type(next(iter(defaults.values())))
        options.append(click.Option(["--" + name.replace("_", "-"), name], type=value_type,
                                    default=None, help=f"{meaning} [{shown}]"))
    return options + engine_options()


@click.command("synth", cls=LazyOptionsCommand, make_options=_preset_options)
@click.option("--preset", type=click.Choice(["shared-prompt", "documents", "chat", "agent"]),
              required=True,
              help="Traffic shape (see Presets above).")
@click.option("--requests", "num_requests", type=click.IntRange(min=1), default=500,
              show_default=True, help="Number of requests (the earliest arrivals).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Random seed: the same seed and flags give the same workload.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help="Workload trace to write (written atomically).")
def command(preset: str, num_requests: int, seed: int, output: str, **options) -> None:
    """Write a synthetic hybrid-KDA workload: requests with prompt hash ids, decode lengths
    and arrival times, plus the engine configuration to replay it under.

    \b
    Presets:
      shared-prompt  single-turn requests = one of a few hot system prompts + own question
      documents      the #56794 seed scenario: hot system prompts + long unique documents,
                     each prefilled in several chunks
      chat           multi-turn chats; turn k+1 = turn k's prompt + its output + new message
      agent          tool loops; step k+1 = step k's prompt + tool call + tool result

    Lengths are lognormal around the medians below, arrivals Poisson at --rate; a parameter
    flag only applies to the presets whose default it lists.

    \b
    Example:
        kvtrace synth --preset agent --requests 500 --seed 1 -o agent.kvtrace
        kvtrace synth --preset chat --turns 8 --num-gpu-blocks 4096 -o chat.kvtrace
    """
    from kvtrace.workloads.workload import write_workload
    from kvtrace.workloads.synth import synthesize

    shape = engine_shape(options)
    overrides = {name: value for name, value in options.items() if value is not None}
    workload = synthesize(preset, num_requests, seed, shape.hash_block_size, overrides)
    header = write_workload(output, workload, shape, cmdline=sys.argv)
    report_written(output, workload, header)


def report_written(output: str, workload, header) -> None:
    """One line saying what was written, for the operator."""
    prompt_tokens = sum(r.prompt_len for r in workload.requests)
    output_tokens = sum(r.max_tokens for r in workload.requests)
    click.echo(f"wrote {output}: {len(workload.requests)} requests, {prompt_tokens} prompt + "
               f"{output_tokens} output tokens; pool {header.config.num_gpu_blocks} blocks "
               f"({header.params['num_gpu_blocks_rule']}), hash unit {header.config.hash_block_size}")
