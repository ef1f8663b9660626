"""The README documents every command (docs-as-tests, after sqlite-utils' test_docs.py)."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtrace.cli import COMMAND_MODULES, cli

README = (Path(__file__).parent.parent / "README.md").read_text()


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES.values()))
def test_every_command_has_a_readme_section(command):
    assert f"### `kvtrace {command}" in README


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES.values()))
def test_every_command_has_help_with_an_example(command):
    result = CliRunner().invoke(cli, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output


def test_every_shipped_query_is_documented():
    from kvtrace.analysis.queries import shipped_queries

    for name in shipped_queries():
        assert f"| `{name}` |" in README, f"README lacks the query {name}"
