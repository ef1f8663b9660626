"""A directory link another user planted in /tmp is never followed to an output (this host has
fs.protected_symlinks=0): root's `capture -o /tmp/evil/out.kvtrace` or `replay -o
/tmp/evil/runs/` wrote wherever /tmp/evil pointed (/etc). Outputs were opened with O_NOFOLLOW on
their last component only."""

from __future__ import annotations

import os

import pytest

from kvtrace.capture.safe_paths import NewTraceFile
from kvtrace.errors import KvtraceError
from kvtrace.files import StagedOutput, check_output_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another user's link")
OTHER_UID = 4242


@pytest.fixture
def planted(tmp_path):
    """A sticky world-writable directory (as /tmp) holding `evil`, another user's link to a
    directory of root's (as /etc); returns (the link, its target)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    target = tmp_path / "etc"
    target.mkdir()
    link = shared / "evil"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    return link, target


def refused(call, target):
    with pytest.raises(KvtraceError, match="is a link owned by uid 4242"):
        call()
    assert list(target.iterdir()) == []


def test_capture_o_through_a_planted_link_is_refused(planted):
    link, target = planted
    refused(lambda: NewTraceFile(str(link / "out.kvtrace")), target)


@pytest.mark.parametrize("option", ["-o", "--db", "--summary-json", "--html"])
def test_command_outputs_through_a_planted_link_are_refused(planted, option):
    link, target = planted
    refused(lambda: check_output_dir(str(link / "out.duckdb"), option), target)
    refused(lambda: StagedOutput(str(link / "runs" / "x.kvtrace")), target)


def test_a_link_further_down_a_link_is_followed_to_its_end(planted, tmp_path):
    """An own link that points through the planted one is refused just the same."""
    link, target = planted
    home = tmp_path / "home"
    home.mkdir()
    (home / "out").symlink_to(link)
    refused(lambda: check_output_dir(str(home / "out" / "x.duckdb"), "-o"), target)


def test_ordinary_directories_and_own_links_still_work(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "mine").symlink_to(real)  # root's own link in a sticky directory
    for directory in (real, shared / "mine", shared):
        check_output_dir(str(directory / "x.duckdb"), "-o")
        trace = NewTraceFile(str(directory / "out.kvtrace"))
        trace.publish()
        trace.close()
        assert (real / "out.kvtrace").exists() or (shared / "out.kvtrace").exists()


def test_replay_and_export_directories_through_a_planted_link_are_refused(planted, tmp_path):
    """Replay's -o and export's -o are directories kvtrace makes: no directory is made, and
    nothing written, through the link (the directory under it included)."""
    from click.testing import CliRunner
    from test_replay_cli import hot_prefix_workload

    from kvtrace.cli import cli

    link, target = planted
    workload = hot_prefix_workload(tmp_path / "w.kvtrace", num_gpu_blocks=64)
    db = tmp_path / "w.duckdb"
    assert CliRunner().invoke(cli, ["load", str(workload), "-o", str(db)]).exit_code == 0
    for args in (["replay", str(workload), "--variant", "fixed", "-o", str(link / "runs")],
                 ["export", str(db), "--parquet", str(link / "parquet")]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1, result.output
        assert "is a link owned by uid 4242" in result.stderr
        assert list(target.iterdir()) == []
