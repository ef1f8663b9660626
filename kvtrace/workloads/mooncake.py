"""Import a Mooncake ``hash_ids`` request log (FAST'25 trace format) as a workload.

Each JSONL line is one request: ``timestamp`` (ms from the start), ``input_length``,
``output_length`` and ``hash_ids``, one id per source block of ``source_block_size`` tokens (512 in
Mooncake's release, 16 in Qwen-Bailian's), ``ceil(input_length / block)`` of them. An id is a
*prefix* hash: it stands for its block and every block before it.

Mapping onto the hash unit H: unit i covers tokens [0, (i+1)·H); its last token lies in source
block j = ((i+1)·H - 1) // block, and the prefix it ends is identified by (hash_ids[j], where the
unit ends inside that block). Those pairs get dense ids in order of first appearance, so the
same Mooncake prefix always gives the same unit ids, a 512-token block expands to 512/H units,
and only full units up to ``input_length`` get an id. Sharing is exact at the source block's
granularity: inside a block, units are shared only where the block ids match (a prompt that
ends mid-block shares nothing of that block with its continuation; the log does not say how
much of it is common). Outputs get no declared ids: the log does not say which later prompt
contains them.
"""

from __future__ import annotations

import hashlib
import os

import msgspec

from kvtrace.errors import KvtraceError
from kvtrace.workloads.workload import Workload, WorkloadRequest

MOONCAKE_BLOCK_SIZE = 512
# The longest line read: a request of the most tokens kvtrace replays (2**26) takes about 3 MB
# at Mooncake's 512-token blocks and 40 MB at Bailian's 16. A longer line (or one without end:
# /dev/zero) is refused once this much of it is read, not held whole.
MAX_LINE_BYTES = 64 << 20


class MooncakeRow(msgspec.Struct):
    """One request line; unknown keys (e.g. Bailian's chat_id) are ignored."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


class RequestLogError(KvtraceError):
    """A request log line that cannot be imported."""

    default_hint = (
        "Each line must be one JSON object with integer timestamp (ms), input_length, "
        "output_length and hash_ids (one prefix-block id per block, ceil(input_length / block) "
        "of them)."
    )


def _check_row(row: MooncakeRow, block_size: int) -> str | None:
    """What is wrong with a decoded row, if anything."""
    if row.timestamp < 0:
        return f"timestamp {row.timestamp} is negative"
    if row.input_length < 1:
        return f"input_length {row.input_length} is not positive"
    if row.output_length < 0:
        return f"output_length {row.output_length} is negative"
    expected = -(-row.input_length // block_size)
    if len(row.hash_ids) != expected:
        return (f"{len(row.hash_ids)} hash_ids for input_length {row.input_length}; expected "
                f"ceil({row.input_length}/{block_size}) = {expected}")
    return None


def read_request_log(path: str | os.PathLike,
                     block_size: int = MOONCAKE_BLOCK_SIZE) -> tuple[list[tuple[int, MooncakeRow]], str]:
    """Decode and check every line: ``[(line number, row)]`` in file order, and the file's
    sha256. Raises ``RequestLogError`` naming the first bad line."""
    path = os.fspath(path)
    decoder = msgspec.json.Decoder(MooncakeRow)
    digest = hashlib.sha256()
    rows: list[tuple[int, MooncakeRow]] = []
    parent_of: dict[int, tuple[int | None, int]] = {}  # block id -> (parent id, first line)
    try:
        with open(path, "rb") as log:
            for line_number, line in enumerate(iter(lambda: log.readline(MAX_LINE_BYTES + 1),
                                                    b""), start=1):
                if len(line) > MAX_LINE_BYTES:
                    raise RequestLogError(
                        f"{path}, line {line_number}: longer than {MAX_LINE_BYTES >> 20} MiB, "
                        "more than any request kvtrace replays takes",
                        "Check that it is a request log, one JSON object per line.")
                digest.update(line)
                if not line.strip():
                    continue
                try:
                    row = decoder.decode(line)
                except msgspec.ValidationError as error:
                    raise RequestLogError(f"{path}, line {line_number}: {error}") from None
                except msgspec.DecodeError as error:
                    raise RequestLogError(f"{path}, line {line_number}: not JSON ({error})") from None
                problem = _check_row(row, block_size)
                if problem is None:
                    problem = _check_chain(row.hash_ids, line_number, parent_of)
                if problem is not None:
                    raise RequestLogError(f"{path}, line {line_number}: {problem}")
                rows.append((line_number, row))
    except OSError as error:
        raise RequestLogError(f"cannot read {path}: {error.strerror}",
                              "Check the path of the request log.") from None
    if not rows:
        raise RequestLogError(f"{path} holds no requests")
    return rows, digest.hexdigest()


def _check_chain(hash_ids: list[int], line_number: int,
                 parent_of: dict[int, tuple[int | None, int]]) -> str | None:
    """Prefix ids form a tree: an id must follow the same parent everywhere."""
    parent = None
    for block_id in hash_ids:
        known_parent, first_line = parent_of.setdefault(block_id, (parent, line_number))
        if known_parent != parent:
            def where(p: int | None) -> str:
                return "the start" if p is None else f"id {p}"
            return (f"block id {block_id} follows {where(parent)} here but {where(known_parent)} "
                    f"on line {first_line}: hash_ids are not prefix (chained) hashes")
        parent = block_id
    return None


def import_mooncake(path: str | os.PathLike, hash_unit: int,
                    block_size: int = MOONCAKE_BLOCK_SIZE) -> Workload:
    """The request log as a workload at ``hash_unit``, requests in timestamp order (stable)."""
    rows, sha256 = read_request_log(path, block_size)
    rows.sort(key=lambda numbered: numbered[1].timestamp)
    unit_ids: dict[tuple[int, int], int] = {}
    requests = []
    num_clamped = 0
    for line_number, row in rows:
        ids = []
        for end in range(hash_unit, row.input_length + 1, hash_unit):
            block = (end - 1) // block_size
            key = (row.hash_ids[block], end - block * block_size)
            ids.append(unit_ids.setdefault(key, len(unit_ids)))
        # vLLM needs max_tokens >= 1; a logged 0 (an aborted request) decodes one token.
        num_clamped += row.output_length == 0
        requests.append(WorkloadRequest(
            arrival_ns=row.timestamp * 1_000_000, prompt_len=row.input_length, hash_ids=ids,
            max_tokens=max(row.output_length, 1), output_hash_ids=[],
            request_id=f"line-{line_number}"))
    params = {
        "generator": "kvtrace import mooncake",
        "source_file": os.path.basename(os.fspath(path)),
        "source_sha256": sha256,
        "source_block_size": str(block_size),
        "requests": str(len(requests)),
        "hash_unit": str(hash_unit),
        "output_length_zero_clamped": str(num_clamped),
    }
    return Workload("import", requests, hash_unit, params)
