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
    "doctor": "doctor",
    "export": "export",
    "capture": "capture",
    "top": "top",
    "dump": "dump",
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
    """SIGTERM or SIGHUP (a closed terminal or SSH session), raised in the main thread: what
    Ctrl-C stops stops cleanly for them too (a capture disarms, a replay removes its partial
    outputs) before kvtrace exits 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


# The stop signals this process received. A library may turn the exception a signal raised
# into one of its own (DuckDB: "Query interrupted"); a failure after one is the stop's.
_stop_signals: list[int] = []


def _terminate(signum, frame) -> None:
    _stop(signum)
    for each in TERMINATING_SIGNALS:  # a second one must not cut the clean-up
        signal.signal(each, signal.SIG_IGN)
    raise Terminated(signum)


def _interrupt(signum, frame) -> None:
    _stop(signum)
    raise KeyboardInterrupt


def _stop(signum: int) -> None:
    """Record a stop, and interrupt the DuckDB queries running (if DuckDB is in use)."""
    _stop_signals.append(signum)
    queries = sys.modules.get("kvtrace.analysis.sql_access")
    if queries is not None:
        queries.interrupt_all()


class KvtraceGroup(click.Group):
    """Loads command modules lazily and turns ``KvtraceError`` (and a full disk met inside a
    library: ``files.write_failure``) into two stderr lines, and a stop by SIGTERM, SIGHUP or
    SIGINT, whatever exception it became, into ``stopped by ...`` and exit 128 + its number."""

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
        except (click.exceptions.Exit, click.Abort, click.ClickException):
            raise
        except (Exception, KeyboardInterrupt) as error:
            signum = error.signum if isinstance(error, Terminated) else (
                _stop_signals[0] if _stop_signals else None)
            if signum is not None:  # whatever the stop turned into on its way out
                click.echo(f"kvtrace: stopped by {signal.Signals(signum).name}", err=True)
                ctx.exit(128 + signum)
            if isinstance(error, KeyboardInterrupt):
                raise
            from kvtrace.files import write_failure

            failure = error if isinstance(error, KvtraceError) else write_failure(error)
            if failure is None:
                raise
            self._report(ctx, failure)

    @staticmethod
    def _report(ctx: click.Context, error: KvtraceError) -> None:
        """Two lines on stderr, what failed and what to do, shown inert (they quote input)."""
        from kvtrace.cli.common import terminal_safe

        verbosity = ctx.obj.get("verbose", 0) if isinstance(ctx.obj, dict) else 0
        if verbosity >= 2:
            traceback.print_exc()
        click.echo(terminal_safe(f"kvtrace: error: {error}"), err=True)
        click.echo(terminal_safe(f"kvtrace: hint: {error.hint}"), err=True)
        ctx.exit(error.exit_code)


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
        for signum in TERMINATING_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(signum, _terminate)
        signal.signal(signal.SIGINT, _interrupt)
    cli.main(args=argv, prog_name="kvtrace")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
