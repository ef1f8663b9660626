"""Where a running process has the C functions kvtrace's injector calls, read from the ELF
files it mapped, while it runs: nothing here stops or touches the process.

A function's address is the load bias of the object that defines it (where ``/proc/PID/maps``
shows the file's first page, less the first ``PT_LOAD``'s page) plus the symbol's value in the
object's ``.dynsym``. Each file is opened through ``/proc/PID/root`` (the process's own view,
in a container too), without following a link in its last component, and must be the file the
mapping names (same device and inode); the parser reads bounded sizes only and raises
``AttachError`` on anything it does not understand.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from kvtrace.capture.inject import AttachError

ELF_MAGIC = b"\x7fELF"
ELFCLASS64, ELFDATA2LSB, EM_X86_64 = 2, 1, 62
ET_EXEC = 2
PT_LOAD = 1
SHT_DYNSYM = 11
STT_FUNC, STT_GNU_IFUNC = 2, 10
MAX_SYMBOLS = 1 << 20  # more than any libpython or libc exports
MAX_TABLE_BYTES = 64 << 20


@dataclass(frozen=True)
class Mapping:
    """A mapped file: where its first page is in the process, and which file it is."""

    path: str
    base: int
    device: str  # as /proc/PID/maps prints it: "fd:01"
    inode: int


def mapped_files(pid: int) -> list[Mapping]:
    """Each file ``pid`` mapped from offset 0, at its lowest address, in the order of maps."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError as error:
        raise AttachError(f"cannot read /proc/{pid}/maps: {error.strerror}",
                          "Run as the engine's user or root; the process may have exited.")
    found: dict[str, Mapping] = {}
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/") or int(fields[2], 16) != 0:
            continue
        start = int(fields[0].split("-")[0], 16)
        path = fields[5]
        if path not in found or start < found[path].base:
            found[path] = Mapping(path, start, fields[3], int(fields[4]))
    return list(found.values())


def _open_mapped(pid: int, mapping: Mapping) -> int:
    """A descriptor of the very file ``mapping`` names, seen from the process's root."""
    try:
        fd = os.open(f"/proc/{pid}/root{mapping.path}", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        raise AttachError(f"cannot open {mapping.path} as pid {pid} maps it: {error.strerror}",
                          "Use --method plugin, or lldb or gdb.") from None
    info = os.fstat(fd)
    major, minor = (int(part, 16) for part in mapping.device.split(":"))
    if (info.st_ino, os.major(info.st_dev), os.minor(info.st_dev)) != (mapping.inode, major,
                                                                         minor):
        os.close(fd)
        raise AttachError(f"{mapping.path} is no longer the file pid {pid} mapped",
                          "The library was replaced after the process started; restart it, or "
                          "use --method plugin.")
    return fd


def _read(fd: int, offset: int, size: int, what: str) -> bytes:
    if size < 0 or size > MAX_TABLE_BYTES or offset < 0:
        raise AttachError(f"{what} is not an ELF file kvtrace can read",
                          "Use --method plugin, or lldb or gdb.")
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise AttachError(f"{what} is cut short", "Use --method plugin, or lldb or gdb.")
    return data


def exported_functions(pid: int, mapping: Mapping, names: set[str]) -> dict[str, int]:
    """The addresses in ``pid`` of those of ``names`` the mapped object defines and exports."""
    fd = _open_mapped(pid, mapping)
    what = mapping.path
    try:
        header = _read(fd, 0, 64, what)
        if header[:4] != ELF_MAGIC or header[4] != ELFCLASS64 or header[5] != ELFDATA2LSB:
            raise AttachError(f"{what} is not a 64-bit little-endian ELF file",
                              "kvtrace's injector supports x86-64 only; use lldb or gdb.")
        (e_type, e_machine, _, _, e_phoff, e_shoff, _, _, e_phentsize, e_phnum, e_shentsize,
         e_shnum, _) = struct.unpack_from("<HHIQQQIHHHHHH", header, 16)
        if e_machine != EM_X86_64 or e_phentsize != 56 or e_shentsize != 64:
            raise AttachError(f"{what} is not an x86-64 object",
                              "kvtrace's injector supports x86-64 only; use lldb or gdb.")
        programs = _read(fd, e_phoff, 56 * e_phnum, what)
        loads = [struct.unpack_from("<IIQQ", programs, 56 * i) for i in range(e_phnum)]
        first_load = min((vaddr for kind, _, _, vaddr in loads if kind == PT_LOAD), default=None)
        if first_load is None:
            raise AttachError(f"{what} has no loadable segment", "Use --method plugin.")
        bias = 0 if e_type == ET_EXEC else mapping.base - (first_load & ~0xFFF)
        sections = _read(fd, e_shoff, 64 * e_shnum, what)
        found: dict[str, int] = {}
        for index in range(e_shnum):
            kind, = struct.unpack_from("<I", sections, 64 * index + 4)
            if kind != SHT_DYNSYM:
                continue
            offset, size = struct.unpack_from("<QQ", sections, 64 * index + 24)
            link, = struct.unpack_from("<I", sections, 64 * index + 40)
            entsize, = struct.unpack_from("<Q", sections, 64 * index + 56)
            if entsize != 24 or size // 24 > MAX_SYMBOLS or link >= e_shnum:
                raise AttachError(f"{what}'s symbol table is malformed", "Use --method plugin.")
            str_offset, str_size = struct.unpack_from("<QQ", sections, 64 * link + 24)
            strings = _read(fd, str_offset, str_size, what)
            symbols = _read(fd, offset, size, what)
            for start in range(0, size - size % 24, 24):
                name_at, info, _, shndx, value, _ = struct.unpack_from("<IBBHQQ", symbols, start)
                if shndx == 0 or (info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC):
                    continue
                end = strings.find(b"\0", name_at)
                name = strings[name_at:end].decode("ascii", "replace")
                if name in names:
                    found[name] = bias + value
        return found
    finally:
        os.close(fd)


def resolve(pid: int, python_names: set[str], libc_names: set[str]) -> dict[str, int]:
    """Every name's address in ``pid``: CPython's C API from the executable or its
    ``libpython``, the others from ``libc``; ``AttachError`` naming what is missing."""
    mappings = mapped_files(pid)
    executable = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    pythons = [m for m in mappings if m.path == executable or "/libpython" in m.path]
    libcs = [m for m in mappings if os.path.basename(m.path).startswith(("libc.so", "libc-"))]
    found: dict[str, int] = {}
    for wanted, candidates in ((python_names, pythons), (libc_names, libcs)):
        for mapping in candidates:
            found.update(exported_functions(pid, mapping, wanted - found.keys()))
    missing = sorted((python_names | libc_names) - found.keys())
    if missing:
        raise AttachError(f"pid {pid} exports no {', '.join(missing)}",
                          "kvtrace's injector needs CPython's C API and glibc; use --method "
                          "plugin.")
    return found
