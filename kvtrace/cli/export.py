"""``kvtrace export``: a forensics database as Parquet, to analyse off the capturing host."""

from __future__ import annotations

import click


@click.command("export")
@click.argument("db", type=click.Path(dir_okay=False))
@click.option("--parquet", "outdir", required=True, type=click.Path(file_okay=False),
              help="Directory to write (new or empty; see --overwrite).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --parquet directory.")
def command(db: str, outdir: str, overwrite: bool) -> None:
    """Write every table of DB as Parquet files, partitioned by run.

    One directory per table, hive-style (block_stored/run=0/data_0.parquet ...; sweeps by
    sweep_id), readable by DuckDB, Spark or Trino; _kvtrace_export.json lists the tables,
    their columns and row counts. The directory appears only once complete.

    \b
    Example:
        kvtrace export prod.duckdb --parquet exports/host=gpu17/
        duckdb -c "SELECT run, count(*) FROM read_parquet(
            'exports/*/block_stored/*/*.parquet', hive_partitioning = true) GROUP BY ALL"
    """
    from kvtrace.analysis.export import export_parquet

    summary = export_parquet(db, outdir, overwrite=overwrite)
    rows = sum(table.num_rows for table in summary.tables)
    click.echo(f"exported {len(summary.tables)} tables, {rows:,} rows from {db} to {outdir} "
               f"in {summary.seconds:.1f} s")
