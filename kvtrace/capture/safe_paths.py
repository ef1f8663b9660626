"""Files and directories that another local user might reach, used so that they cannot redirect
or replace them. Assume any other local user is hostile: ``kvtrace capture`` runs as root.

The rules, as trusted tools of this kind (ssh, systemd) apply them:

* a directory is *trusted* for a user U when it is owned by root or U and nobody else can write
  to it, or it is sticky (``/tmp``: others can add names but not move or remove U's);
  ``open_trusted_dir`` checks every directory from ``/`` down;
* a *private* directory (the runtime directory with the control socket and the bootstrap) is a
  real directory, not a link, owned by U and closed to everyone else (no group/other bits);
  it is checked on the open descriptor (``open_private_dir``), and its files are then reached
  only relative to that descriptor;
* files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never through a link, never over
  what is there; a trace then takes its name by an atomic rename) and read with
  ``O_NOFOLLOW | O_NONBLOCK`` after checking, on the descriptor, that they are regular files of
  the expected owner.

A check that fails raises ``UnsafePathError`` naming the path and what is wrong with it, before
anything was written, changed or run. Runs inside vLLM: stdlib and kvtrace's errors only.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from kvtrace.errors import KvtraceError, UnsafePathError
from kvtrace.files import planted_link

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_EXISTING_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _untrusted_because(info: os.stat_result, uid: int) -> str | None:
    """Why a directory is not trusted for ``uid``'s files; None if it is."""
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in (0, uid):
        return f"is owned by uid {info.st_uid}, not by root or uid {uid}"
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return f"can be written by other users (mode {mode:04o}, not sticky)"
    return None


def open_trusted_dir(directory: str | os.PathLike, uid: int) -> int:
    """A descriptor of ``directory`` once it and each directory above it (links resolved) are
    trusted for ``uid``: no other user can add, move or remove what ``uid`` puts there, and no
    link on the way is one another user could have planted (``files.planted_link``: resolved
    first, ``/tmp/x`` -> ``/etc`` was a trusted ``/etc``). ``FileNotFoundError`` if it does not
    exist."""
    problem = planted_link(directory, uid)
    if problem:
        raise UnsafePathError(f"{problem}; kvtrace will not use {directory}")
    real = os.path.realpath(directory)
    current = "/"
    for part in [""] + [p for p in real.split("/") if p]:
        current = os.path.join(current, part)
        try:
            info = os.stat(current)
        except FileNotFoundError:
            raise
        except OSError as error:
            raise KvtraceError(f"cannot use {directory}: {current}: {error.strerror}",
                               "Check the path.") from None
        problem = _untrusted_because(info, uid)
        if problem:
            raise UnsafePathError(f"{current} {problem}; kvtrace will not use {directory}")
    fd = os.open(real, _DIRECTORY | os.O_NOFOLLOW)
    problem = _untrusted_because(os.fstat(fd), uid)  # the one opened, not only the one checked
    if problem:
        os.close(fd)
        raise UnsafePathError(f"{real} {problem}; kvtrace will not use {directory}")
    return fd


