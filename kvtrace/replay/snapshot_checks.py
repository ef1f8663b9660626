"""What a start snapshot must satisfy before a backend rebuilds it, checked in one place.

The backends write a snapshot's records into their cache as they stand
(``CacheBackend.restore``), and both trust them: a block named twice, an index past a request's
blocks or a negative hash id fails deep inside vLLM's cache; a prompt length is allocated as a
list of that many tokens; a reference count no request table accounts for replays a cache no
engine could have held, and its figures look like any other. ``check_snapshot`` refuses every
such snapshot before any backend sees it, with one line naming the record, the field and the
value. ``StatePlacement`` refuses state records anywhere but at a trace's head: a capture
writes its snapshot before its first call, once. docs/trace-format.md lists the rules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from kvtrace.engine_config import (MAX_REQUEST_TOKENS, check_pool_fits, hash_id_out_of_range,
                                   num_hashed_units)
from kvtrace.errors import ConfigError
from kvtrace.events import EngineConfig, RequestBlocksState, RequestQueue, RequestState
from kvtrace.probes.snapshot import field_size

from kvtrace.replay.snapshot import SnapshotError, StartSnapshot

if TYPE_CHECKING:
    from kvtrace.traceio import RecordBatch

# vLLM's ``RequestStatus`` names of a request the scheduler holds, unfinished.
IN_FLIGHT_STATUSES = ("WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_REMOTE_KVS",
                      "WAITING_FOR_STREAMING_REQ", "RUNNING", "PREEMPTED")
# Requests vLLM holds no cache for: not admitted yet, or preempted (``_preempt_request`` frees
# their blocks and zeroes their computed tokens).
UNADMITTED_STATUSES = ("WAITING", "PREEMPTED")
# The per-request state only a Mamba "align" group's manager keeps (others lack the attribute).
ALIGN_FIELDS = ("last_state_block_idx", "_num_retired_blocks", "_allocated_block_reqs",
                "_checkpoints", "_producer_partial_tail_reqs")


def check_snapshot(snapshot: StartSnapshot, config: EngineConfig, source: str) -> None:
    """Refuse ``snapshot`` unless the engine of ``config`` could have held it, as everything a
    restore relies on; ``source`` names the trace."""
    _Check(snapshot, config, source).run()


def _times(count: int) -> str:
    return f"{count} time{'s' * (count != 1)}"


class _Check:
    """One snapshot's rules, record kind by record kind; the first broken one is refused."""

    def __init__(self, snapshot: StartSnapshot, config: EngineConfig, source: str) -> None:
        self.snapshot = snapshot
        self.config = config
        self.source = source
        self.num_blocks = config.num_gpu_blocks
        self.groups = config.kv_cache_groups
        self.free = set(snapshot.free_queue)
        self.held: set[int] = set()
        self.keyed: set[int] = set()

    def run(self) -> None:
        self.check_frame()
        self.check_blocks()
        self.check_keys()
        self.check_requests()
        self.check_tables()
        self.check_references()

    def refuse(self, what: str) -> NoReturn:
        raise SnapshotError(f"{self.source}: the start snapshot {what}")

    def check_block(self, block_id: int, null_ok: bool = False) -> None:
        if not (0 if null_ok else 1) <= block_id < self.num_blocks:
            self.refuse(f"names block {block_id}, outside the pool of {self.num_blocks}")

    def check_group(self, group: int) -> None:
        if not 0 <= group < len(self.groups):
            self.refuse(f"names KV-cache group {group}; the engine has {len(self.groups)}")

    def check_hash_ids(self, record: str, hash_ids: Sequence[int]) -> None:
        hash_id = hash_id_out_of_range(hash_ids)
        if hash_id is not None:
            self.refuse(f"{record} has hash id {hash_id}; a capture numbers hashes from 0, "
                        f"below 2^62")

    def check_frame(self) -> None:
        snapshot, started = self.snapshot, self.snapshot.started
        if snapshot.ended is None:
            self.refuse("is incomplete (the trace was cut inside it)")
        if started.num_blocks != self.num_blocks:
            self.refuse(f"describes {started.num_blocks} blocks, the engine has "
                        f"{self.num_blocks}")
        for field, records, kind in (("num_requests", snapshot.requests, "request_state"),
                                     ("num_keys", snapshot.keys, "key_cached")):
            if getattr(started, field) != len(records):
                self.refuse(f"snapshot_started has {field} {getattr(started, field)}, but "
                            f"{len(records)} {kind} records follow")
        if len(self.free) != len(snapshot.free_queue):
            self.refuse("lists a block twice in the free queue")
        for block_id in snapshot.free_queue:
            self.check_block(block_id)

    def check_blocks(self) -> None:
        seen: set[int] = set()
        for block in self.snapshot.blocks:
            block_id = block.block_id
            self.check_block(block_id)
            if block_id in seen:
                self.refuse(f"has two block_state records of block {block_id}")
            seen.add(block_id)
            free = block_id in self.free
            if block.ref_cnt < 0 or (block.ref_cnt > 0) == free:
                self.refuse(f"has block {block_id} with {block.ref_cnt} references "
                            f"{'in' if free else 'outside'} the free queue")
            if block.ref_cnt:
                self.held.add(block_id)
            if block.hash_id != -1:
                self.check_hash_ids(f"block_state of block {block_id}", [block.hash_id])
                self.check_group(block.group)
                self.keyed.add(block_id)
            if block.num_tokens < -1:
                self.refuse(f"block_state of block {block_id} has num_tokens "
                            f"{block.num_tokens}")
        missing = set(range(1, self.num_blocks)) - self.free - self.held
        if missing:
            self.refuse(f"leaves block {min(missing)} neither free nor held")

    def check_keys(self) -> None:
        holders: dict[tuple[int, int], list[int]] = {}
        for key in self.snapshot.keys:
            name = (key.hash_id, key.group)
            self.check_hash_ids(f"key_cached of group {key.group}", [key.hash_id])
            self.check_group(key.group)
            if name in holders:
                self.refuse(f"has two key_cached records of hash {key.hash_id} in group "
                            f"{key.group}")
            if not key.block_ids:
                self.refuse(f"caches hash {key.hash_id} on no block")
            if len(set(key.block_ids)) != len(key.block_ids):
                self.refuse(f"key_cached of hash {key.hash_id} lists a block twice")
            if key.num_tokens < 0:
                self.refuse(f"key_cached of hash {key.hash_id} has num_tokens {key.num_tokens}")
            for block_id in key.block_ids:
                self.check_block(block_id)
                if block_id not in self.keyed:
                    self.refuse(f"caches hash {key.hash_id} on block {block_id}, which has no "
                                "key")
            holders[name] = key.block_ids
        for block in self.snapshot.blocks:
            if block.hash_id != -1 and block.block_id not in holders.get(
                    (block.hash_id, block.group), ()):
                self.refuse(f"block_state of block {block.block_id} is keyed with hash "
                            f"{block.hash_id} in group {block.group}, which no key_cached "
                            "record lists it under")

    def check_requests(self) -> None:
        snapshot, unit = self.snapshot, self.config.hash_block_size
        lookahead = self.config.num_hash_lookahead_tokens
        if len({r.req for r in snapshot.requests}) != len(snapshot.requests):
            self.refuse("lists a request twice")
        for request in snapshot.requests:
            record = f"request_state of request {request.req}"
            if request.req < 0:
                self.refuse(f"has {record}; requests are numbered from 0")
            status = request.status
            if (status not in IN_FLIGHT_STATUSES
                    or (request.queue == RequestQueue.RUNNING) != (status == "RUNNING")):
                self.refuse(f"has request {request.req} {status!r} in the "
                            f"{getattr(request.queue, 'name', request.queue)} queue")
            self.check_lengths(record, request)
            num_units = num_hashed_units(request.num_tokens, unit, lookahead)
            if len(request.hash_ids) != num_units:
                self.refuse(f"{record} has {len(request.hash_ids)} hash_ids for its "
                            f"{request.num_tokens} tokens; hash unit {unit} makes {num_units}")
            self.check_hash_ids(record, request.hash_ids)
            if status in UNADMITTED_STATUSES and request.num_computed_tokens:
                self.refuse(f"{record} has num_computed_tokens {request.num_computed_tokens}, "
                            f"but vLLM holds nothing of a {status} request")

    def check_lengths(self, record: str, request: RequestState) -> None:
        """Every count in range: what a backend allocates follows them (a token list), so each
        is bounded as an arriving request is (``engine_config.check_added_request``)."""
        num_tokens = request.num_tokens
        total = max(num_tokens, request.prompt_len + request.max_tokens)
        if total > MAX_REQUEST_TOKENS:
            self.refuse(f"{record} has {total:,} tokens (prompt_len {request.prompt_len}, "
                        f"max_tokens {request.max_tokens}, num_tokens {num_tokens}), more than "
                        f"the {MAX_REQUEST_TOKENS:,} kvtrace replays")
        try:
            check_pool_fits(self.config, request.req, total)
        except ConfigError as error:
            self.refuse(f"has a request_state that no engine could hold: {error}")
        for field, value, low, high in (
                ("prompt_len", request.prompt_len, 1, num_tokens),
                ("max_tokens", request.max_tokens, 0, None),
                # Async: a step in flight counts its tokens computed before it samples them.
                ("num_output_placeholders", request.num_output_placeholders, 0,
                 request.max_tokens),
                ("num_computed_tokens", request.num_computed_tokens, 0,
                 num_tokens + request.num_output_placeholders),
                ("num_in_flight_tokens", request.num_in_flight_tokens, 0,
                 request.num_computed_tokens + request.num_stale_output_tokens),
                ("num_stale_output_tokens", request.num_stale_output_tokens, 0,
                 request.num_in_flight_tokens),
                ("shared_prefix_boundary", request.shared_prefix_boundary, 0, num_tokens),
                ("num_preemptions", request.num_preemptions, 0, None)):
            if value < low or (high is not None and value > high):
                self.refuse(f"{record} has {field} {value}, "
                            + (f"below {low}" if high is None else f"outside {low} to {high}"))

    def check_tables(self) -> None:
        """Each request's blocks and per-request state (``request_blocks_state``): one record
        per group, in every group or none (a running request in every one), none for a request
        vLLM holds nothing of, blocks that are held, fields the group's manager keeps, each
        index within the request's blocks."""
        requests = {r.req: r for r in self.snapshot.requests}
        groups_of: dict[int, list[int]] = {}
        for table in self.snapshot.request_blocks:
            request = requests.get(table.req)
            if request is None:
                self.refuse(f"gives blocks to request {table.req}, which it does not list")
            self.check_group(table.group)
            if table.group in groups_of.setdefault(table.req, []):
                self.refuse(f"has two request_blocks_state records of request {table.req} in "
                            f"group {table.group}")
            groups_of[table.req].append(table.group)
            if request.status in UNADMITTED_STATUSES:
                self.refuse(f"gives request {table.req} ({request.status}) blocks in group "
                            f"{table.group}; vLLM holds none for a request it has not admitted")
            for block_id in table.block_ids:
                self.check_block(block_id, null_ok=True)
                if block_id and block_id not in self.held:
                    self.refuse(f"gives request {table.req} block {block_id}, which nobody "
                                "holds")
            self.check_fields(table, request)
        for request in self.snapshot.requests:
            present = groups_of.get(request.req, ())
            if (present or request.queue == RequestQueue.RUNNING) and len(present) != len(
                    self.groups):
                absent = min(set(range(len(self.groups))) - set(present))
                self.refuse(f"request {request.req} has request_blocks_state in "
                            f"{len(present)} of the {len(self.groups)} KV-cache groups, none "
                            f"in group {absent}")

    def check_fields(self, table: RequestBlocksState, request: RequestState) -> None:
        group = self.groups[table.group]
        align = group.kind == "mamba" and (group.mamba_cache_mode or "align") == "align"
        num_blocks = len(table.block_ids)
        for name, values in table.fields.items():
            size = field_size(name)
            if size is None:
                self.refuse(f"has unknown per-request state {name!r}")
            if len(values) != size:
                self.refuse(f"has {name} = {values} for request {table.req}, not {size} values")
            if name in ALIGN_FIELDS and not align:
                self.refuse(f"gives request {table.req} {name} in group {table.group} "
                            f"({group.kind}), which keeps no such state")
            blocks = f"its {num_blocks} blocks in group {table.group}"
            if name in ("num_cached_block", "_num_retired_blocks"):
                within, meant = 0 <= values[0] <= num_blocks, f"a count of {blocks}"
            elif name == "last_state_block_idx":
                within, meant = 0 <= values[0] < num_blocks, f"an index of {blocks}"
            elif name == "_checkpoints":
                within = 0 < values[0] <= request.num_tokens and 0 <= values[1] < num_blocks
                meant = f"a position in its {request.num_tokens} tokens and an index of {blocks}"
            elif name == "_partial_hit_reqs":
                within = (0 <= values[0] < num_blocks
                          and table.block_ids[values[0]] == values[1])
                meant = f"an index of {blocks} and the block there"
            elif name == "_producer_partial_tail_reqs":
                within = (values[0] in table.block_ids and values[0] != 0
                          and 0 < values[1] <= request.num_tokens)
                meant = f"one of {blocks} and a position in its {request.num_tokens} tokens"
            else:  # _allocated_block_reqs: a member, no values
                within, meant = True, ""
            if not within:
                self.refuse(f"request_blocks_state of request {table.req} has {name} {values}, "
                            f"not {meant}")

    def check_references(self) -> None:
        """A block's reference count is the request table entries that hold it, all in one
        group (each group allocates its own blocks)."""
        references: Counter = Counter()
        groups: dict[int, set[int]] = {}
        for table in self.snapshot.request_blocks:
            for block_id in table.block_ids:
                if block_id:
                    references[block_id] += 1
                    groups.setdefault(block_id, set()).add(table.group)
        for block in self.snapshot.blocks:
            if block.ref_cnt != references[block.block_id]:
                self.refuse(f"block_state of block {block.block_id} has ref_cnt "
                            f"{block.ref_cnt}, but request tables hold it "
                            f"{_times(references[block.block_id])}")
        for block_id, in_groups in groups.items():
            if len(in_groups) > 1:
                self.refuse(f"has block {block_id} in the tables of groups "
                            f"{sorted(in_groups)}; a block serves one group")


