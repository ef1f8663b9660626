"""``kvtrace capture``: record what a live vLLM engine's prefix cache does."""

from __future__ import annotations

import math
import os
import re
import sys
import time

import click

from kvtrace.attach_methods import METHOD_HELP, METHODS
from kvtrace.errors import KvtraceError

STATUS_INTERVAL_S = 0.5
LAPSE_WAIT_S = 2.0  # for the engine's word that a lease lapsed, once its capture ended
PID = click.IntRange(min=1, max=1 << 22)  # Linux's PID_MAX_LIMIT: no process has another


def parse_duration(text: str | None, option: str = "--duration") -> float | None:
    """``90``, ``90s``, ``10m``, ``1h`` -> seconds (positive: a capture of nothing is refused
    whichever way it is made)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise click.BadParameter(f"{text!r} is not a duration like 30s, 10m or 1h", param_hint=option)
    seconds = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]
    if not 0 < seconds < math.inf:
        raise click.BadParameter(f"{text!r} is not a positive duration", param_hint=option)
    return seconds


_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6,
               "mib": 2**20, "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12,
               "tib": 2**40}


def parse_size(text: str | None, option: str) -> int:
    """``2GiB``, ``500MB``, ``1g`` -> bytes (0: none given)."""
    if text is None:
        return 0
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if unit is None or not 1 <= float(match.group(1)) * unit < 2**63:
        raise click.BadParameter(f"{text!r} is not a size like 500MB or 2GiB", param_hint=option)
    return int(float(match.group(1)) * unit)




@click.command("capture")
@click.option("--pid", type=PID, help="vLLM engine-core pid, or the API-server pid above it.")
@click.option("--method", type=click.Choice(METHODS), default="auto", show_default=True,
              help=METHOD_HELP)
@click.option("--duration", help="Stop after this long (30s, 10m, 1h); default: until Ctrl-C.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Trace file to write.")
@click.option("--no-hash-bytes", is_flag=True, help="Leave hash bytes out (ids only): a trace to share.")
@click.option("--buffer", "buffer_capacity", type=click.IntRange(min=1024), default=1 << 18,
              show_default=True, help="Records the in-engine buffer holds before it drops.")
@click.option("--gpu-interval-ms", type=click.IntRange(min=0), default=1000, show_default=True,
              help="NVML sampling period (0: no GPU telemetry).")
@click.option("--stop", "stop_pid", type=PID, metavar="PID",
              help="Disarm a running capture in PID.")
@click.option("--zmq", "zmq_endpoint", metavar="ENDPOINT",
              help="Record vLLM's own KV events from a ZMQ publisher instead (tcp://HOST:PORT).")
@click.option("--topic", default="", help="With --zmq: the topic to subscribe to.")
@click.option("--bind", is_flag=True,
              help="With --zmq: bind ENDPOINT (when vLLM's publisher connects out, i.e. its "
                   "endpoint has no '*').")
@click.option("--ring", "ring", metavar="DURATION",
              help="Run as a flight recorder: keep only the last DURATION (30m) in --dir, as "
                   "segments that each open with a keyframe; `kvtrace dump` writes a trace "
                   "from it. Records hash ids only.")
@click.option("--dir", "ring_dir", type=click.Path(file_okay=False),
              help="With --ring: the ring's directory (the engine makes it, 0700).")
@click.option("--max-size", metavar="SIZE",
              help="With --ring: never keep more than SIZE (2GiB, 500MB) in the ring.")
@click.option("--keyframe-every", metavar="DURATION",
              help="With --ring: a keyframe (and a new segment) this often; default: a tenth "
                   "of the ring.")
@click.option("--trigger", metavar="CONDITION",
              help="With --ring: write an incident trace by itself when CONDITION holds, e.g. "
                   "'hit_rate < 0.2 for 60s' (figures: hit_rate, checkpoint_share, "
                   "pushouts_per_min).")
@click.option("--keep-around", metavar="DURATION",
              help="With --trigger: the incident holds this long before and after the moment "
                   "it fired; default: half the ring less a keyframe interval, at most 5m.")
@click.option("--incident-dir", type=click.Path(file_okay=False),
              help="With --trigger: where incidents go (made 0700); default: DIR.incidents.")
@click.option("--live-window", metavar="DURATION", default="60s", show_default=True,
              help="The window of the live hit rate and pushouts (--trigger, --metrics-port).")
@click.option("--metrics-port", type=click.IntRange(min=0, max=65535), metavar="PORT",
              help="Serve the live figures for Prometheus on PORT (0: any free port; one more "
                   "per further engine core).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="With --metrics-port: the address to listen on.")
@click.option("--vllm-metrics", metavar="URL",
              help="With -o: record vLLM's own prefix-cache counters from its /metrics (URL) "
                   "beside the trace, for the report to reconcile with the trace's lookups.")
def command(pid, method, duration, output, no_hash_bytes, buffer_capacity, gpu_interval_ms,
            stop_pid, zmq_endpoint, topic, bind, ring, ring_dir, max_size,
            keyframe_every, trigger, keep_around, incident_dir, live_window, metrics_port,
            metrics_host, vllm_metrics) -> None:
    """Capture a live engine's prefix-cache calls and effects into a trace.

    Attaches to the engine core(s) behind --pid (an API-server pid finds its
    VLLM::EngineCore children, one per data-parallel rank), arms kvtrace's probes there and
    shows a live status line until Ctrl-C or --duration; then disarms, restoring every patched
    vLLM function, and prints a summary. With several engine cores, each writes TRACE with its
    rank in the name (prod.dp0.kvtrace, ...).

    A debugger (gdb, lldb) touches an engine only after the same injection left a throw-away
    canary of the engine's interpreter alive and answering; otherwise capture stops with the
    engine untouched. The line "capturing pid ... via M (...)" says which way was used and why.

    \b
    Example:
        kvtrace capture --pid 4242 --duration 10m -o prod.kvtrace
        kvtrace capture --pid 4242 --ring 30m --dir /var/lib/kvtrace/ring --max-size 2GiB
        kvtrace capture --stop 4242
        kvtrace capture --zmq tcp://127.0.0.1:5557 --duration 60s -o events.kvtrace
    """
    chosen = [name for name, value in (("--pid", pid), ("--stop", stop_pid), ("--zmq", zmq_endpoint))
              if value is not None]
    if len(chosen) != 1:
        raise click.UsageError("give exactly one of --pid, --stop or --zmq")
    seconds = parse_duration(duration)
    if stop_pid is not None:
        _stop(stop_pid)
        return
    ring_s = parse_duration(ring, "--ring")
    ring_options = {"--dir": ring_dir, "--max-size": max_size, "--keyframe-every": keyframe_every,
                    "--trigger": trigger}
    if trigger is None and (keep_around or incident_dir):
        raise click.UsageError(f"{'--keep-around' if keep_around else '--incident-dir'} goes "
                               "with --trigger")
    if vllm_metrics is not None and output is None:
        raise click.UsageError("--vllm-metrics records beside an -o trace")
    if ring_s is None:
        given = [name for name, value in ring_options.items() if value is not None]
        if given:
            raise click.UsageError(f"{given[0]} goes with --ring")
        if output is None:
            raise click.UsageError("-o/--output is required")
    elif output is not None or zmq_endpoint is not None:
        raise click.UsageError("--ring writes to --dir: give no -o (and no --zmq)")
    elif ring_dir is None:
        raise click.UsageError("--ring needs --dir")
    if zmq_endpoint is not None:
        _capture_zmq(zmq_endpoint, output, seconds, topic, not no_hash_bytes, bind)
        return
    from kvtrace.capture.messages import CaptureOptions

    if ring_s is None:
        options = CaptureOptions(path=os.path.abspath(output), hash_bytes=not no_hash_bytes,
                                 buffer_capacity=buffer_capacity,
                                 gpu_interval_ms=gpu_interval_ms)
    else:
        keyframe_s = parse_duration(keyframe_every, "--keyframe-every") or ring_s / 10
        if keyframe_s > ring_s:
            raise click.BadParameter("a keyframe must come within the ring's length",
                                     param_hint="--keyframe-every")
        options = CaptureOptions(path=os.path.abspath(ring_dir), hash_bytes=False,
                                 buffer_capacity=buffer_capacity,
                                 gpu_interval_ms=gpu_interval_ms, ring_s=ring_s,
                                 keyframe_s=keyframe_s,
                                 max_bytes=parse_size(max_size, "--max-size"))
    alongside = None
    if trigger is not None or metrics_port is not None or vllm_metrics is not None:
        from kvtrace.cli.recorder import Alongside

        alongside = Alongside(
            trigger=trigger, keep_s=_keep_around(keep_around, options),
            incident_dir=os.path.abspath(incident_dir or f"{options.path}.incidents"),
            window_s=parse_duration(live_window, "--live-window"), metrics_host=metrics_host,
            metrics_port=metrics_port, vllm_metrics=vllm_metrics)
    _capture_pid(pid, method, options, seconds, alongside)


def _keep_around(text: str | None, options) -> float:
    """How long an incident holds before and after its trigger fired: both must still be in
    the ring when it is written, a keyframe interval included."""
    if not options.ring_s:
        return 0.0
    most = (options.ring_s - options.keyframe_s) / 2
    keep_s = parse_duration(text, "--keep-around") if text else min(300.0, most)
    if keep_s > most:
        raise click.BadParameter(f"an incident of {keep_s:g} s before and after does not fit "
                                 f"in the ring: at most {most:g} s", param_hint="--keep-around")
    return keep_s


def _log(message: str) -> None:
    from kvtrace.cli import verbosity

    if verbosity() >= 1 and message.strip():
        click.echo(message.rstrip(), err=True)


def _output_path(options, target, num_targets: int) -> str:
    """Each engine core's trace (or ring directory), its rank in the name when there are
    several."""
    path = options.path
    if num_targets == 1:
        return path
    if options.ring_s:
        return f"{path}.{target.rank_suffix or target.pid}"
    stem, ext = os.path.splitext(path)
    return f"{stem}.{target.rank_suffix or target.pid}{ext or '.kvtrace'}"


def _capture_pid(pid: int, method: str, options, seconds: float | None, alongside=None) -> None:
    import msgspec

    from kvtrace.capture import attach
    from kvtrace.cli import Terminated

    targets = attach.find_engine_cores(pid)
    sessions: list[tuple] = []  # (target, trace path) of each armed engine core
    leases = {}  # pid -> lease: while we hold them, the engines capture; our end ends theirs
    terminated = None
    try:
        if alongside is not None:
            alongside.start_counters(options.path)
        for target in targets:
            way_in = attach.ensure_hook(target, method, _log)
            path = _output_path(options, target, len(targets))
            leases[target.pid] = attach.arm(target, msgspec.structs.replace(options, path=path))
            sessions.append((target, path))
            click.echo(f"kvtrace: capturing pid {target.pid} ({target.title}) via {way_in} "
                       f"-> {path}", err=True)
            if alongside is not None:
                alongside.start(target, path, ring=bool(options.ring_s))
        _watch(sessions, seconds, leases, alongside)
    except Terminated as signal_:  # SIGTERM or SIGHUP: stop as for Ctrl-C, then say so
        terminated = signal_
    finally:
        # Whatever happened (Ctrl-C included), no engine is left armed by us.
        try:
            finals, died = _disarm_all(sessions, leases)
        finally:
            for lease in leases.values():
                lease.close()
            if alongside is not None:
                alongside.close()
    for target, path in sessions:
        final = finals.get(target.pid)
        if final is not None and final.path is not None:
            _print_summary(target, path, final)
        elif final is not None:
            click.echo(f"kvtrace: pid {target.pid}: the capture was stopped from elsewhere "
                       f"({final.error or 'kvtrace capture --stop'}) -> {path}")
    if died:
        _raise_died(died)
    lapsed = [(target, leases[target.pid]) for target, _ in sessions if leases[target.pid].lapsed()]
    if lapsed:
        _raise_lapsed(*lapsed[0])
    if terminated is not None:
        raise terminated


def _watch(sessions, seconds: float | None, leases: dict, alongside=None) -> None:
    """Show a status line until Ctrl-C, the duration, the death of a target or the end of a
    capture its engine ended as our lease lapsed; SIGTERM and SIGHUP (``Terminated``) go to the
    caller, which stops the same way and then says so."""
    from kvtrace.capture import attach
    from kvtrace.cli import Terminated

    started = previous_time = time.monotonic()
    previous_records = 0
    interactive = sys.stderr.isatty()
    try:
        while seconds is None or time.monotonic() - started < seconds:
            time.sleep(STATUS_INTERVAL_S)
            if not all(attach.is_alive(target.pid) for target, _ in sessions):
                return
            statuses = [attach.status(target) for target, _ in sessions]
            if any(_lapsed(status, leases[target.pid])
                   for (target, _), status in zip(sessions, statuses)):
                return  # the caller prints what was captured, then why it ended
            errors = [s.error for s in statuses if s.error]
            if errors:
                raise KvtraceError(f"the capture stopped inside the engine: {errors[0]}",
                                   "The engine was not affected; check the disk and the -o path.")
            if not all(s.armed for s in statuses):
                return  # `kvtrace capture --stop` from another shell
            if alongside is not None:
                alongside.tick()
            records = sum(s.records for s in statuses)
            now = time.monotonic()
            rate = (records - previous_records) / max(now - previous_time, 1e-9)
            previous_records, previous_time = records, now
            if interactive:
                click.echo(f"\r{now - started:7.1f}s  {records:>12,} records  {rate:>10,.0f}/s  "
                           f"dropped {sum(s.dropped for s in statuses):,}  "
                           f"{sum(s.bytes for s in statuses) / 2**20:8.1f} MiB", err=True,
                           nl=False)
    except Terminated:
        raise
    except KeyboardInterrupt:
        pass
    except KvtraceError:
        if all(_still_alive(target.pid) for target, _ in sessions):
            raise  # a target that died mid-request is reported by the caller instead
    finally:
        if interactive:
            click.echo("", err=True)


def _disarm_all(sessions, leases: dict) -> tuple[dict, list[tuple]]:
    """Disarm every armed target; (final status per pid, the (target, path) pairs that died).
    A capture its engine ended as the lease lapsed has the final status the engine sent then."""
    from kvtrace.capture import attach

    finals, died = {}, []
    for target, path in sessions:
        try:
            final = attach.disarm(target)
            finals[target.pid] = _lapsed(final, leases[target.pid]) or final
        except KvtraceError:
            if _still_alive(target.pid):
                raise
            died.append((target, path))
    return finals, died


def _lapsed(status, lease):
    """The final status of the capture ``status`` (its engine's) reports ended on its own, if
    the engine ended it because ``lease`` lapsed; else None."""
    return lease.lapsed(LAPSE_WAIT_S) if status.path is None and status.error else None


def _raise_lapsed(target, lease) -> None:
    raise KvtraceError(
        f"pid {target.pid} stopped capturing because kvtrace capture did not renew its lease for "
        f"{lease.lease_s:g} s (it was stopped or starved of CPU); the trace is valid up to there",
        "Do not suspend kvtrace capture while it runs (Ctrl-Z, SIGSTOP, a debugger), and check "
        "the host's load; capture again for more.")


def _still_alive(pid: int, grace_s: float = 2.0) -> bool:
    """Whether ``pid`` lives on; a killed process's socket closes before it is gone."""
    from kvtrace.capture import attach

    deadline = time.monotonic() + grace_s
    while attach.is_alive(pid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


def _print_summary(target, path: str, final) -> None:
    click.echo(f"kvtrace: pid {target.pid}: {final.written:,} records written, "
               f"{final.dropped:,} dropped, {final.bytes / 2**20:.1f} MiB -> {path}")
    if final.num_keyframes:
        click.echo(f"kvtrace: pid {target.pid}: {final.num_keyframes} keyframes after the "
                   f"first, each holding its scheduler {final.max_keyframe_pause_ns / 1e6:.1f} "
                   "ms at most")
    if final.snapshot_pause_ns >= 0:
        click.echo(f"kvtrace: pid {target.pid}: the start snapshot held its scheduler "
                   f"{final.snapshot_pause_ns / 1e6:.1f} ms")
    else:
        click.echo(f"kvtrace: pid {target.pid}: no scheduler step came while armed: nothing "
                   "was captured")
    if final.gpu:
        click.echo(f"kvtrace: pid {target.pid}: {final.gpu}")


def _raise_died(died) -> None:
    from kvtrace.traceio import TraceReader

    target, path = died[0]
    try:
        reader = TraceReader(path)
        recovered = sum(len(batch) for batch in reader.batches())
        held = f"{path} holds the {recovered:,} records written before it died"
    except KvtraceError as error:
        held = f"nothing could be recovered from {path} ({error})"
    raise KvtraceError(f"target pid {target.pid} died during the capture; {held}",
                       "The trace is usable up to the cut (kvtrace info shows it as truncated).")


def _stop(pid: int) -> None:
    from kvtrace.capture import attach

    for target in attach.find_engine_cores(pid):
        final = attach.disarm(target)
        if final.path is None:
            click.echo(f"kvtrace: pid {target.pid} was not capturing")
            continue
        _print_summary(target, final.path, final)


def _capture_zmq(endpoint: str, output: str, seconds: float | None, topic: str, hash_bytes: bool,
                 bind: bool) -> None:
    from kvtrace.capture.zmq_source import capture_zmq

    click.echo(f"kvtrace: {'listening on' if bind else 'subscribing to'} vLLM KV events at "
               f"{endpoint} -> {output} (this source has no request ids, block ids or removal "
               "reasons)", err=True)
    stats = capture_zmq(endpoint, output, duration_s=seconds, topic=topic, hash_bytes=hash_bytes,
                        bind=bind)
    click.echo(f"kvtrace: {stats.batches:,} batches, {stats.records:,} records "
               f"({stats.stores:,} stores, {stats.removals:,} removals), "
               f"{stats.dropped_batches:,} batches dropped -> {output}")
    if stats.batches == 0:
        click.echo("kvtrace: warning: no KV events arrived; check the endpoint, the topic and "
                   "that vLLM runs with --kv-events-config enable_kv_cache_events", err=True)
