"""The in-engine half of capture: runs inside a vLLM engine-core process.

``CaptureSession.start()`` checks every probed signature (refusing before anything is patched if
one differs from the supported version) and arms the capture *at the start of the engine's next
step*, on vLLM's scheduler thread (``NextStep``): production is mid-flight, so the first records
are the start snapshot (``probes.snapshot``: the cache and the requests in flight as they stand
then), taken between two steps where nothing else changes them, and only then are the shared
probes armed on the real vLLM classes. From then on the
probes hand each engine step's records, as one list, to a ``StepBuffer``, a bounded buffer that
encodes them in batches of steps (msgspec, in C, while the records are still in cache). A writer
thread drains the encoded chunks, frames and writes them, holding the interpreter lock only
briefly (with the native core, not at all while it joins, checksums and writes), so it barely
competes with the scheduler thread: encoding there, whole batches of records gone cold, cost the
engine several times more. Records that do not fit (the capacity counts records) are dropped
and counted, and an ``EventsDropped`` marker goes where the gap is: the scheduler thread never
waits for the disk. ``stop()`` disarms at a step boundary (the scheduler thread itself, when
its next step starts, hands over the last whole step and restores every original function
object; ``_disarm_probes``), drains, and closes the trace with its drop count.

Nothing here may raise into vLLM: the probes swallow their own failures; a writer that fails
(disk full, a broken sink) disarms the probes from its own thread and records the error for
``status()``. Arming is all or nothing: a start that fails part way undoes what it did (no
probe left patched, no writer thread, no trace file), so the process can arm again.

Imports: stdlib, msgspec, kvtrace.events/traceio/probes and the control messages; vLLM only
inside functions.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from typing import Any, Iterator

import msgspec

from kvtrace import __version__, native
from kvtrace.capture.live_engine import (
    engine_config_of,
    engine_variant,
    find_kv_cache_managers,
    process_title,
    scheduling,
    served_model,
)
from kvtrace.capture.messages import (
    AlreadyCapturingError,
    CaptureOptions,
    CaptureStatus,
    checked_options,
)
from kvtrace.capture.next_step import NextStep
from kvtrace.capture.recorder import RingFiles
from kvtrace.capture.safe_paths import NewTraceFile
from kvtrace.capture.step_buffer import StepBuffer
from kvtrace.errors import KvtraceError
from kvtrace.events import EventsDropped, HashInterner, Record, TraceHeader
from kvtrace.traceio import TraceWriter, encode_rows
from kvtrace.vllm_releases import running_vllm_build, running_vllm_version

WRITER_POLL_S = 0.02
# Records are encoded in batches of steps: this many records, or the oldest this old.
ENCODE_BATCH_RECORDS = 256
ENCODE_MAX_DELAY_S = 0.05
# How long a stop waits for the engine's next step to disarm there (an idle engine has none).
DISARM_WAIT_S = 1.0


class CaptureSession:
    """One capture to one trace file; at most one per process (see ``active_session``)."""

    def __init__(self, options: CaptureOptions, default_path: bool = False) -> None:
        """``default_path``: the engine chose ``options.path`` itself (SIGUSR1), in its
        runtime directory, where an operator's ``-o`` may not point."""
        self.options = options
        self._default_path = default_path
        self.num_dropped = 0
        self.error: str | None = None
        self.started_ns = 0
        self.snapshot_pause_ns: int | None = None  # None: the first step has not come yet
        step_buffer = StepBuffer if native.core is None else native.core.StepBuffer
        self._steps = step_buffer(encode_rows, options.buffer_capacity, self._overflow,
                                  ENCODE_BATCH_RECORDS, ENCODE_MAX_DELAY_S)
        self._stop = threading.Event()
        self._trace_file: NewTraceFile | None = None
        self._header: TraceHeader | None = None
        self._ring: RingFiles | None = None  # a flight recorder's segments (``options.ring_s``)
        self._segment_taken = False  # whether the segment being written has its snapshot
        # In a ring's segments before the current one.
        self._bytes_closed = self._records_closed = self._dropped_closed = 0
        self._keyframe_due_ns = 0  # monotonic
        self._keyframe_lock = threading.Lock()  # no keyframe is asked for once stopping
        self.num_keyframes = self.max_keyframe_pause_ns = 0  # a ring's, after its first
        self._writer: TraceWriter | None = None
        self._writer_thread: threading.Thread | None = None
        self._probes: Any = None
        self._next_step: NextStep | None = None
        self._telemetry: Any = None
        self._stopped = False
        self._scheduler_thread: int | None = None
        self._disarmed_between_steps = threading.Event()

    # --- the hot path: runs on vLLM's scheduler thread ---------------------------------------

    def _overflow(self, records: list[Record]) -> None:
        """Records that do not all fit: keep what does, behind a marker for earlier drops; the
        rest is dropped and counted (the scheduler thread never waits)."""
        steps = self._steps
        steps.flush()  # what came before goes first
        room = steps.capacity - (steps.num_buffered - steps.num_drained)
        if steps.unmarked_drops and room > 0:
            steps.chunks.append((1, encode_rows([EventsDropped(
                steps.unmarked_drops, time.time_ns() - self.started_ns)])))
            steps.num_buffered += 1
            steps.unmarked_drops = 0
            room -= 1
        if len(records) > room:
            num_kept = max(room, 0)
            self.num_dropped += len(records) - num_kept
            steps.unmarked_drops += len(records) - num_kept
            if not num_kept:
                return
            records = records[:num_kept]
        steps.chunks.append((len(records), encode_rows(records)))
        steps.num_buffered += len(records)
        steps.num_enqueued += len(records)

    def _enqueue(self, record: Record) -> None:
        self._steps([record])

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Check, patch, and start writing. All or nothing: on a failure, what was done is
        undone (probes disarmed, threads stopped, the trace file removed) and the error raised;
        a ``KvtraceError`` says what to do."""
        from kvtrace.probes import CacheProbes, probe_targets, snapshot

        probe_targets()  # signature check before anything else happens
        # Imported here: not on the scheduler's time.
        self._take_snapshot, self._take_keyframe = snapshot.take, snapshot.take_keyframe
        managers = find_kv_cache_managers()
        config = engine_config_of(*managers[0]) if managers else None
        self.started_ns = time.time_ns()
        header = TraceHeader(
            kvtrace_version=__version__,
            created_ns=self.started_ns,
            source="capture",
            config=config,
            vllm_version=running_vllm_version(),
            pid=os.getpid(),
            host=socket.gethostname(),
            process_title=process_title(),
            cmdline=list(sys.argv),
            includes_hash_bytes=self.options.hash_bytes,
            params={"buffer_capacity": str(self.options.buffer_capacity),
                    "num_kv_cache_managers": str(len(managers)),
                    "variant": engine_variant(managers[0][0]) if managers else "upstream",
                    **running_vllm_build(),
                    **(served_model(managers[0][1]) if managers else {}),
                    **(scheduling(managers[0][1]) if managers and managers[0][1] else {})},
        )
        if self.options.ring_s:
            self._ring = RingFiles(self.options.path, self.started_ns, self.options.ring_s,
                                   self.options.max_bytes)
            header = msgspec.structs.replace(header, params={
                **header.params, "ring_s": f"{self.options.ring_s:g}",
                "keyframe_s": f"{self.options.keyframe_s:g}"})
            trace_file = self._trace_file = self._ring.next_segment()
        else:
            trace_file = self._trace_file = NewTraceFile(self.options.path, self._default_path)
        self._header = header
        try:
            self._writer = self._new_writer(trace_file)
        except OSError as error:
            trace_file.discard()
            trace_file.close()
            raise KvtraceError(f"cannot write the trace {self.options.path}: {error.strerror}",
                               "Pick an -o path the engine process can write to.") from None
        try:
            self._probes = CacheProbes(self._enqueue, HashInterner(), created_ns=self.started_ns,
                                       emit_hash_bytes=self.options.hash_bytes,
                                       sink_many=self._steps)
            self._next_step = NextStep(self._begin)
            self._writer_thread = threading.Thread(target=self._write_loop,
                                                   name="kvtrace-writer", daemon=True)
            self._writer_thread.start()
            self._telemetry = _start_telemetry(self)
            trace_file.publish()
        except BaseException:
            self._undo_start()
            raise

    def _new_writer(self, trace_file: NewTraceFile) -> TraceWriter:
        header = self._header
        if self._ring is not None:
            header = msgspec.structs.replace(header, params={
                **header.params, "segment": str(self._ring.seq)})
        return TraceWriter(trace_file.reopen_path, header, rows=True)

    def _begin(self, manager: Any, scheduler: Any) -> None:
        """At the first step after arming, on the scheduler thread: the start snapshot goes
        first (whatever the buffer's room: it is what the rest means), then the probes arm."""
        with self._stopping_on_failure("the start snapshot"):
            if self._stopped:
                return
            taken = self._take_snapshot(manager, scheduler, self._probes)
            self._hand_over(taken)
            self.snapshot_pause_ns = taken.ended.pause_ns
            self._scheduler_thread = threading.get_ident()
            self._schedule_keyframe()
            self._probes.arm()

    def _keyframe(self, manager: Any, scheduler: Any) -> None:
        """A ring's keyframe, at the start of a step on the scheduler thread (``NextStep``):
        a snapshot that opens the next segment."""
        with self._stopping_on_failure("a keyframe"):
            if self._stopped or not self._probes._armed:
                return
            started = time.perf_counter_ns()
            self._hand_over(self._take_keyframe(manager, scheduler, self._probes))
            pause_ns = time.perf_counter_ns() - started
            self.num_keyframes += 1
            self.max_keyframe_pause_ns = max(self.max_keyframe_pause_ns, pause_ns)

    @contextlib.contextmanager
    def _stopping_on_failure(self, what: str) -> Iterator[None]:
        """Around a snapshot on the scheduler thread: a failure stops the capture with its
        error, never the engine. A stop the engine's own signal handler raised meanwhile
        (SystemExit, KeyboardInterrupt) stops the capture too, and then goes on to vLLM:
        swallowed, the engine would not stop when told."""
        try:
            yield
        except BaseException as error:  # noqa: BLE001 - the engine must never see ours
            self._probes.disarm()
            ours = isinstance(error, Exception)
            self.error = (f"{what} failed: {error!r}" if ours else
                          f"the engine was stopped during {what} ({error!r})")
            self._stop.set()
            if not ours:
                raise

    def _hand_over(self, taken: Any) -> None:
        """A snapshot to the writer thread, after the records before it; the writer thread
        makes its records (``_drain``): the scheduler has waited enough."""
        steps = self._steps
        steps.flush()
        steps.chunks.append((len(taken), taken))
        steps.num_buffered += len(taken)
        steps.num_enqueued += len(taken)

    def _ask_for_keyframe(self) -> None:
        """On the writer thread: have the scheduler take the next keyframe at its next step,
        once one is due (none is asked for once the capture stops). While an idle engine's
        keyframe still waits for its step, no segment opens, so the segments behind the one
        being written are aged out here instead, once a keyframe interval: the ring holds its
        last ``ring_s`` however long the engine idles."""
        if (self._ring is None or self.snapshot_pause_ns is None
                or time.monotonic_ns() < self._keyframe_due_ns):
            return
        with self._keyframe_lock:
            if self._stopped or self.error is not None:
                return
            self._schedule_keyframe()
            idle = self._next_step.pending()
            if not idle:
                self._next_step = NextStep(self._keyframe)
        if idle:
            self._ring.prune()

    def _schedule_keyframe(self) -> None:
        """The next keyframe is due one keyframe interval from now."""
        self._keyframe_due_ns = time.monotonic_ns() + int(self.options.keyframe_s * 1e9)

    def _undo_start(self) -> None:
        """Take back a start that failed part way: nothing patched, running or written."""
        self._stopped = True
        self._shut_down(timeout_s=None)
        self._writer.abandon()
        self._trace_file.discard()
        self._trace_file.close()

    def _write_loop(self) -> None:
        writer = self._writer
        try:
            while not self._stop.is_set():
                # Drain, then always sleep: draining again as soon as anything new arrived
                # would keep this thread competing with the scheduler for the interpreter lock.
                self._drain()
                self._ask_for_keyframe()
                self._stop.wait(WRITER_POLL_S)
            self._steps.flush()  # the probes are disarmed: nothing else hands records over
            while self._drain():
                pass
            writer = self._writer
            steps = self._steps
            if steps.unmarked_drops:  # drops after the last record still get their marker
                writer.write(EventsDropped(steps.unmarked_drops, time.time_ns() - self.started_ns))
                steps.unmarked_drops = 0
            writer.close(num_dropped=self.num_dropped - self._dropped_closed)
        except BaseException as error:  # noqa: BLE001 - the engine must never see it
            writer = self._writer
            self._disarm_probes()  # before the error shows: a status that says so is final
            self.error = f"trace writer failed: {error!r}"
            steps = self._steps
            self.num_dropped += steps.num_buffered - steps.num_drained
            steps.flush()
            steps.chunks.clear()
            try:
                writer.abandon()
            except Exception:  # noqa: BLE001
                pass

    def _drain(self) -> bool:
        """Move everything buffered into the writer; False when there was nothing. The buffer's
        chunks leave it in one slice: producers only append behind them, and each of the two
        list operations is one step under the interpreter lock. A snapshot comes as read
        (``snapshot.Taken``); its records are made and encoded here, and one that finds the
        segment holding its own already (a ring's keyframe) opens the next segment."""
        buffer = self._steps.chunks
        num_chunks = len(buffer)
        if not num_chunks:
            self._writer.flush()
            return False
        chunks = buffer[:num_chunks]
        del buffer[:num_chunks]
        ready: list[tuple[int, bytes]] = []
        for num_records, chunk in chunks:
            if type(chunk) is not bytes:
                if self._segment_taken:
                    self._steps.num_drained += self._writer.write_encoded_rows(ready)
                    ready = []
                    self._next_segment()
                self._segment_taken = True
                chunk = encode_rows(chunk.records())
            ready.append((num_records, chunk))
        self._steps.num_drained += self._writer.write_encoded_rows(ready)
        return True

    def _next_segment(self) -> None:
        """Close the segment being written and open the ring's next one; then remove the
        segments that fell out of the ring."""
        num_dropped = self.num_dropped  # the scheduler thread may add to it meanwhile
        self._writer.close(num_dropped=num_dropped - self._dropped_closed)
        self._dropped_closed = num_dropped
        self._trace_file.close()
        self._bytes_closed += self._trace_file.size()
        self._records_closed += self._writer.num_records
        self._trace_file = self._ring.next_segment()
        self._writer = self._new_writer(self._trace_file)
        self._trace_file.publish()
        self._ring.prune()

    def _disarm_probes(self, wait_s: float = 0.0) -> None:
        """Disarm where the trace holds whole calls only: the probes hand each step's records
        over when the next step starts, so that hand-over disarms them, on the scheduler thread,
        between two steps (``_last_step``); this thread waits for it up to ``wait_s`` and never
        holds the scheduler. Disarmed from here instead (an idle engine, no wait), a step the
        scheduler is in the middle of is dropped and marked, never cut; one it is not in (an
        idle engine's last) is kept."""
        with self._keyframe_lock:
            if self._next_step is not None:
                self._next_step.cancel()
        probes = self._probes
        if probes is None:
            return
        # On the scheduler thread itself (a signal handler there), no step can come meanwhile.
        if wait_s > 0 and probes._armed and threading.get_ident() != self._scheduler_thread:
            probes.sink_many = self._last_step
            if self._disarmed_between_steps.wait(wait_s):
                return
        if self._scheduler_in_a_call():
            probes.sink_many = self._drop_step
        probes.disarm()

    def _last_step(self, records: list[Record]) -> None:
        """The probes' hand-over once a stop asked for it: the last whole step, then disarm."""
        self._steps(records)
        self._probes.disarm()
        self._disarmed_between_steps.set()

    def _drop_step(self, records: list[Record]) -> None:
        self._steps.unmarked_drops += len(records)  # the writer marks them
        self.num_dropped += len(records)

    def _scheduler_in_a_call(self) -> bool:
        """Whether the scheduler thread is inside a probed method (or our code run by one)."""
        from kvtrace.probes import probe_targets

        files = {sys.modules[owner.__module__].__file__ for owner, _, _ in probe_targets()}
        files |= {sys.modules[name].__file__ for name in ("kvtrace.probes.wrappers",
                                                          "kvtrace.probes.cache_probes")}
        frame = sys._current_frames().get(self._scheduler_thread)
        while frame is not None:
            if frame.f_code.co_filename in files:
                return True
            frame = frame.f_back
        return False

    def _shut_down(self, timeout_s: float | None) -> None:
        """Disarm the probes, stop the telemetry, let the writer drain and finish."""
        self._disarm_probes(min(DISARM_WAIT_S, timeout_s or 0.0))
        if self._telemetry is not None:
            self._telemetry.stop()
        self._stop.set()
        if self._writer_thread is not None:
            self._writer_thread.join(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> CaptureStatus:
        """Disarm, drain, close the trace; return the final status."""
        if not self._stopped:
            self._stopped = True
            self._shut_down(timeout_s)
            if self._trace_file is not None:
                self._trace_file.close()
        return self.status()

    def status(self) -> CaptureStatus:
        writer = self._writer
        return CaptureStatus(
            pid=os.getpid(),
            armed=not self._stopped and self.error is None,
            path=self.options.path,
            records=self._steps.num_enqueued,
            written=self._records_closed + (writer.num_records if writer else 0),
            dropped=self.num_dropped,
            buffered=self._steps.num_buffered - self._steps.num_drained,
            probe_failures=self._probes.num_failures if self._probes else 0,
            bytes=self._bytes_closed + (self._trace_file.size() if self._trace_file else 0),
            gpu=self._telemetry.description if self._telemetry else "",
            error=self.error,
            started_ns=self.started_ns,
            snapshot_pause_ns=-1 if self.snapshot_pause_ns is None else self.snapshot_pause_ns,
            num_keyframes=self.num_keyframes,
            max_keyframe_pause_ns=self.max_keyframe_pause_ns,
        )


def _start_telemetry(session: CaptureSession) -> Any:
    from kvtrace.capture.telemetry import GpuSampler

    sampler = GpuSampler(session._enqueue, session.started_ns, session.options.gpu_interval_ms)
    sampler.start()
    return sampler


# --- the process's one capture ------------------------------------------------------------------

_lock = threading.Lock()
_active: CaptureSession | None = None


def active_session() -> CaptureSession | None:
    return _active


def arm(options: CaptureOptions, default_path: bool = False) -> CaptureStatus:
    """Start this process's capture; refuse a second one, and options of the wrong type or
    range (``ControlMessageError`` naming the field). A refused or failed arm changes nothing.
    ``default_path``: see ``CaptureSession``."""
    global _active, last_end
    options = checked_options(options)
    with _lock:
        if _active is not None and _active.status().armed:
            raise AlreadyCapturingError(
                f"pid {os.getpid()} is already capturing to {_active.options.path}")
        session = CaptureSession(options, default_path)
        session.start()
        _active = session
        last_end = ""
        return session.status()


def status() -> CaptureStatus:
    """This process's capture's progress (``path`` None: none runs; then ``error`` says why
    the last one ended on its own, if it did)."""
    session = _active
    if session is not None:
        return session.status()
    return CaptureStatus(pid=os.getpid(), armed=False, error=last_end or None)


def end(session: CaptureSession, reason: str) -> None:
    """End ``session`` if it is still this process's capture: its controller is gone
    (``control.LeaseWatch``). ``reason`` stays in ``last_end`` for a later status."""
    global _active, last_end
    with _lock:
        if _active is not session:
            return
        session.stop()
        _active = None
        last_end = f"the capture to {session.options.path} ended: {reason}"


last_end = ""  # why the last capture ended on its own (its controller went away)


def disarm() -> CaptureStatus:
    """Stop this process's capture (a no-op report if none runs, saying why the last one
    ended on its own, once)."""
    global _active, last_end
    with _lock:
        session = _active
        if session is None:
            ended, last_end = last_end, ""
            return CaptureStatus(pid=os.getpid(), armed=False, error=ended or None)
        final = session.stop()
        _active = None
        return final
