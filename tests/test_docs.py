"""The docs follow the code (docs-as-tests, after sqlite-utils' test_docs.py): every command has
its page in docs/commands/ with every option it takes, every shipped query is documented, the
README stays short, and every figure in the findings and performance pages names the command
that reproduces it."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvtrace.analysis.diagnosis import MECHANISMS
from kvtrace.cli import COMMAND_MODULES, cli

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
COMMANDS = sorted(COMMAND_MODULES.values())
FIGURE_PAGES = ["findings.md", "performance.md"]
HELP = {"-h", "--help"}  # every command has them; docs/README.md says so once


def page(command: str) -> str:
    return (DOCS / "commands" / f"{command}.md").read_text()


def commands_of(name: str) -> list[click.Command]:
    """The command, and each subcommand of a group (`import mooncake`)."""
    command = cli.get_command(click.Context(cli), name)
    if isinstance(command, click.Group):
        return [command, *command.commands.values()]
    return [command]


def option_flags(command: click.Command) -> set[str]:
    """Every flag of every option, as click parses them; ``get_params`` also builds the options
    a command adds on first use (synth's and import's engine flags)."""
    params = command.get_params(click.Context(command))
    return {flag for param in params if isinstance(param, click.Option)
            for flag in param.opts + param.secondary_opts} - HELP


def mentions(text: str, flag: str) -> bool:
    """``--retention`` is not mentioned by ``--retention-interval``."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_page(command):
    text = page(command)
    assert text.startswith(f"# `kvtrace {command}`")
    for section in ("## Synopsis", "## What it does", "## Options", "## Examples", "## Errors"):
        assert section in text, f"docs/commands/{command}.md lacks {section}"
    assert f"(docs/commands/{command}.md)" in README.read_text()
    assert f"(commands/{command}.md)" in (DOCS / "README.md").read_text()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_on_its_commands_page(command):
    text = page(command)
    flags = set().union(*(option_flags(c) for c in commands_of(command)))
    assert flags, "the command's options were not found"
    missing = sorted(flag for flag in flags if not mentions(text, flag))
    assert not missing, f"docs/commands/{command}.md does not mention {missing}"


def test_the_option_walk_sees_lazy_options():
    """Guards the walk above: synth's preset and engine flags exist only once built."""
    flags = option_flags(commands_of("synth")[0])
    assert {"--preset", "-o", "--turns", "--num-gpu-blocks", "--retention-interval"} <= flags
    assert "--help" not in flags


def test_the_global_options_are_in_the_docs_index():
    text = (DOCS / "README.md").read_text()
    missing = sorted(flag for flag in option_flags(cli) if not mentions(text, flag))
    assert not missing, f"docs/README.md does not mention {missing}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command):
    result = CliRunner().invoke(cli, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output


def test_every_shipped_query_is_documented():
    from kvtrace.analysis.queries import shipped_queries

    text = (DOCS / "commands" / "sql.md").read_text()
    for name, query in shipped_queries().items():
        assert f"| `{name}` |" in text, f"the query table lacks {name}"
        section = text.partition(f"### `{name}`\n")[2].partition("\n#")[0]
        assert section, f"docs/commands/sql.md has no section for {name}"
        for documented in [p.name for p in query.params] + query.columns:
            assert f"`{documented}`" in section, f"{name}: `{documented}` is not documented"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    headings = re.findall(r"^#+ (.*)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_links_between_pages_resolve():
    for path in [README, *DOCS.rglob("*.md")]:
        for target, anchor in re.findall(r"\]\(([^)#\s]+)(?:#([^)]*))?\)", path.read_text()):
            if "://" in target:
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.exists(), f"{path}: {target}"
            assert not anchor or anchor in anchors(resolved), f"{path}: {target}#{anchor}"


# --- kvtrace doctor's findings ----------------------------------------------------------------

FINDINGS = DOCS / "doctor"
FINDING_SECTIONS = ("## What it is", "## How kvtrace detects it", "## Public reports",
                    "## What to do", "## Prediction")


def section(text: str, heading: str) -> str:
    """A page's section under ``heading``, its whitespace folded to single spaces."""
    return " ".join(text.partition(f"{heading}\n")[2].partition("\n## ")[0].split())


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=lambda mechanism: mechanism.id)
def test_every_finding_has_its_page(mechanism):
    """A page per finding of `kvtrace doctor`: short, in the same sections, naming the causes
    it comes from, every public report its `reference` names, and the change it replays."""
    text = (FINDINGS / f"{mechanism.id}.md").read_text()
    assert text.startswith(f"# `{mechanism.id}`: {mechanism.name}\n")
    for heading in FINDING_SECTIONS:
        assert f"\n{heading}\n" in text, f"docs/doctor/{mechanism.id}.md lacks {heading}"
    assert 30 <= len(text.splitlines()) <= 60, "a finding's page is 30 to 60 lines"
    detects = section(text, "## How kvtrace detects it")
    for cause in mechanism.causes:
        assert f"`{cause}`" in detects, f"{mechanism.id}: the cause {cause} is not explained"
    public = section(text, "## Public reports")
    for number in re.findall(r"#\d+", mechanism.reference):
        assert number in public, f"{mechanism.id}: {number} is not among its public reports"
    prediction = section(text, "## Prediction")
    change = mechanism.change
    if change is None:
        assert prediction.startswith("None"), f"{mechanism.id}: it has no prediction"
    else:
        assert not prediction.startswith("None"), f"{mechanism.id}: it has a prediction"
        flags = " ".join(change.flags) or ("--num-gpu-blocks" if change.pool_factor else "")
        assert flags in prediction, f"{mechanism.id}: the prediction's {flags} is not named"
    index = (FINDINGS / "README.md").read_text()
    assert f"| [`{mechanism.id}`]({mechanism.id}.md) |" in index
    assert f"(../doctor/{mechanism.id}.md)" in page("doctor")


def test_the_findings_pages_are_the_mechanisms():
    pages = {path.stem for path in FINDINGS.glob("*.md")} - {"README"}
    assert pages == {mechanism.id for mechanism in MECHANISMS}


def test_the_pages_the_diagnosis_names_exist():
    """diagnosis.py's references and docstrings point at docs pages: they must be there."""
    from kvtrace.analysis import diagnosis

    text = Path(diagnosis.__file__).read_text()
    named = set(re.findall(r"docs/[\w/.-]+\.md", text))
    assert named, "diagnosis.py names no docs page"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"diagnosis.py names {missing}"


# --- figures ---------------------------------------------------------------------------------

COMMAND = re.compile(
    r"(?:^|`|\$ |`time )(kvtrace ([a-z]+)|\.venv/bin/python (benchmarks/\w+\.py))")
# A measured quantity: a number with a unit, or a ratio.
FIGURE = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:%|µs|us|ns|ms|s|MiB|GiB|M/s|bytes)(?!\w)|ratio \d")


