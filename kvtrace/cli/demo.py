"""``kvtrace demo``: the whole forensics loop on a bundled workload, in one command."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

# The seed scenario of #56794 (the `documents` preset: hot system prompts in front of long
# unique documents, each prefilled in several 8,192-token chunks, so every document leaves
# mid-prompt checkpoints behind) on Nemotron-H-8B's cache as vLLM 0.33 builds it: six Mamba2
# groups, so every checkpoint holds six blocks, and the pushout shows (docs/findings.md).
DEMO_PRESET = "documents"
DEMO_MODEL = "nemotron-h-8b"
# A pool the engine fills in its first seconds, so the capture sees a cache under pressure, as
# a busy engine's is: the preset's default (a share of the whole workload's blocks, about 2,000)
# was not full before the capture's window ended, so it saw no eviction at all. With 400, the
# requests in flight hold most of it and every capture evicts by LRU reuse.
DEMO_POOL_BLOCKS = 400
# Production is mid-flight: the engine serves in accelerated real time, the capture arms this
# long after the workload started, while requests run, and stops this long after (the shorter
# with --quick), while they still run: the requests arrive over 13 s of wall time, and their
# answers are 2048 tokens long (the preset's are 256), so the engine is never without a request in
# flight after its first seconds and the capture's window cannot end in a gap (with the preset's
# answers it was idle two fifths of the time; a 2-core host runs such steps late, which only
# makes the window cover less of the workload).
DEMO_REQUESTS = 400
BUSY_ENGINE = {"output_len": 2048}
DEMO_SPEED = 30
ARM_AFTER_S = 3.0
CAPTURE_S = {"full": 5.0, "quick": 3.0}


class Stages:
    """Numbered stage lines with their duration: "[3/8] Capturing ... done (2.1 s)"."""

    def __init__(self, total: int) -> None:
        self.total, self.number, self.started = total, 0, 0.0

    def start(self, title: str) -> None:
        self.number += 1
        self.started = time.monotonic()
        click.echo(click.style(f"[{self.number}/{self.total}] ", bold=True) + title + " ...", err=True)

    def done(self, detail: str = "") -> None:
        elapsed = time.monotonic() - self.started
        click.echo(f"      {detail + ' ' if detail else ''}({elapsed:.1f} s)", err=True)


@click.command("demo")
@click.option("--workdir", type=click.Path(file_okay=False), default="kvtrace-demo",
              show_default=True, help="Where the workload, traces, database and report go.")
@click.option("--quick", is_flag=True, help="A shorter capture (3 s, not 5 s); the tests run it.")
def command(workdir: str, quick: bool) -> None:
    """Run the whole forensics loop on a synthetic hybrid workload.

    Generates the #56794 seed scenario (hot system prompts, long documents prefilled in
    several chunks) for Nemotron-H-8B's cache as vLLM 0.33 builds it (six Mamba2 groups),
    under memory pressure at retention 0;
    starts `kvtrace engine` serving it with the unfixed (pre-#56794) checkpoint logic on the
    real vLLM 0.33 cache; attaches `kvtrace capture --pid` while requests are running, as
    production is, and stops it while they still are; replays the capture in lockstep from
    its start snapshot (fidelity) and rescheduled under unfixed and fixed; loads everything
    into DuckDB; prints the report and writes it as HTML. The engine is stopped whatever
    happens.

    \b
    Example:
        kvtrace demo
        kvtrace demo --quick --workdir /tmp/kvtrace-demo
    """
    from kvtrace.analysis.load import load_traces
    from kvtrace.analysis.report import report_database
    from kvtrace.errors import KvtraceError
    from kvtrace.engine.process import EngineProcess
    from kvtrace.replay.options import ReplayOptions
    from kvtrace.replay.run import replay
    from kvtrace.vllm_release_table import PROJECT_RELEASE
    from kvtrace.workloads.workload import EngineShape, write_workload
    from kvtrace.workloads.synth import synthesize

    work = Path(workdir).resolve()
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KvtraceError(f"cannot create the work directory {work}: {error.strerror}",
                           "Pass a writable --workdir.") from None
    num_requests, capture_s = DEMO_REQUESTS, CAPTURE_S["quick" if quick else "full"]
    workload, capture = work / "workload.kvtrace", work / "capture.kvtrace"
    database, html = work / "demo.duckdb", work / "report.html"
    stages = Stages(7)

    shape = EngineShape(model=DEMO_MODEL, num_gpu_blocks=DEMO_POOL_BLOCKS)
    geometry = shape.geometry
    stages.start(f"Generating the #56794 seed scenario ({DEMO_PRESET}: {num_requests} requests, "
                 f"retention 0) for {shape.model}'s cache as vLLM 0.33 builds it: "
                 f"{len(geometry.groups)} KV-cache groups, {geometry.block_size}-token blocks")
    header = write_workload(workload, synthesize(DEMO_PRESET, num_requests, 0,
                                                 shape.hash_block_size, BUSY_ENGINE),
                            shape, cmdline=["kvtrace", "demo"])
    stages.done(f"{workload}, a pool of {header.config.num_gpu_blocks} blocks")

    engine = EngineProcess(
        [str(workload), "--variant", "unfixed", "--speed", str(DEMO_SPEED)],
        {**os.environ, "KVTRACE_PLUGIN": "1"}, cwd=str(work))
    try:
        stages.start(f"Starting `kvtrace engine` (vLLM {PROJECT_RELEASE.version}'s scheduler "
                     "and cache, unfixed checkpoint logic)")
        pid = engine.wait_ready()
        stages.done(f"pid {pid}, process title VLLM::EngineCore")

        stages.start(f"Serving the workload ({DEMO_SPEED}x real time); `kvtrace capture --pid "
                     f"{pid}` attaches after {ARM_AFTER_S:g} s, mid-flight, for "
                     f"{capture_s:g} s")
        records = _capture(pid, capture, engine, capture_s)
        armed, stopped = _in_flight(capture)
        stages.done(f"{records:,} records -> {capture}; {armed} requests in flight when it "
                    f"armed, {stopped} when it stopped")
    finally:
        engine.stop(grace_s=10)

    stages.start("Replaying the capture in lockstep against the real vLLM cache, rebuilt "
                 "from its start snapshot (fidelity)")
    fidelity = replay(ReplayOptions(source=str(capture), outdir=str(work / "fidelity"),
                                    lockstep=True, verify=True)).fidelity
    if fidelity.matched != fidelity.total:
        raise KvtraceError(f"the capture did not replay faithfully: {fidelity.matched}/"
                           f"{fidelity.total} effects matched; first divergence "
                           f"{fidelity.first_divergence}", "Please report this as a kvtrace bug.")
    stages.done(f"{fidelity.matched:,}/{fidelity.total:,} effect records match (100%)")

    stages.start("Replaying the capture under unfixed and fixed from its snapshot "
                 "(equal scheduling)")
    result = replay(ReplayOptions(source=str(capture), outdir=str(work / "runs"),
                                  variants=("unfixed", "fixed")))
    rates = ", ".join(f"{v.variant} {v.summary['hit_rate'] * 100:.2f}%" for v in result.variants)
    stages.done(f"hit rates: {rates}")

    stages.start("Loading the capture and the replays into DuckDB")
    loaded = load_traces([capture, *(v.output for v in result.variants)], database)
    stages.done(f"{loaded.num_records:,} records -> {database}")

    stages.start("Writing the report")
    text = report_database(str(database), str(html))
    stages.done(str(html))
    click.echo(text, nl=False)
    _next_steps(work, capture, database, html)


def _capture(pid: int, path: Path, engine, capture_s: float) -> int:
    """Start the workload, attach to the engine while it serves, capture for a while, disarm
    while it still serves; the number of records written."""
    from kvtrace.capture import attach
    from kvtrace.errors import KvtraceError

    (target,) = attach.find_engine_cores(pid)
    attach.ensure_hook(target, "auto", lambda message: None)
    engine.send("start")
    engine.expect("kvtrace engine: running")
    time.sleep(ARM_AFTER_S)
    with attach.arm(target, {"path": str(path), "gpu_interval_ms": 0}):
        try:
            time.sleep(capture_s)
        finally:
            final = attach.disarm(target)
    if final.error:
        raise KvtraceError(f"the capture stopped inside the engine: {final.error}",
                           "Please report this as a kvtrace bug.")
    return final.written


def _in_flight(capture: Path) -> tuple[int, int]:
    """The requests the engine was serving when the capture armed (its start snapshot's) and
    when it stopped (those, and the ones that arrived since, less the ones that finished)."""
    from kvtrace.traceio import count_kinds

    counts = count_kinds(capture)
    armed = counts["request_state"]
    return armed, armed + counts["request_arrived"] - counts["request_finished"]


def _next_steps(work: Path, capture: Path, database: Path, html: Path) -> None:
    relative = {p: os.path.relpath(p) for p in (work, capture, database, html)}
    click.echo(f"""
Everything is in {relative[work]}/:
  {relative[capture]:<40} the capture of the live engine (kvtrace info / cat)
  {relative[database]:<40} all traces in DuckDB
  {relative[html]:<40} the HTML report (open it in a browser)

Next:
  kvtrace sql {relative[database]} --query checkpoint_pushouts
  kvtrace sql {relative[database]} --query lost_hits_by_prefix
  kvtrace sql {relative[database]} "SELECT variant, reason, count(*) FROM block_removed GROUP BY ALL"
  kvtrace report {relative[database]} --html report.html
  kvtrace replay {relative[capture]} --variant fixed --variant naive -o runs/""")
