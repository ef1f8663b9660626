"""Adding a vLLM release is one row in ``kvtrace/vllm_release_table.py``, plus its signature
table where its wrapped methods or attributes differ (``probes/signatures.py``, ``SINCE``)
(issue #33). A fake 0.33.1 is added to a copy of the package, as that diff, and every reader
picks it up: the probes' lookup, the variants, ``kvtrace vllm`` and ``scripts/bootstrap``."""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.vllm_release_table import SUPPORTED_VLLM_VERSIONS

REPO = Path(__file__).parent.parent
TABLE = "kvtrace/vllm_release_table.py"
SIGNATURES = "kvtrace/probes/signatures.py"
NEW_ROW = '    Release("0.33.1", 337, "prefill_end reservation, generalised gate"),\n'
# A release that adds an attribute kvtrace reads says so in SINCE (a parameter: in
# EXPECTED_SIGNATURES too); one that adds nothing touches signatures.py not at all.
NEW_SINCE = '    "BlockPool.fake_attribute": "0.33.1",\n'
# The lines the two are added after: the table's last row, SINCE's last entry.
LAST_ROW = re.compile(r'(?s).*\n    Release\("[^\n]*\n(?=\))')
LAST_SINCE = re.compile(r'(?s).*\nSINCE: dict\[str, str\] = \{\n.*?\n(?=\}\n)')

# What every reader says once the row is there, run in the copy (a process of its own: each
# reader reads the table when it is imported).
READERS = r"""
import json
import sys
from click.testing import CliRunner
from kvtrace.cli import cli
from kvtrace.probes import signatures
from kvtrace.probes.signatures import ProbeSignatureError
from kvtrace.replay.variants import VARIANTS
from kvtrace.vllm_releases import plan

try:
    signatures.check_supported("0.34.0")
except ProbeSignatureError as error:
    refused = str(error)
upstream = VARIANTS["upstream"]
print(json.dumps({
    "supported": signatures.SUPPORTED_VLLM_VERSIONS,
    "signatures": signatures.expected_signatures("0.33.1") == signatures.EXPECTED_SIGNATURES,
    "has": [signatures.release_has("BlockPool.fake_attribute", v) for v in (sys.argv[1], "0.33.1")],
    "refused": refused,
    "variant": [VARIANTS["vllm-0.33.1"].release, VARIANTS["vllm-0.33.1"].summary],
    "upstream": [upstream.summary, upstream.role],
    "plan": plan("0.33.1"),
    "list": CliRunner().invoke(cli, ["vllm", "list"]).output.splitlines(),
    "help": CliRunner().invoke(cli, ["vllm", "--help"]).output,
    "all": CliRunner().invoke(cli, ["vllm", "install", "--all", "--dry-run"]).output.splitlines(),
}))
"""


def add_release(tree: Path) -> list[str]:
    """Add 0.33.1 to the copy at ``tree``: a row, and one ``SINCE`` entry. The diff."""
    diff = []
    for path, after, line in [(TABLE, LAST_ROW, NEW_ROW), (SIGNATURES, LAST_SINCE, NEW_SINCE)]:
        before = (tree / path).read_text()
        head = after.match(before).group()
        changed = head + line + before[len(head):]
        (tree / path).write_text(changed)
        diff += difflib.unified_diff(before.splitlines(True), changed.splitlines(True),
                                     f"a/{path}", f"b/{path}", n=0)
    return diff


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the package with the fake release 0.33.1 added, and the diff that added it."""
    tree = tmp_path_factory.mktemp("release")
    shutil.copytree(REPO / "kvtrace", tree / "kvtrace",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "scripts", tree / "scripts")
    (tree / "added.diff").write_text("".join(add_release(tree)))
    return tree


def test_adding_a_release_is_one_row_and_its_signature_table(tree):
    diff = (tree / "added.diff").read_text().splitlines()
    assert [line for line in diff if line.startswith(("+", "-"))] == [
        f"--- a/{TABLE}", f"+++ b/{TABLE}", "+" + NEW_ROW.rstrip("\n"),
        f"--- a/{SIGNATURES}", f"+++ b/{SIGNATURES}", "+" + NEW_SINCE.rstrip("\n")]


def test_every_reader_picks_up_the_new_release(tree, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(tree), "KVTRACE_VLLM_RELEASES": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", READERS, SUPPORTED_VLLM_VERSIONS[-1]], cwd=tree,
                          env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    supported = [*SUPPORTED_VLLM_VERSIONS, "0.33.1"]
    assert said["supported"] == supported
    assert said["signatures"] and said["has"] == [False, True]
    assert said["refused"].endswith(f"(supported: {', '.join(supported)})")
    assert said["variant"] == ["0.33.1", "vLLM 0.33.1's own code, untouched"]
    assert said["upstream"] == ["the vLLM it runs on, untouched (the project's: 0.33.1)",
                                "vLLM 0.33.1's own checkpoint logic"]
    assert "vllm==0.33.1 (downloads about 337 MB, about 800 MB installed)" in said["plan"]
    assert said["list"][-1] == "0.33.1  not installed (kvtrace vllm install 0.33.1: about 337 MB)"
    assert (f"kvtrace supports vLLM {supported[0]} to 0.33.1."
            in re.sub(r"\s+", " ", said["help"]))
    assert said["all"][-1] == said["plan"]


def test_bootstrap_installs_the_new_release_as_the_projects(tree):
    """The line of scripts/bootstrap that names the project's vLLM, run as it is in the copy,
    with the Python it builds the venv with."""
    script = (tree / "scripts" / "bootstrap").read_text()
    assert not re.search(r"vllm==\d", script), "no release is written into the script"
    line = next(line for line in script.splitlines() if line.startswith("VLLM="))
    done = subprocess.run(["bash", "-c", f'set -euo pipefail; {line}; echo "$VLLM"'], cwd=tree,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ""},
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "vllm==0.33.1\n"), done.stderr
