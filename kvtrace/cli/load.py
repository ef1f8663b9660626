"""``kvtrace load``: traces and replay outputs into one DuckDB forensics database, or into
Parquet partitions; a fleet of traces in worker processes or on Ray."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import click


@click.command("load")
@click.argument("traces", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--output", "db_path", type=click.Path(dir_okay=False),
              help="The DuckDB file to create (an existing one is replaced; never a trace).")
@click.option("--parquet", "parquet_dir", type=click.Path(file_okay=False),
              help="Write Parquet partitions, one per run and table, into this new (or empty) "
                   "directory instead of a database.")
@click.option("-j", "--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Traces read at once, each in a worker process of its own (1: in this "
                   "process); with --ray, Ray CPUs of a local instance.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS|auto|local",
              help="Read the traces as Ray tasks: on the cluster at ADDRESS, the one this host "
                   "belongs to (auto), or a private local instance of --workers CPUs (local). "
                   "Needs pip install 'kvtrace[ray]'.")
def command(traces: tuple[str, ...], db_path: str | None, parquet_dir: str | None,
            workers: int, ray_address: str | None) -> None:
    """Load TRACES (trace files, `kvtrace replay` output directories, or directories of
    partitions) into a DuckDB file, or into Parquet partitions.

    One table per record kind, every row tagged with its run, variant, backend, seq and step;
    a `runs` table with each trace's provenance, engine configuration and digest. A trace
    whose content an earlier one already loaded (the same file twice, or a directory and a
    trace in it) is skipped, with a line saying so. Query it with `kvtrace sql` or
    `kvtrace report`.

    A fleet (data-parallel ranks, servers) loads faster in workers (--workers N, or --ray):
    each reads one trace; the database takes their rows in run order. --parquet keeps each
    run's tables as partitions instead; `kvtrace load DIR -o DB` makes a database of them.

    \b
    Example:
        kvtrace load prod.kvtrace runs/ -o prod.duckdb
        kvtrace load fleet/*.kvtrace -o fleet.duckdb --workers 8
        kvtrace load host3/*.kvtrace --parquet parts/host3/ --workers 4
    """
    from kvtrace.analysis.load import load_partitions, load_traces
    from kvtrace.cli.common import terminal_safe, unknown_value_warnings
    from kvtrace.errors import KvtraceError

    if (db_path is None) == (parquet_dir is None):
        raise KvtraceError("give either -o DB or --parquet DIR (one of them)",
                           "kvtrace load TRACE ... -o DB.duckdb, or --parquet DIR.")
    runner = _ray_runner(ray_address, workers) if ray_address is not None else None
    if parquet_dir is not None:
        summary = load_partitions(list(traces), parquet_dir, workers=workers, runner=runner)
    else:
        summary = load_traces(list(traces), db_path, workers=workers, runner=runner)
    for path, same in summary.duplicates:
        click.echo(terminal_safe(f"kvtrace: skipped {path}: the same content as {same}, "
                                 "loaded already"), err=True)
    for run in summary.runs:
        note = "  (truncated: records up to the cut)" if run.truncated else ""
        click.echo(terminal_safe(f"run {run.run}: {run.path}  variant {run.variant}, backend "
                                 f"{run.backend}, {run.num_records} records{note}"))
        for warning in unknown_value_warnings(run.path, run.unknown_values):
            click.echo(terminal_safe(f"kvtrace: warning: {warning}"), err=True)
    where = "" if summary.workers == "this process" else f" ({summary.workers})"
    click.echo(terminal_safe(f"loaded {summary.num_records} records from {len(summary.runs)} "
                             f"trace(s) into {summary.db_path} in {summary.seconds:.1f} s{where}"))


def _ray_runner(address: str, jobs: int) -> RayWorkers:
    return RayWorkers(address, jobs)


class RayWorkers:
    """A part runner (``kvtrace.analysis.load_parts.PartRunner``) whose workers are Ray tasks,
    with ``kvtrace sweep --ray``'s connection (its handling of a stop while Ray starts) and
    shutdown: each trace's bytes travel through Ray's object store and its part comes back
    with the answer, so workers on other hosts share no files with this one. At most as many
    tasks are in flight as the cluster has CPUs, each trace read only as its task goes."""

    def __init__(self, address: str, jobs: int) -> None:
        self.address, self.jobs = address, jobs
        self.description = "a local Ray instance" if address == "local" else f"Ray at {address}"
        self.pending: list = []  # (task, its answer's reference), in task order
        self.started_here = False
        self.done_with_ray = threading.Event()

    def __enter__(self) -> RayWorkers:
        from kvtrace.ray_cluster import connect_to_ray, import_ray

        self.ray = ray = import_ray()
        self.started_here = not ray.is_initialized()
        if not self.started_here:
            self.description = "the connected Ray cluster"
            return self
        try:
            connect_to_ray(ray, self.address, self.jobs, self.done_with_ray)
        except BaseException:
            self._shut_down()
            raise
        return self

    def map(self, tasks: list) -> Iterator:
        from kvtrace.analysis.load_parts import land_part, run_shipped_part

        remote = self.ray.remote(num_cpus=1)(run_shipped_part)
        slots = max(1, int(self.ray.available_resources().get("CPU", self.jobs)))
        queued = iter(tasks)

        def send(task) -> None:
            self.pending.append((task, remote.remote(task, _trace_bytes(task.path))))

        for task in queued:
            send(task)
            if len(self.pending) >= slots:
                break
        while self.pending:
            task, ref = self.pending[0]
            outcome = self.ray.get(ref)
            self.pending.pop(0)
            following = next(queued, None)
            if following is not None:
                send(following)
            yield land_part(task, outcome)

    def stop(self) -> None:
        for _, ref in self.pending:
            with contextlib.suppress(Exception):  # finished already
                self.ray.cancel(ref)
        self.pending = []

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._shut_down()

    def _shut_down(self) -> None:
        from kvtrace.ray_cluster import shut_down_ray

        if self.started_here:  # an instance started here, even half-way, is shut down
            shut_down_ray(self.ray)
            self.done_with_ray.set()
            self.started_here = False


def _trace_bytes(path: str) -> bytes:
    """A trace's bytes, read from one descriptor checked to be a regular file."""
    from kvtrace.traceio import open_trace_file

    with open_trace_file(path) as file:
        return file.read()
