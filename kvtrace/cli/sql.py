"""``kvtrace sql``: ad-hoc SQL or a shipped query against a forensics database."""

from __future__ import annotations

import click


@click.command("sql")
@click.argument("db", required=False, type=click.Path(dir_okay=False))
@click.argument("statement", required=False)
@click.option("-q", "--query", "query_name", help="Run a shipped query by name.")
@click.option("-p", "--param", "params", multiple=True, metavar="K=V",
              help="A parameter of the shipped query (repeatable).")
@click.option("--list", "list_queries", is_flag=True, help="List the shipped queries.")
@click.option("--csv", "output_format", flag_value="csv", help="Print CSV.")
@click.option("--json", "output_format", flag_value="json", help="Print JSON lines.")
@click.option("--unsafe", is_flag=True,
              help="Let the SQL reach files, the network and extensions (COPY, read_csv, "
                   "ATTACH, INSTALL); by default it reaches DB only.")
def command(db, statement, query_name, params, list_queries, output_format, unsafe) -> None:
    """Run STATEMENT, or a shipped query (--query NAME), against the database DB.

    DB is opened read-only, and its SQL reaches nothing else: no file is read or written, no
    extension loaded (docs/security.md). --unsafe lifts that, for a trusted database only:
    the views of a database run with your rights when read.

    \b
    Examples:
        kvtrace sql --list
        kvtrace sql prod.duckdb --query checkpoint_pushouts --param min_hits=5
        kvtrace sql prod.duckdb "SELECT variant, count(*) FROM block_removed GROUP BY ALL" --csv
    """
    from kvtrace.analysis.queries import QueryError, get_query, run_query, execute, shipped_queries
    from kvtrace.analysis.render import format_result, format_query_list

    if list_queries:
        click.echo(format_query_list(shipped_queries().values()))
        return
    if db is None:
        raise QueryError("no database given", hint="kvtrace sql DB \"SELECT ...\" | --query NAME")
    if (statement is None) == (query_name is None):
        raise QueryError("give either a SQL statement or --query NAME (one of them)",
                         hint="kvtrace sql DB \"SELECT ...\", or kvtrace sql DB --query NAME")
    values = {}
    for param in params:
        name, sep, value = param.partition("=")
        if not sep:
            raise QueryError(f"parameter {param!r} is not K=V", hint="e.g. --param min_hits=5")
        values[name.strip()] = value
    if query_name is not None:
        get_query(query_name).bind(values)  # refuse a bad name or parameter before opening DB
    elif values:
        raise QueryError("--param applies to --query only",
                         hint="Write the values into the SQL statement itself.")
    from kvtrace.analysis.database import open_database
    from kvtrace.cli.common import terminal_safe

    connection = open_database(db, unsafe=unsafe)
    try:
        if query_name is not None:
            result = run_query(connection, query_name, values)
        else:
            result = execute(connection, statement)
    except QueryError as error:
        if "disabled by configuration" in str(error) or "disabled through configuration" in str(
                error):
            error.hint = ("kvtrace sql reaches only DB: no file, network or extension. For a "
                          "database you trust, --unsafe lifts that.")
        raise
    finally:
        connection.close()
    text = format_result(result, output_format or "table")
    # The database's strings, shown inert (JSON escapes its controls itself).
    click.echo(text if output_format == "json" else terminal_safe(text), nl=False)
