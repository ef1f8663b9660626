"""What the workload writers refuse (kvtrace/workloads/): synth's numbers it cannot draw from,
group counts beyond any engine, and an imported log's lengths and timestamps a trace cannot
hold or lines without end (read in bounded memory, refused by their number)."""

from __future__ import annotations

import subprocess

import pytest
from cli_runs import KVTRACE, assert_error, run, vllm_imported  # noqa: F401


# Hardening finding H2.
@pytest.mark.parametrize("flag, value", [("--rate", "inf"), ("--rate", "nan"),
                                         ("--rate", "1e-300"), ("--zipf", "nan"),
                                         ("--length-sigma", "nan"), ("--think-time", "inf"),
                                         ("--max-prompt-len", "1000000000000"),
                                         ("--requests", str(10**25)),
                                         ("--system-prompts", str(10**12))])
def test_synth_refuses_numbers_it_cannot_draw_from(tmp_path, flag, value):
    done = subprocess.run([*KVTRACE, "synth", "--preset", "chat", "--requests", "5", flag, value,
                           "-o", str(tmp_path / "w.kvtrace")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("kvtrace: error:"), done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


# Hardening finding H2.
@pytest.mark.parametrize("command", [["synth", "--preset", "chat", "--requests", "2"],
                                     ["import", "mooncake", "LOG"]])
@pytest.mark.parametrize("groups", [2**63, 10**6])
def test_mamba_groups_beyond_any_engine_are_refused(tmp_path, command, groups):
    """A what-if geometry is built as a list of groups: 2**63 overflowed it, 10**6 filled
    memory with managers."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n')
    command = [log if arg == "LOG" else arg for arg in command]
    assert_error(run(*command, "--mamba-groups", groups, "--allow-unreal-geometry",
                     "-o", tmp_path / "w.kvtrace"), "--mamba-groups must be from 1 to 255")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


# Hardening findings H3 (a request's length) and C6 (a timestamp).
@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 20, "output_length": 9223372036854775807, '
     '"hash_ids": [1]}', "request line-1 has 9,223,372,036,854,775,827 tokens, more than the"),
    ('{"timestamp": 9223372036854775807, "input_length": 20, "output_length": 2, '
     '"hash_ids": [1]}', "outside a trace's 64-bit clock"),
], ids=["an impossibly long request", "a timestamp beyond the clock"])
def test_an_imported_line_a_trace_cannot_hold_is_refused_and_leaves_nothing(tmp_path, line,
                                                                             message):
    log = tmp_path / "log.jsonl"
    log.write_text(line + "\n")
    assert_error(run("import", "mooncake", log, "-o", tmp_path / "m.kvtrace"), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


# Hardening round three, R8.
def test_import_reads_a_line_without_end_in_bounded_memory(tmp_path):
    """/dev/zero raised MemoryError; an 889 MB line took 4.8 GB before it was refused."""
    import resource

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = subprocess.run([*KVTRACE, "import", "mooncake", "/dev/zero", "-o",
                           str(tmp_path / "z.kvtrace")], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit_memory)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("kvtrace: error: /dev/zero, line 1: longer than 64 MiB")
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


# Hardening round three, R8.
def test_import_refuses_a_long_line_by_its_number(tmp_path):
    log = tmp_path / "log.jsonl"
    with open(log, "w") as file:
        file.write('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n')
        file.write('{"timestamp": 1, "input_length": 20, "output_length": 2, "hash_ids": [1'
                   + ", 1" * (23 << 20) + "]}\n")
    assert_error(run("import", "mooncake", log, "-o", tmp_path / "m.kvtrace"),
                 "line 2: longer than 64 MiB")
