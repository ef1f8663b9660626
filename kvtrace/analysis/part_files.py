"""Where a part lies: one run's rows of a table as Parquet files, in the hive layout
``<table>/run=<n>/data_<i>.parquet`` under its directory (``run`` is in the path, not in the
files), and what a worker is asked to make of a trace (``PartTask``). A directory of parts
written to be kept (``load_partitions``) says what it holds in ``PARTS_MANIFEST``."""

from __future__ import annotations

import os
from dataclasses import dataclass

PART_FILE = "data_{}.parquet"
PARTS_MANIFEST = "_kvtrace_partitions.json"


@dataclass(frozen=True)
class PartTask:
    """What a worker loads: the trace of run ``run`` into ``directory``, its spill files in
    ``scratch``; ``file``: where its bytes are, when not at ``path`` (a copy shipped to another
    host)."""

    run: int
    path: str
    absolute: str
    directory: str
    scratch: str
    compression: str
    file: str | None = None


def part_file(directory: str, table: str, run: int, index: int = 0) -> str:
    """Where a part keeps a table's rows of a run (``table`` by its name in the main schema),
    its ``index``-th file."""
    return os.path.join(directory, table, f"run={int(run)}", PART_FILE.format(index))


def make_part_directory(path: str) -> None:
    """The directories of a part's file; never the part's own directory: gone, the load was
    stopped and cleaned up behind the worker."""
    try:
        os.mkdir(os.path.dirname(os.path.dirname(path)))
    except FileExistsError:
        pass
    os.mkdir(os.path.dirname(path))