class StatePlacement:
    """Fed a trace's batches in order: refuses a state record after the first call (input or
    effect). A capture writes its start snapshot before arming its probes, so one after the
    calls began is a trace put together or edited, and it is not the cache they started from."""

    def __init__(self) -> None:
        self.first_call: int | None = None  # the first call's record number

    def add_batch(self, batch: RecordBatch) -> None:
        kinds = batch.kinds
        families = [getattr(t, "family", None) for t in batch.types]
        calls = [kinds.find(bytes([i])) for i, family in enumerate(families)
                 if family in ("input", "effect")]
        calls = [position for position in calls if position >= 0]
        if self.first_call is None and calls:
            self.first_call = batch.first_seq + min(calls)
        if self.first_call is None:
            return
        start = max(0, self.first_call - batch.first_seq)
        late = [(kinds.find(bytes([i]), start), i) for i, family in enumerate(families)
                if family == "state"]
        late = [(position, i) for position, i in late if position >= 0]
        if late:
            position, i = min(late)
            raise SnapshotError(
                f"record {batch.first_seq + position} ({batch.tags[i]}) comes after the "
                f"trace's calls began (record {self.first_call}); a start snapshot opens its "
                "trace",
                "A capture writes its snapshot first, and once: this trace was put together "
                "or edited. Capture again; the trace itself was not changed.")
