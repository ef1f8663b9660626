"""vLLM's own prefix-cache counters, recorded beside a capture (``kvtrace capture
--vllm-metrics``: ``kvtrace.capture.vllm_metrics``), loaded into the database and reconciled
with the trace (``kvtrace/sql/vllm_counter_reconciliation.sql``, docs/vllm-counters.md).

The table ``vllm_counters(run, ts_ns, name, labels, value)`` holds one row per counter sample:
the scrape's wall clock (ns), the counter's name, its labels as JSON text (keys sorted, so one
text names one series) and its value. ``load_vllm_counters`` makes it in every database it
loads into, with or without a sidecar, so that the query reads it in any of them.
"""

from __future__ import annotations

import json
import os
import re
import stat

from kvtrace.analysis.database import VLLM_COUNTERS_TABLE
from kvtrace.analysis.queries import run_query
from kvtrace.errors import KvtraceError, UnsafePathError
from kvtrace.files import planted_link

# kvtrace.capture.vllm_metrics.SIDECAR_SUFFIX: the sidecar is named after the trace (analysis
# may not import capture; a test holds the two equal).
SIDECAR_SUFFIX = ".vllm-metrics.jsonl"
TABLE = "CREATE TABLE IF NOT EXISTS {} ({})".format(*VLLM_COUNTERS_TABLE)
QUERY = "vllm_counter_reconciliation"
_RANK = re.compile(r"_DP(\d+)$")  # VLLM::EngineCore_DP3: data-parallel rank 3
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class CountersError(KvtraceError):
    """A sidecar of vLLM's counters that cannot be read, or is not one."""

    default_hint = ("The file beside the trace is damaged or was not written by kvtrace "
                    "capture --vllm-metrics; move it away to load the trace without it.")


def sidecars(trace_path: str, rank: str | None) -> list[str]:
    """Where a trace's counters may be: beside it, and, for one data-parallel rank's trace
    (``prod.dp0.kvtrace``), beside the path the capture was given (``prod.kvtrace``): one
    recorder scrapes every engine of an API server."""
    candidates = [trace_path + SIDECAR_SUFFIX]
    stem, ext = os.path.splitext(trace_path)
    if rank is not None and stem.endswith(f".dp{rank}"):
        candidates.append(stem[:-len(f".dp{rank}")] + ext + SIDECAR_SUFFIX)
    return candidates


def read_sidecar(path: str) -> list[tuple[int, str, str, float]] | None:
    """The samples of the sidecar at ``path`` as (ts_ns, name, labels JSON, value); None when
    there is none. It must be a regular file of this user or root, reached through no link
    another user could have planted. A last line cut off (the recorder stopped mid-write) is
    left out, as a trace's last incomplete frame is; any other line that is not a scrape raises
    ``CountersError`` naming the file and the line."""
    problem = planted_link(os.path.dirname(os.path.abspath(path)))
    if problem:
        raise UnsafePathError(f"{problem}; kvtrace will not read {path} through it")
    try:
        fd = os.open(path, _OPEN)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise (UnsafePathError(f"{path} is a symbolic link; kvtrace reads vLLM's counters "
                               "from a regular file only") if os.path.islink(path)
               else CountersError(f"cannot read {path}: {error.strerror}")) from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in (0, os.geteuid()):
            raise UnsafePathError(f"{path} is not a regular file of uid {os.geteuid()} or root "
                                  f"(mode {info.st_mode:o}, uid {info.st_uid})")
        lines = file.read().split(b"\n")
    rows = []
    for number, line in enumerate(lines[:-1], 1):  # lines[-1]: empty, or the cut-off tail
        try:
            scrape = json.loads(line)
            rows += [(_integer(scrape["ts_ns"]), _text(sample["name"]),
                      json.dumps({_text(k): _text(v) for k, v in sample["labels"].items()},
                                 sort_keys=True), _number(sample["value"]))
                     for sample in scrape["samples"]]
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise CountersError(f"{path}:{number}: not a scrape of vLLM's counters "
                                f"({type(error).__name__}: {error})") from None
    return rows


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not text")
    return value