def open_private_dir(path: Path, uid: int, create: bool) -> int:
    """A descriptor of ``path``, a directory only ``uid`` (and root) may enter, below a trusted
    one. With ``create`` it is made (0700) if missing, and given to ``uid`` when root made it;
    without, a missing one raises ``FileNotFoundError``. Anything else there (a link, another
    owner, a mode open to others) raises ``UnsafePathError`` and is left as it is."""
    try:
        parent_fd = open_trusted_dir(path.parent, uid)
    except FileNotFoundError:
        if not create:
            raise
        raise KvtraceError(f"{path.parent} does not exist",
                           "Create it, or set KVTRACE_RUNTIME_DIR to a directory that "
                           "does.") from None
    try:
        if create:
            try:
                os.mkdir(path.name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                pass
        try:
            fd = os.open(path.name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafePathError(f"{path} is not a directory but "
                                      f"{_kind(path.name, parent_fd)}") from None
            raise
    finally:
        os.close(parent_fd)
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    # Only root can have made a root-owned one: root's own, made for ``uid``.
    given = create and info.st_uid == 0 != uid and os.geteuid() == 0 and not mode & 0o077
    problem = (f"is open to other users (mode {mode:04o})" if mode & 0o077
               else f"is owned by uid {info.st_uid}, not {uid}" if info.st_uid != uid and not given
               else None)
    if problem:
        os.close(fd)
        raise UnsafePathError(f"{path} {problem}: it is not kvtrace's private directory for "
                              f"uid {uid}")
    if given:
        os.fchown(fd, uid, -1)
    return fd


def _kind(name: str, dir_fd: int) -> str:
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return "gone"
    return "a symbolic link" if stat.S_ISLNK(mode) else "a file"


def create_file(name: str, dir_fd: int, mode: int = 0o600) -> int:
    """A new file ``name`` in ``dir_fd``, open for writing: never through a link, never over
    what is there (``FileExistsError``)."""
    return os.open(name, _NEW_FILE, mode, dir_fd=dir_fd)


def replace_file(name: str, dir_fd: int, mode: int = 0o600) -> int:
    """Like ``create_file``, after removing what is called ``name`` (a link itself, not what
    it points to); for a private directory's own files (the bootstrap)."""
    remove_if_there(name, dir_fd)
    return create_file(name, dir_fd, mode)


def remove_if_there(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def remove_own_socket(name: str, dir_fd: int, uid: int) -> bool:
    """Remove ``name`` in ``dir_fd`` if it is a socket of ``uid`` (never a link, which is not
    followed, nor another kind of file or another user's); whether it was removed."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != uid:
            return False
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def read_owned_file(name: str, dir_fd: int, path: Path, uid: int, max_bytes: int) -> bytes | None:
    """Up to ``max_bytes`` of the regular file ``name`` owned by ``uid`` in ``dir_fd``; None
    when there is none. A link, a FIFO, a device or another owner's file is refused unread."""
    try:
        fd = os.open(name, _EXISTING_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link; kvtrace reads no links "
                                  "there") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
            raise UnsafePathError(f"{path} is not a regular file of uid {uid} (mode "
                                  f"{info.st_mode:o}, uid {info.st_uid})")
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def runtime_dir(uid: int | None = None) -> Path:
    """Where an engine running as ``uid`` keeps its control socket (a private directory)."""
    uid = os.getuid() if uid is None else uid
    return Path(os.environ.get("KVTRACE_RUNTIME_DIR", "/tmp")) / f"kvtrace-{uid}"


def check_not_in_runtime_dir(path: str, uid: int | None = None) -> None:
    """Refuse a trace path inside ``uid``'s runtime directory: a capture written there could
    take the control socket's name, and with it the way to stop the capture."""
    directory = Path(os.path.realpath(os.path.dirname(os.path.abspath(path))))
    private = Path(os.path.realpath(runtime_dir(uid)))
    if directory == private or private in directory.parents:
        raise UnsafePathError(f"{path} is in kvtrace's runtime directory {private}, which holds "
                              "the engine's control socket",
                              "Write the trace elsewhere (-o).")


class NewTraceFile:
    """The trace a capture writes at ``path``, made by the engine process (mode 0600) in a
    directory trusted for its user, without following a link anywhere.

    It is created under a fresh, unguessable name (``O_CREAT|O_EXCL|O_NOFOLLOW``) and
    ``publish()`` renames it to ``path`` at once: what had that name is replaced, a link itself
    and never what it points to (a directory is refused), and in a sticky directory another
    user's file cannot be replaced by anyone but root. Until then ``discard()`` removes it and
    leaves whatever ``path`` was untouched, so a failed start changes nothing.
    ``reopen_path`` opens this very file again (``/proc/self/fd``) for the trace writer."""

    def __init__(self, path: str, in_runtime_dir: bool = False) -> None:
        """``in_runtime_dir``: the engine's own default path (SIGUSR1) may be there; an
        operator's path may not (``check_not_in_runtime_dir``)."""
        if not os.path.isabs(path):
            raise KvtraceError(f"the trace path {path!r} is not absolute",
                               "Give the engine an absolute -o path (kvtrace capture does).")
        if not in_runtime_dir:
            check_not_in_runtime_dir(path)
        self.path = path
        directory, self._name = os.path.split(path)
        try:
            self._dir_fd = open_trusted_dir(directory, os.geteuid())
        except FileNotFoundError:
            raise KvtraceError(f"cannot write the trace {path}: {directory} does not exist",
                               "Pick an -o path in a directory that exists.") from None
        try:
            self._check_replaceable()
        except BaseException:
            os.close(self._dir_fd)
            raise
        self._draft = f".{self._name}.{secrets.token_hex(8)}.partial"
        try:
            self._fd = create_file(self._draft, self._dir_fd)
        except OSError as error:
            os.close(self._dir_fd)
            raise _cannot_write(path, error) from None
        self._published = False
        self._size = 0

    @property
    def reopen_path(self) -> str:
        return f"/proc/self/fd/{self._fd}"

    def _check_replaceable(self) -> None:
        """What has the trace's name may be replaced only if it is a file or a link (the link
        itself, never what it points to): not a socket, a device, a FIFO or a directory."""
        try:
            info = os.stat(self._name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
            raise UnsafePathError(f"{self.path} exists and is not a regular file (mode "
                                  f"{info.st_mode:o}); a capture will not replace it",
                                  "Pick another -o path.")

    def publish(self) -> None:
        """Give the file its name."""
        self._check_replaceable()
        try:
            os.rename(self._draft, self._name, src_dir_fd=self._dir_fd,
                      dst_dir_fd=self._dir_fd)
        except OSError as error:
            raise _cannot_write(self.path, error) from None
        self._published = True

    def discard(self) -> None:
        """Remove the file, if it was never published."""
        if not self._published:
            remove_if_there(self._draft, self._dir_fd)

    def size(self) -> int:
        """Bytes written so far; the last size known once closed (a status asked for while
        the capture stops may race with ``close``)."""
        try:
            self._size = os.fstat(self._fd).st_size
        except OSError:
            pass
        return self._size

    def close(self) -> None:
        """Let go of the file (its size stays known)."""
        if self._fd >= 0:
            self.size()
            os.close(self._fd)
            os.close(self._dir_fd)
            self._fd = self._dir_fd = -1


def _cannot_write(path: str, error: OSError) -> KvtraceError:
    return KvtraceError(f"cannot write the trace {path}: {error.strerror}",
                        "Pick an -o path the engine process can write to.")
