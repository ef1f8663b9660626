"""The ``kvtrace`` command line: a click group with one module per command.

Command modules live beside this file and each defines ``command`` (a click command); they
import heavy libraries (vLLM, torch, DuckDB) inside the command body so that ``kvtrace --help``
stays fast. ``KvtraceError`` is formatted here and nowhere else.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
import traceback

import click

from kvtrace import __version__
from kvtrace.errors import KvtraceError

# Module name -> command name, in the order `kvtrace --help` lists them.
COMMAND_MODULES = {
    "info": "info",
    "cat": "cat",
    "load": "load",
    "sql": "sql",
    "report": "report",
    "why": "why",
    "export": "export",
    "capture": "capture",
    "synth": "synth",
    "importcmd": "import",
    "replay": "replay",
    "sweep": "sweep",
    "engine": "engine",
    "geometry": "geometry",
    "vllmcmd": "vllm",
    "demo": "demo",
}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: what Ctrl-C stops stops cleanly for it too (a
    capture disarms, a replay removes its partial outputs) before kvtrace exits 143."""


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up
    raise Terminated


class KvtraceGroup(click.Group):
    """Loads command modules lazily and turns ``KvtraceError`` into two stderr lines."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMAND_MODULES.values())

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        for module_name, command_name in COMMAND_MODULES.items():
            if command_name == name:
                return importlib.import_module(f"kvtrace.cli.{module_name}").command
        return None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KvtraceError as error:
            verbosity = ctx.obj.get("verbose", 0) if isinstance(ctx.obj, dict) else 0
            if verbosity >= 2:
                traceback.print_exc()
            click.echo(f"kvtrace: error: {error}", err=True)
            click.echo(f"kvtrace: hint: {error.hint}", err=True)
            ctx.exit(error.exit_code)
        except Terminated:
            click.echo("kvtrace: stopped by SIGTERM", err=True)
            ctx.exit(128 + signal.SIGTERM)


@click.group(cls=KvtraceGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvtrace")
@click.option("-v", "--verbose", count=True, help="More detail; -vv shows tracebacks.")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """Capture, replay and analyse vLLM prefix-cache traces of hybrid models.

    \b
    kvtrace info TRACE            what a trace holds
    kvtrace cat TRACE --kind K    its records as JSON lines
    """
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose


def verbosity() -> int:
    """The -v count of the running command (0 outside a command)."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx else None
    return root.obj.get("verbose", 0) if root and isinstance(root.obj, dict) else 0


def main(argv: list[str] | None = None) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    cli.main(args=argv, prog_name="kvtrace")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