def _integer(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def load_vllm_counters(connection, run: int, trace_path: str) -> int:
    """Load the counters recorded beside the trace of ``run`` (loaded already, its ``runs`` row
    in) into ``vllm_counters``, made if missing; the run's rows loaded before are replaced.
    Only the samples of the trace's own engine are kept (label ``engine``: its data-parallel
    rank, read from its process title) when it is one rank's. Returns the scrapes loaded (0:
    no sidecar)."""
    connection.execute(TABLE)
    connection.execute("DELETE FROM vllm_counters WHERE run = ?", [run])
    title = connection.execute(
        "SELECT json_extract_string(header_json, '$.process_title') FROM runs WHERE run = ?",
        [run]).fetchone()
    match = _RANK.search(title[0] or "") if title else None
    rank = match.group(1) if match else None
    path = next((p for p in sidecars(os.fspath(trace_path), rank) if os.path.lexists(p)), None)
    rows = (read_sidecar(path) or []) if path else []
    if rank is not None:
        rows = [row for row in rows if json.loads(row[2]).get("engine", rank) == rank]
    if not rows:
        return 0
    ts, names, labels, values = (list(column) for column in zip(*rows))
    connection.execute(
        "INSERT INTO vllm_counters SELECT $run, unnest($ts::BIGINT[]), unnest($names::VARCHAR[]),"
        " unnest($labels::VARCHAR[]), unnest($values::DOUBLE[])",
        {"run": run, "ts": ts, "names": names, "labels": labels, "values": values})
    return len(set(ts))


def reconciliation_lines(connection) -> list[str]:
    """The report's section: per run with vLLM's counters recorded, what they read over the
    capture, kvtrace's admitted lookups over the same window, and which counting rule the
    counters followed (the query's ``counting``). Empty when no run has counters."""
    result = run_query(connection, QUERY)
    lines = []
    for row in (dict(zip(result.columns, values)) for values in result.rows):
        if row["counting"] is None:
            continue
        lines.append(
            f"run {row['run']} ({row['variant']}): vLLM's counters over {row['window_s']:.1f} s "
            f"({row['scrapes']} scrapes): {row['vllm_query_tokens']:,} query tokens, "
            f"{row['vllm_hit_tokens']:,} hits ({_rate(row['vllm_hit_rate'])}); kvtrace's "
            f"{row['admitted_lookups']:,} admitted lookups: {row['admitted_query_tokens']:,} "
            f"query tokens, {row['admitted_hit_tokens']:,} hits ({_rate(row['hit_rate'])}). "
            + _verdict(row))
    return lines


def _rate(rate: float | None) -> str:
    return "no queries" if rate is None else f"{rate:.2%}"


def _verdict(row: dict) -> str:
    differ = (f"its counters differ from kvtrace's by {row['overcounted_query_tokens']:+,} "
              f"query tokens and {row['overcounted_hit_tokens']:+,} hits, with "
              f"{row['edge_query_tokens']:,} query tokens uncertain at the scrapes' edges")
    retried = (f"{row['retried_lookups']:,} retried lookups ({row['retried_query_tokens']:,} "
               f"query tokens, {row['retried_hit_tokens']:,} hits)")
    if row["counting"] == "admission":
        return (f"vLLM counted each admission once (vllm #48860): {differ}. A counter at every "
                f"lookup (vllm #43736) would have added the {retried}.")
    if row["counting"] == "lookup":
        return (f"vLLM counted at every lookup (vllm #43736), the {retried} again: {differ}. "
                "Its hit rate is not the cache's: read kvtrace's.")
    if row["counting"] == "either":
        return f"{differ}; the {retried} are too few to tell whether vLLM counted them."
    return (f"{differ}, which neither counting rule gives: the counters are another engine's, "
            "or were reset or restarted during the capture.")
