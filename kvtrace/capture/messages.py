"""The control channel's messages: typed requests and replies, one JSON line each way.

``kvtrace capture`` (``cli/capture.py`` via ``attach.py``) sends one request per connection
to the engine's control server (``control.py``), which hands it to the hook (``hook.py``)
and answers with one reply. Both sides decode with the Structs below: a field this kvtrace
does not know, a value of the wrong type or out of range, or an unknown command is refused
with a ``ControlMessageError`` naming it, never dropped or guessed at. An error in the engine
travels as an ``ErrorReply`` naming its class, and the operator side raises that same
``KvtraceError`` subclass (``errors.error_class``).

Runs inside vLLM: stdlib, msgspec, kvtrace's errors and the probes' signature contract (for
its error) only.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from kvtrace.errors import KvtraceError, error_class
from kvtrace.probes.signatures import ProbeSignatureError

DEFAULT_BUFFER_CAPACITY = 1 << 18


class ControlMessageError(KvtraceError):
    """A control message that does not decode to one of the types below."""

    default_hint = ("kvtrace capture and the kvtrace inside the engine must be the same "
                    "version; check both with `kvtrace --version`.")


class AlreadyCapturingError(KvtraceError):
    default_hint = "Stop the running capture first: kvtrace capture --stop PID."


class CaptureOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What the operator asked for: the arm request's options."""

    path: str  # absolute, as the engine process sees it
    hash_bytes: bool = True
    buffer_capacity: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_BUFFER_CAPACITY
    gpu_interval_ms: Annotated[int, msgspec.Meta(ge=0)] = 1000  # 0: no GPU telemetry
    # A flight recorder (``kvtrace capture --ring``): ``path`` is then the ring's directory,
    # the capture is written there in segments, each opening with a keyframe taken every
    # ``keyframe_s``, and the engine removes the segments older than ``ring_s`` (and the oldest
    # while the ring holds more than ``max_bytes``, 0: no cap). 0: one trace file at ``path``.
    ring_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    keyframe_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0


# The KvtraceError subclasses an arm may raise in the engine besides KvtraceError itself; this
# module is imported on both sides, so the operator side knows each of them by name.
ENGINE_ERRORS = (AlreadyCapturingError, ControlMessageError, ProbeSignatureError)


# --- requests: operator -> engine ----------------------------------------------------------------

class Request(msgspec.Struct, tag_field="cmd", forbid_unknown_fields=True, frozen=True):
    pass


class PingRequest(Request, tag="ping"):
    """Is a kvtrace control server here, and which versions does it run."""


# How long an engine keeps capturing without word from its controller (``ArmRequest``).
DEFAULT_LEASE_S = 15.0


class ArmRequest(Request, tag="arm"):
    """Start a capture. The connection it comes on is the controller's *lease*: the engine
    disarms when the controller closes it (or dies, however) or writes nothing on it for
    ``lease_s`` seconds (``control.Lease`` renews it)."""

    options: CaptureOptions
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = DEFAULT_LEASE_S


class StatusRequest(Request, tag="status"):
    pass


class DisarmRequest(Request, tag="disarm"):
    pass


# --- replies: engine -> operator -----------------------------------------------------------------

class Reply(msgspec.Struct, tag_field="reply", forbid_unknown_fields=True, frozen=True):
    pass


class Pong(Reply, tag="pong"):
    pid: int
    kvtrace_version: str
    vllm_version: str
    process_title: str
    capturing: bool
    # The probed vLLM methods kvtrace has replaced right now: [] when only vLLM's code runs.
    patched: list[str] = []


