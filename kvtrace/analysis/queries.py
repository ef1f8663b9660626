"""The shipped forensics queries (``kvtrace/sql/*.sql``) and running SQL against a database.

Each ``.sql`` file starts with a comment header::

    -- name: checkpoint_pushouts
    -- summary: one line
    -- param: min_hits INTEGER = 2 -- what it means
    -- returns:
    --   column: what it holds
    -- free text: definitions of what is counted

Parameters are DuckDB named parameters (``$min_hits``); a query receives exactly the ones its
header declares, with the header's defaults unless given.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from importlib import resources

from kvtrace.errors import KvtraceError

_PARAM = re.compile(r"^(\w+)\s+(INTEGER|DOUBLE|VARCHAR)\s*=\s*(\S+)\s*(?:--\s*(.*))?$")
_COLUMN = re.compile(r"^\s{2,}(\w+):\s*(.*)$")
_PARAM_USE = re.compile(r"\$(\w+)")


class QueryError(KvtraceError):
    """An unknown query, a bad parameter, or SQL that DuckDB rejected."""

    default_hint = "`kvtrace sql --list` shows the shipped queries and their parameters."


@dataclass(frozen=True)
class Param:
    name: str
    sql_type: str
    default: str
    description: str

    def convert(self, text: str):
        """The parameter's value from its command-line text, checked against its type."""
        try:
            if self.sql_type == "INTEGER":
                return int(text)
            if self.sql_type == "DOUBLE":
                return float(text)
        except ValueError:
            raise QueryError(
                f"parameter {self.name} must be {self.sql_type}, got {text!r}",
                hint=f"{self.name}: {self.description}",
            ) from None
        return text


@dataclass(frozen=True)
class Query:
    name: str
    summary: str
    sql: str
    params: tuple[Param, ...] = ()
    returns: tuple[tuple[str, str], ...] = ()
    notes: str = ""

    @property
    def columns(self) -> list[str]:
        return [name for name, _ in self.returns]

    def bind(self, values: dict[str, str]) -> dict[str, object]:
        """Header defaults overridden by ``values``; unknown names are refused."""
        declared = {p.name: p for p in self.params}
        unknown = sorted(set(values) - set(declared))
        if unknown:
            raise QueryError(
                f"query {self.name} has no parameter {unknown[0]!r}",
                hint=f"Its parameters: {', '.join(declared) or 'none'}.",
            )
        return {name: p.convert(values.get(name, p.default)) for name, p in declared.items()}


def parse_query(name: str, text: str) -> Query:
    """Read a query's header; the header must name the file and declare every ``$param``."""
    header: dict[str, str] = {}
    params: list[Param] = []
    returns: list[tuple[str, str]] = []
    notes: list[str] = []
    in_returns = False
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        body = line[2:]
        key, _, value = body.strip().partition(":")
        if in_returns and (column := _COLUMN.match(body)):
            returns.append(column.groups())
            continue
        in_returns = False
        if key in ("name", "summary"):
            header[key] = value.strip()
        elif key == "param":
            match = _PARAM.match(value.strip())
            if not match:
                raise ValueError(f"{name}.sql: bad param line {line!r}")
            params.append(Param(*match.groups(default="")))
        elif key == "returns":
            in_returns = True
        else:
            notes.append(body.strip())
    if header.get("name") != name:
        raise ValueError(f"{name}.sql: header names it {header.get('name')!r}")
    used = set(_PARAM_USE.findall(text))
    declared = {p.name for p in params}
    if used != declared:
        raise ValueError(f"{name}.sql: uses {sorted(used)} but declares {sorted(declared)}")
    return Query(name, header.get("summary", ""), text, tuple(params), tuple(returns),
                 " ".join(notes).strip())


def shipped_queries() -> dict[str, Query]:
    """Every ``.sql`` file shipped in ``kvtrace.sql``, by name."""
    queries = {}
    for entry in sorted(resources.files("kvtrace.sql").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            name = entry.name[: -len(".sql")]
            queries[name] = parse_query(name, entry.read_text(encoding="utf-8"))
    return queries


def get_query(name: str) -> Query:
    queries = shipped_queries()
    if name not in queries:
        raise QueryError(f"no shipped query named {name!r}",
                         hint=f"Shipped queries: {', '.join(queries)}.")
    return queries[name]


@dataclass
class Result:
    columns: list[str]
    rows: list[tuple] = field(default_factory=list)


def execute(connection, sql: str, params: dict[str, object] | None = None) -> Result:
    """Run one SQL statement; DuckDB's complaints become a ``QueryError`` of one line."""
    import duckdb

    if not sql.strip():
        raise QueryError("the SQL statement is empty", hint='kvtrace sql DB "SELECT ..."')
    try:
        cursor = connection.execute(sql, params or {})
        columns = [d[0] for d in cursor.description] if cursor and cursor.description else []
        return Result(columns, cursor.fetchall() if columns else [])
    except duckdb.Error as error:
        first_line = str(error).strip().splitlines()[0]
        raise QueryError(f"SQL error: {first_line}",
                         hint="Tables: `kvtrace sql DB \"SHOW TABLES\"`; "
                         "shipped queries: `kvtrace sql --list`.") from None


def run_query(connection, name: str, values: dict[str, str] | None = None) -> Result:
    query = get_query(name)
    return execute(connection, query.sql, query.bind(values or {}))


def sql_command(db: str, query: str, values: dict[str, str] | None = None) -> str:
    """The ``kvtrace sql`` command that reproduces a figure."""
    params = "".join(f" --param {k}={v}" for k, v in (values or {}).items())
    return f"kvtrace sql {shlex.quote(db)} --query {query}{params}"