def named_commands(text: str) -> list[str]:
    """The commands a line names that exist: a kvtrace command, or a benchmark script here."""
    found = []
    for whole, command, script in COMMAND.findall(text):
        if (command and command in COMMANDS) or (script and (ROOT / script).exists()):
            found.append(whole)
    return found


def figure_blocks(name: str):
    """(kind, line number, text) of a page: table rows, fenced blocks, prose lines."""
    lines = (DOCS / name).read_text().splitlines()
    number = 0
    while number < len(lines):
        line = lines[number]
        if line.startswith("```"):
            end = next(i for i in range(number + 1, len(lines)) if lines[i].startswith("```"))
            yield "block", number + 1, "\n".join(lines[number + 1:end])
            number = end + 1
            continue
        if line.startswith("|"):
            start = number
            while number < len(lines) and lines[number].startswith("|"):
                number += 1
            for offset, row in enumerate(lines[start + 2:number]):  # after header, rule
                yield "row", start + 3 + offset, row
            continue
        yield "prose", number + 1, line
        number += 1


@pytest.mark.parametrize("name", FIGURE_PAGES)
def test_every_figure_names_its_command(name):
    """A table row names its command in a cell; a fenced block of output starts with
    `$ command`; prose explains and carries no figures of its own."""
    kinds = set()
    for kind, number, text in figure_blocks(name):
        kinds.add(kind)
        where = f"docs/{name}:{number}"
        if kind == "row":
            assert named_commands(text), f"{where}: a figure row that names no command"
        elif kind == "block" and FIGURE.search(text):
            first = text.splitlines()[0]
            assert first.startswith("$ ") and named_commands(first), \
                f"{where}: output that does not start with `$ command`"
        elif kind == "prose":
            assert not FIGURE.search(text), f"{where}: a figure outside a table: {text!r}"
    assert "row" in kinds


def test_the_figure_check_catches_figures_without_commands():
    """Guards the checks above on made-up lines."""
    assert FIGURE.search("the writer took 35 ns per record")
    assert FIGURE.search("hit rate 74.41%") and FIGURE.search("(ratio 1.087)")
    assert not FIGURE.search("3,993 requests of vLLM 0.33's Mooncake log, PR #56794")
    assert named_commands("| x | `kvtrace replay w.kvtrace -o runs/` |")
    assert named_commands("$ .venv/bin/python benchmarks/traceio.py")
    assert not named_commands("| x | `kvtrace frobnicate` |")
    assert not named_commands("| x | `.venv/bin/python benchmarks/missing.py` |")
