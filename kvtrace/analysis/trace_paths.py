"""The traces a load is given: files, directories of them (a replay's output), and directories
of partitions, which stay as they are."""

from __future__ import annotations

import os

from kvtrace.analysis.database import DatabaseError
from kvtrace.analysis.part_files import PARTS_MANIFEST

TRACE_SUFFIX = ".kvtrace"


def trace_paths(paths: list[str | os.PathLike]) -> list[str]:
    """Expand directories (replay output dirs) to the ``*.kvtrace`` files they hold; a
    directory of partitions (``PARTS_MANIFEST``) stays as it is."""
    found = []
    for path in map(os.fspath, paths):
        if os.path.isdir(path) and not is_partitions(path):
            inside = sorted(
                os.path.join(path, name) for name in os.listdir(path) if name.endswith(TRACE_SUFFIX)
            )
            if not inside:
                raise DatabaseError(
                    f"{path} holds no *{TRACE_SUFFIX} traces",
                    hint="Pass trace files, the output directory of `kvtrace replay`, or one "
                         "that `kvtrace load --parquet` wrote.",
                )
            found.extend(inside)
        else:
            found.append(path)
    if not found:
        raise DatabaseError("no traces given", hint="kvtrace load TRACE|OUTDIR ... -o DB.duckdb")
    return found


def is_partitions(path: str) -> bool:
    """Whether ``path`` is a directory of parts that ``load_partitions`` wrote."""
    return os.path.isfile(os.path.join(path, PARTS_MANIFEST))

