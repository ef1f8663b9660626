"""The files a command reads and writes for the operator: no output replaces an input, every
output appears whole or not at all, and a file that cannot be read or written is one error.

* ``refuse_overwrite(outputs, inputs)``: an output that is the same file as an input (same
  device and inode, whatever the spelling: a link, ``./a`` for ``a``), or as another output, is
  refused before any work: a command never replaces the data it reads.
* ``StagedOutput(path)``: a fresh private directory beside ``path`` (``.NAME.XXXX.partial``)
  whose ``path`` the writer fills; ``publish()`` renames it onto ``path``, ``discard()`` (or a
  failure inside ``with``) removes it. Two commands writing one target never share a scratch
  name, and a database's write-ahead log stays inside the directory.
* ``check_output_dir(path, option)``: an output can be created where it goes, tried before
  the work that produces it.
* ``require_regular_file(path, why)``: a FIFO or a device is refused where a command must read
  a file more than once; ``file_digest(path)`` identifies a file's content.

Imports: the standard library and ``kvtrace.errors`` only (the trace writer uses it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable

from kvtrace.errors import KvtraceError

WRITE_HINT = "Check that the directory exists and that you can write there (and the free space)."


class OutputError(KvtraceError):
    """An output kvtrace cannot write, or must not (it would replace an input)."""

    default_hint = WRITE_HINT


def cannot_write(path: str | os.PathLike, error: OSError) -> OutputError:
    """An ``OSError`` met while writing ``path``, as one line."""
    return OutputError(f"cannot write {os.fspath(path)}: {error.strerror or error}")


def _identity(path: str | os.PathLike) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two existing paths name one file (device and inode)."""
    first = _identity(a)
    return first is not None and first == _identity(b)


def refuse_overwrite(outputs: Iterable[tuple[str, str | os.PathLike | None]],
                     inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse outputs (``(option, path)``; None: not given) that are one of ``inputs`` or
    name the same file as another output."""
    given = [(option, os.fspath(path)) for option, path in outputs if path is not None]
    inputs = [os.fspath(path) for path in inputs]
    for index, (option, path) in enumerate(given):
        for source in inputs:
            if same_file(path, source) or os.path.abspath(path) == os.path.abspath(source):
                raise OutputError(
                    f"{option} {path} is the input {source}: writing it would destroy it",
                    f"Give {option} a new path.")
        for other_option, other in given[index + 1:]:
            if same_file(path, other) or os.path.abspath(path) == os.path.abspath(other):
                raise OutputError(f"{option} and {other_option} both name {path}",
                                  "Give each output its own path.")


def check_output_dir(path: str | os.PathLike, option: str) -> None:
    """Refuse, before any work, an output that is a directory or that cannot be created where
    it goes (tried: a scratch directory is made there and removed)."""
    if os.path.isdir(path):
        raise OutputError(f"{option} {os.fspath(path)} is a directory",
                          f"Give {option} a file name.")
    StagedOutput(path).discard()


def require_regular_file(path: str | os.PathLike, why: str) -> None:
    """Refuse a path that exists but is not a regular file (a FIFO would block forever)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return  # a missing file is the reader's error to report
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise KvtraceError(f"{os.fspath(path)} is not a regular file (a FIFO, socket or "
                           f"device); {why}", "Save the stream to a file first.")


def file_digest(path: str | os.PathLike) -> str:
    """``sha256:HEX`` of a file's bytes: what identifies a trace's content."""
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            sha.update(chunk)
    return f"sha256:{sha.hexdigest()}"


class StagedOutput:
    """An output built under a private scratch name beside ``final`` and renamed onto it only
    when complete (``publish``); ``discard`` leaves ``final`` as it was."""

    def __init__(self, final: str | os.PathLike) -> None:
        self.final = os.fspath(final)
        directory, name = os.path.split(os.path.abspath(self.final))
        try:
            self._scratch = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=directory)
        except OSError as error:
            raise cannot_write(self.final, error) from None
        self.path = os.path.join(self._scratch, name)

    def publish(self) -> None:
        try:
            os.replace(self.path, self.final)
        except OSError as error:
            self.discard()
            raise cannot_write(self.final, error) from None
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> StagedOutput:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.publish()
        else:
            self.discard()


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write a small output file so that it appears whole or not at all."""
    with StagedOutput(path) as staged:
        try:
            with open(staged.path, "wb") as file:
                file.write(data)
        except OSError as error:
            raise cannot_write(path, error) from None
