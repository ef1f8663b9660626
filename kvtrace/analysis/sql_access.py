"""What SQL run against a forensics database may reach: the database, and nothing else.

A database is an input like a trace: one made elsewhere, or crafted, holds views and macros
that run when they are read, and ``kvtrace sql`` runs whatever statement it is given, often as
root on a capture host. So every connection kvtrace opens on an existing database is cut off
from the file system, the network and extensions: DuckDB's ``enable_external_access`` is off
(no ``COPY ... TO``, no ``read_csv('/etc/shadow')``, no ``ATTACH``, no ``INSTALL``/``LOAD``, no
scan of a Python variable), extensions are never installed or loaded on demand, and the
configuration is locked so that no statement can lift any of it. The database file itself is
opened read-only, unless a command adds rows through its own statements (``sweep --db``).

``writable_dirs`` lets DuckDB write below those directories only: ``kvtrace export`` passes its
private scratch directory, where its ``COPY ... TO`` statements go. ``kvtrace sql --unsafe``
opens the database without the limits (docs/security.md).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable

# Every connection ``connect`` opened and not yet freed: what ``interrupt_all`` stops.
_connections: weakref.WeakSet = weakref.WeakSet()
# Settings DuckDB takes only at start-up.
_STARTUP = {"autoload_known_extensions": False, "autoinstall_known_extensions": False,
            "allow_community_extensions": False}


def sql_string(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def sql_identifier(name: str) -> str:
    """``name`` as a quoted SQL identifier (a table or column name, whatever it holds)."""
    return '"' + name.replace('"', '""') + '"'


def connect(path: str, *, read_only: bool = True, unsafe: bool = False,
            writable_dirs: Iterable[str] = ()):
    """A DuckDB connection to the database at ``path`` with the limits above (none if
    ``unsafe``). Raises ``duckdb.Error`` as ``duckdb.connect`` does."""
    import duckdb

    if unsafe:
        connection = duckdb.connect(path, read_only=read_only)
        _connections.add(connection)
        return connection
    connection = duckdb.connect(path, read_only=read_only, config=dict(_STARTUP))
    _connections.add(connection)
    try:
        if _limited_already(connection) and not writable_dirs:
            return connection  # the same database open in this process: its instance is shared
        # allowed_directories can be set only once the database runs, and only while
        # external access is still on: the order matters.
        directories = [os.path.join(os.path.abspath(d), "") for d in writable_dirs]
        if directories:
            connection.execute(f"SET allowed_directories = "
                               f"[{', '.join(map(sql_string, directories))}]")
        connection.execute("SET enable_external_access = false")
        connection.execute("SET lock_configuration = true")
    except BaseException:
        connection.close()
        raise
    return connection


def _limited_already(connection) -> bool:
    """Whether ``connection``'s database instance already has the limits locked in (DuckDB
    shares one instance between the connections a process opens on one file)."""
    locked, external = connection.execute(
        "SELECT current_setting('lock_configuration'), "
        "current_setting('enable_external_access')").fetchone()
    return bool(locked) and not external


def interrupt_all() -> None:
    """Interrupt the query of every connection ``connect`` opened (a stop signal): DuckDB then
    stops at once, rather than let its workers finish the tasks in hand first."""
    for connection in list(_connections):
        with contextlib.suppress(Exception):  # closed already
            connection.interrupt()