class CaptureStatus(Reply, tag="status"):
    """A capture's progress; ``path`` None: this process is not capturing."""

    pid: int
    armed: bool
    path: str | None = None
    records: int = 0  # handed over by the probes
    written: int = 0  # in the trace file
    dropped: int = 0
    buffered: int = 0
    probe_failures: int = 0
    bytes: int = 0
    gpu: str = ""  # what GPU telemetry does
    error: str | None = None  # why the capture stopped by itself
    started_ns: int = 0
    # How long the start snapshot held the engine's scheduler thread; -1: the engine's next
    # step (which takes it, then arms the probes) has not come yet.
    snapshot_pause_ns: int = -1
    # A ring's keyframes so far, and the longest any held the scheduler thread.
    num_keyframes: int = 0
    max_keyframe_pause_ns: int = 0

    def __getitem__(self, field: str):
        """Mapping access, for callers written against the dict status this replaced
        (``kvtrace demo``, ``benchmarks/capture_overhead.py``)."""
        return getattr(self, field)


class ErrorReply(Reply, tag="error"):
    kind: str  # the KvtraceError subclass's name
    message: str
    hint: str


# The reply each request gets when it does not fail (then it gets an ErrorReply).
REPLY_TYPES: dict[type[Request], type[Reply]] = {
    PingRequest: Pong, ArmRequest: CaptureStatus, StatusRequest: CaptureStatus,
    DisarmRequest: CaptureStatus}

_REQUESTS = msgspec.json.Decoder(Union[PingRequest, ArmRequest, StatusRequest, DisarmRequest])
_REPLIES = msgspec.json.Decoder(Union[Pong, CaptureStatus, ErrorReply])
_ENCODER = msgspec.json.Encoder()


def encode(message: Request | Reply) -> bytes:
    """One line on the socket."""
    return _ENCODER.encode(message) + b"\n"


def decode_request(line: bytes) -> Request:
    return _decode(_REQUESTS, line, "request")


def decode_reply(line: bytes) -> Reply:
    return _decode(_REPLIES, line, "reply")


def _decode(decoder: msgspec.json.Decoder, line: bytes, what: str):
    try:
        return decoder.decode(line)
    except msgspec.DecodeError as error:  # ValidationError included: it names the field
        raise ControlMessageError(f"malformed control {what}: {error}") from None


def checked_options(options: CaptureOptions) -> CaptureOptions:
    """``options`` if every field has its type and range (a Struct built in Python is not
    checked) and they go together; else ``ControlMessageError`` naming the field."""
    try:
        options = msgspec.convert(msgspec.to_builtins(options), CaptureOptions)
    except (msgspec.ValidationError, TypeError) as error:
        raise ControlMessageError(f"bad capture options: {error}") from None
    if options.ring_s and not 0 < options.keyframe_s <= options.ring_s:
        raise ControlMessageError(f"bad capture options: a ring of {options.ring_s:g} s needs "
                                  f"keyframes every 0 < keyframe_s <= ring_s s, not "
                                  f"{options.keyframe_s:g}")
    if options.ring_s and options.hash_bytes:
        # A hash's bytes are written once, at its first sight: a dropped segment would take
        # them with it, and a dump could not say what its ids hash.
        raise ControlMessageError("bad capture options: a ring records hash ids only "
                                  "(hash_bytes must be false)")
    return options


def options_from(fields: CaptureOptions | dict) -> CaptureOptions:
    """Capture options from a Struct or a dict of its fields, checked as on the socket."""
    if isinstance(fields, CaptureOptions):
        return checked_options(fields)
    try:
        return checked_options(msgspec.convert(fields, CaptureOptions))
    except msgspec.ValidationError as error:
        raise ControlMessageError(f"bad capture options: {error}") from None


def error_reply(error: BaseException) -> ErrorReply:
    """What an engine answers when handling a request raised ``error``."""
    if isinstance(error, KvtraceError):
        return ErrorReply(type(error).__name__, str(error), error.hint)
    return ErrorReply(KvtraceError.__name__, f"{type(error).__name__}: {error}",
                      "This is a bug in kvtrace; the engine was not affected. Please report it "
                      "with the engine's log.")


def raise_error(reply: ErrorReply) -> None:
    """Raise, on the operator side, the error the engine raised."""
    raise error_class(reply.kind)(reply.message, hint=reply.hint)
