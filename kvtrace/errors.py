"""Errors kvtrace raises. Library code raises these; only ``kvtrace.cli`` formats them.

Every error carries two lines for the operator: what failed (``str(error)``) and what to do
about it (``error.hint``). ``exit_code`` is the CLI's exit status.
"""

from __future__ import annotations

# Every KvtraceError subclass by its name: an error raised inside an engine crosses the capture
# control socket as its name, message and hint, and the operator side raises the same class.
_ERROR_CLASSES: dict[str, type[KvtraceError]] = {}


class KvtraceError(Exception):
    """Base class: a failure the operator can act on, not a bug in kvtrace.

    Subclasses take ``(message, hint=...)`` (more only as optional keywords) and have distinct
    names, so that ``error_class(name)(message, hint=hint)`` rebuilds one in another process.
    """

    exit_code = 1
    default_hint = "Run with -vv for the full traceback."

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint or self.default_hint

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        known = _ERROR_CLASSES.get(cls.__name__)
        if known is not None and (known.__module__, known.__qualname__) != (
                cls.__module__, cls.__qualname__):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} and {known.__module__}."
                            f"{known.__qualname__} are both KvtraceErrors named {cls.__name__}")
        _ERROR_CLASSES[cls.__name__] = cls


def error_class(name: str) -> type[KvtraceError]:
    """The ``KvtraceError`` subclass called ``name``; ``KvtraceError`` itself for a name this
    process does not know (a class defined in a module it has not imported, or none)."""
    return _ERROR_CLASSES.get(name, KvtraceError)


class TraceFormatError(KvtraceError):
    """The bytes of a trace file are not a kvtrace trace, or are damaged at ``offset``."""

    default_hint = (
        "The file is damaged or is not a kvtrace trace; re-capture it, or copy it again if it "
        "was transferred."
    )

    def __init__(self, message: str, offset: int | None = None, hint: str | None = None) -> None:
        if offset is not None:
            message = f"{message} (at byte offset {offset})"
        super().__init__(message, hint)
        self.offset = offset


class TraceVersionError(TraceFormatError):
    """The trace was written by a newer kvtrace whose format this one cannot read."""

    default_hint = "Upgrade kvtrace (pip install -U kvtrace) to read this trace."


class TraceNotFoundError(KvtraceError):
    """A trace path that does not exist or cannot be opened."""

    default_hint = "Check the path; `kvtrace info FILE` reads any kvtrace trace."


class ConfigError(KvtraceError):
    """An engine or replay configuration that cannot work (e.g. block sizes vs hash unit)."""

    default_hint = "See `kvtrace replay --help` for the configuration flags."


class TraceTruncatedError(TraceFormatError):
    """The trace has no closing frame: its writer was cut off. What precedes the cut is intact."""

    default_hint = (
        "The records before the cut were recovered and shown; the writer was killed or the "
        "capture is still running."
    )


class UnsafePathError(KvtraceError):
    """A file, directory or socket that another local user could control, refused unused."""

    default_hint = (
        "Another local user may have made it to intercept kvtrace: check what it is and remove "
        "it, or choose a place only root and the engine's user can write."
    )
