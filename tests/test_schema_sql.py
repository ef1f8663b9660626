"""The database's own SQL (kvtrace/sql/schema/): package data beside the shipped queries but
none of them, its comment headers dropped and every placeholder of its templates filled."""

from __future__ import annotations

import re
from importlib import resources

from kvtrace.analysis import database
from kvtrace.analysis.queries import shipped_queries

PLACEHOLDER = re.compile(r"\{\w+\}")


def schema_names() -> set[str]:
    root = resources.files("kvtrace.sql").joinpath("schema")
    return {entry.name.removesuffix(".sql")
            for folder in (root, root / "views", root / "macros") for entry in folder.iterdir()}


def test_the_schema_sql_is_package_data_and_no_query():
    assert {"runs", "cache_entries", "lookups", "run_hours"} <= schema_names()
    assert not schema_names() & set(shipped_queries())


def test_the_schema_sql_is_filled_in_and_without_its_headers():
    texts = [*database.VIEWS.values(), *database.MACROS, database.CACHE_ENTRIES_SQL,
             *database.schema_statements()]
    assert not [text for text in texts if PLACEHOLDER.search(text)]
    assert not [text for text in texts if text.lstrip().startswith("--")]
    assert len(database.MACROS) == len(list(
        resources.files("kvtrace.sql").joinpath("schema", "macros").iterdir()))
