"""The files a command reads and writes for the operator: no output replaces an input, every
output appears whole or not at all, and a file that cannot be read or written is one error.

* ``refuse_overwrite(outputs, inputs)``: an output that is the same file as an input (same
  device and inode, whatever the spelling: a link, ``./a`` for ``a``), or as another output, is
  refused before any work: a command never replaces the data it reads.
* ``existing_output(path)``: an output's path holds nothing or a regular file; anything else
  (a link, a device, a FIFO, a socket, a directory) is refused, so that no rename ever replaces
  ``/dev/null`` or a link (``--html /dev/stdout`` as root), and nothing is written through one.
  A directory on the way there that is a link another user could have planted is refused too
  (``planted_link``).
* ``StagedOutput(path)``: a fresh private directory beside ``path`` (``.NAME.XXXX.partial``)
  whose ``path`` the writer fills; ``publish()`` renames it onto ``path``, ``discard()`` (or a
  failure inside ``with``) removes it. Two commands writing one target never share a scratch
  name, and a database's write-ahead log stays inside the directory. ``publish`` holds the
  target's lock (``locked_output``) and refuses a target that another command changed in place
  meanwhile (``kvtrace sweep --db`` adding rows): replacing it would lose what was added.
* ``locked_output(path)``: the lock a command holds while it changes an existing output in
  place, and ``publish`` while it replaces one (``flock`` on the file itself).
* ``check_output_dir(path, option)``: an output can be created where it goes, tried before
  the work that produces it.
* ``require_regular_file(path, why)``: a FIFO or a device is refused where a command must read
  a file more than once; ``file_digest(path)`` identifies a file's content.
* ``write_failure(error)``: a library's error for a full disk (or a read-only file system) as
  one ``OutputError``, for the errors that surface outside kvtrace's own writes.

Imports: the standard library and ``kvtrace.errors`` only (the trace writer uses it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator

from kvtrace.errors import KvtraceError

WRITE_HINT = "Check that the directory exists and that you can write there (and the free space)."


class OutputError(KvtraceError):
    """An output kvtrace cannot write, or must not (it would replace an input)."""

    default_hint = WRITE_HINT


def cannot_write(path: str | os.PathLike, error: OSError) -> OutputError:
    """An ``OSError`` met while writing ``path``, as one line."""
    return OutputError(f"cannot write {os.fspath(path)}: {error.strerror or error}")


# What a path holds, for the refusals: anything but a regular file (or nothing).
_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFDIR: "a directory"}
# Errors of a write that no path or option can fix here: the file system refused the bytes.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_WRITE_ERROR_TEXTS = tuple(os.strerror(code) for code in sorted(_WRITE_ERRNOS))


def _link_not_followed_because(link: os.stat_result, directory: os.stat_result,
                                uid: int) -> str | None:
    """Why a link must not be followed by ``uid``: another user made it, or could have (its
    directory is another user's, or others may write there and it is not sticky)."""
    if link.st_uid not in (0, uid):
        return f"is a link owned by uid {link.st_uid}"
    mode = stat.S_IMODE(directory.st_mode)
    if directory.st_uid not in (0, uid) or (mode & 0o022 and not mode & stat.S_ISVTX):
        return "is a link in a directory other users can change"
    return None


def planted_link(directory: str | os.PathLike, uid: int | None = None) -> str | None:
    """The first link among ``directory``'s components (the links' own targets included, as
    the kernel resolves them) that ``uid`` (default: this process's) must not follow, with why;
    None if there is none. Links that root or ``uid`` made where only they could are followed
    (``/var/run``, a home directory's own links); a link another user planted in ``/tmp`` is
    not, as fs.protected_symlinks would refuse it where it is off."""
    uid = os.geteuid() if uid is None else uid
    pending = [part for part in os.path.abspath(directory).split("/") if part]
    current, hops = "/", 0
    while pending:
        part = pending.pop(0)
        if part in (".", ".."):
            current = current if part == "." else os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        try:
            info = os.lstat(candidate)
            if stat.S_ISLNK(info.st_mode):
                problem = _link_not_followed_because(info, os.stat(current), uid)
                target = os.readlink(candidate)
        except OSError:
            return None  # missing or unreadable: opening it says so
        if not stat.S_ISLNK(info.st_mode):
            current = candidate
            continue
        if problem:
            return f"{candidate} {problem}"
        hops += 1
        if hops > 40:
            return None  # a loop: opening it says so (ELOOP)
        current = "/" if target.startswith("/") else current
        pending[:0] = [part for part in target.split("/") if part]
    return None


def refuse_planted_link(path: str | os.PathLike, label: str) -> None:
    """Refuse an output whose directory is reached through a planted link (``planted_link``);
    the output's own name is its opener's to check (``O_NOFOLLOW``, ``existing_output``)."""
    refuse_planted_dir(os.path.dirname(os.path.abspath(path)), label)


def refuse_planted_dir(directory: str | os.PathLike, label: str) -> None:
    """Refuse an output directory (made if missing, e.g. replay's ``-o``) reached through a
    planted link, the directory's own name included."""
    problem = planted_link(directory)
    if problem:
        raise OutputError(f"cannot write {label}: {problem}; kvtrace does not follow it",
                          "Give the path without that link (the directory it points to, if "
                          "you trust it), or remove the link.")


def existing_output(path: str | os.PathLike, option: str = "") -> os.stat_result | None:
    """What an output's path holds now: nothing (None) or a regular file (its ``lstat``).
    Anything else is refused: kvtrace replaces only regular files, so that a rename never
    replaces a device node, a link, a FIFO or a socket (as root, ``-o /dev/null`` would replace
    the host's /dev/null), and it never writes through one."""
    label = f"{option} {os.fspath(path)}" if option else os.fspath(path)
    refuse_planted_link(path, label)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise OutputError(f"cannot write {label}: {getattr(error, 'strerror', None) or error}"
                          ) from None
    if stat.S_ISREG(info.st_mode):
        return info
    kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
    if stat.S_ISDIR(info.st_mode):
        raise OutputError(f"{label} is a directory", f"Give {option or 'the output'} a file name.")
    raise OutputError(f"{label} is {kind}: kvtrace replaces only regular files, never a link, "
                      "a device, a FIFO or a socket",
                      "Give a path that is new or a regular file (for a link: the file it points to).")


@contextlib.contextmanager
def locked_output(path: str | os.PathLike, option: str = "") -> Iterator[os.stat_result | None]:
    """Hold the lock on the regular file at ``path`` (an exclusive ``flock`` on the file
    itself), yielding its ``stat``; yields None, holding nothing, when there is no file.
    ``StagedOutput.publish`` takes it before it renames onto ``path``, and a command that
    changes an existing output in place holds it meanwhile, so that neither loses the other's
    work. The file is the one at ``path`` once the lock is held (a rename meanwhile: again)."""
    while True:
        if existing_output(path, option) is None:
            yield None
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # removed meanwhile
        except OSError as error:
            if error.errno == errno.ELOOP:
                continue  # a link now: refused on the next round
            yield existing_output(path, option)  # unreadable: it cannot be locked, only used
            return
        try:
            opened = os.fstat(fd)
            if stat.S_ISREG(opened.st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX)
                now = existing_output(path, option)
                if now is not None and (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino):
                    yield os.fstat(fd)
                    return
        finally:
            os.close(fd)


def _changed_in_place(before: os.stat_result | None, now: os.stat_result | None) -> bool:
    """The same file as ``before``, with other content (written in place since)."""
    return (before is not None and now is not None
            and (before.st_dev, before.st_ino) == (now.st_dev, now.st_ino)
            and (before.st_size, before.st_mtime_ns) != (now.st_size, now.st_mtime_ns))


def write_failure(error: BaseException) -> OutputError | None:
    """A write refused by the file system (full, over quota, read-only), met inside a
    library (DuckDB, a buffered file's flush), as one ``OutputError``; None for anything
    else."""
    if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS:
        where = f" {error.filename}" if error.filename else ""
        return OutputError(f"cannot write{where}: {error.strerror}")
    text = str(error)
    if type(error).__module__.lstrip("_") == "duckdb" and any(
            reason in text for reason in _WRITE_ERROR_TEXTS):
        reason = next(reason for reason in _WRITE_ERROR_TEXTS if reason in text)
        return OutputError(f"cannot write the database: {reason}")
    return None


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
    """Refuse, before any work, an output that is not new or a regular file
    (``existing_output``) or that cannot be created where it goes (tried: a scratch directory
    is made there and removed)."""
    StagedOutput(path, option).discard()


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
    when complete (``publish``); ``discard`` leaves ``final`` as it was. ``final`` must hold
    nothing or a regular file (``existing_output``; ``option`` names it in the refusal)."""

    def __init__(self, final: str | os.PathLike, option: str = "") -> None:
        self.final = os.fspath(final)
        self.option = option
        self._before = existing_output(self.final, option)
        directory, name = os.path.split(os.path.abspath(self.final))
        try:
            self._scratch = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=directory)
        except OSError as error:
            raise cannot_write(self.final, error) from None
        self.path = os.path.join(self._scratch, name)

    def publish(self) -> None:
        try:
            with locked_output(self.final, self.option) as now:
                if _changed_in_place(self._before, now):
                    raise OutputError(
                        f"{self.final} changed while this command ran (another command wrote "
                        "into it); it was not replaced, so that nothing written there is lost",
                        "Run the command again once the other one is done, or give a new path.")
                os.replace(self.path, self.final)
        except OSError as error:
            raise cannot_write(self.final, error) from None
        finally:
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
