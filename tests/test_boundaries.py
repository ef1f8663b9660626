"""The module boundaries of DESIGN.md section 3, checked by walking every import in kvtrace/."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "kvtrace"
THIRD_PARTY_OK_FOR_CORE = {"msgspec"}


@dataclass(frozen=True)
class Import:
    module: str  # the imported module's full dotted name
    top_level: bool  # at import time of the importing module, not inside a function
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(alias.name, not in_function, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    # `from kvtrace import events` imports the submodule kvtrace.events.
                    submodule = f"{base}.{alias.name}"
                    target = submodule if submodule in KVTRACE_MODULES else base
                    found.append(Import(target, not in_function, child.lineno))
            visit(child, nested)

    visit(tree, False)
    return found


KVTRACE_MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}
MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def root(module: str) -> str:
    return module.split(".")[0]


def is_stdlib(module: str) -> bool:
    return root(module) in sys.stdlib_module_names or root(module) == "__future__"


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(rule) -> list[str]:
    problems = []
    for name, imports in MODULES.items():
        for imp in imports:
            reason = rule(name, imp)
            if reason:
                problems.append(f"{name}:{imp.line} imports {imp.module}: {reason}")
    return problems


def core_rule(name: str, imp: Import) -> str | None:
    if name not in ("kvtrace.events", "kvtrace.errors"):
        return None
    if is_stdlib(imp.module) or root(imp.module) in THIRD_PARTY_OK_FOR_CORE:
        return None
    return "events/errors may import only the standard library and msgspec"


def traceio_rule(name: str, imp: Import) -> str | None:
    if not under(name, "kvtrace.traceio"):
        return None
    if is_stdlib(imp.module) or root(imp.module) == "msgspec" or imp.module in (
            "kvtrace.events", "kvtrace.errors", "kvtrace.native", "kvtrace.files") or under(
            imp.module, "kvtrace.traceio"):
        return None
    return ("traceio may import only stdlib, msgspec, events, errors, files and the native "
            "switch")


def files_rule(name: str, imp: Import) -> str | None:
    """kvtrace.files serves the trace writer, so it stays as light as traceio's own imports."""
    if name != "kvtrace.files":
        return None
    if is_stdlib(imp.module) or imp.module == "kvtrace.errors":
        return None
    return "kvtrace.files imports only the standard library and errors"


def native_rule(name: str, imp: Import) -> str | None:
    """kvtrace.native only says whether the C extension is there; everyone may import it."""
    if name != "kvtrace.native":
        return None
    if is_stdlib(imp.module) or imp.module in ("kvtrace", "kvtrace._native"):
        return None
    return "kvtrace.native imports only the standard library and the C extension"


def in_engine_rule(name: str, imp: Import) -> str | None:
    """capture/ and probes/ run inside a production vLLM engine."""
    if not under(name, "kvtrace.capture", "kvtrace.probes"):
        return None
    if under(imp.module, "kvtrace.replay", "kvtrace.analysis", "kvtrace.cli"):
        return "code that runs inside vLLM must not import replay, analysis or the CLI"
    if root(imp.module) in ("click", "duckdb", "torch"):
        return "code that runs inside vLLM must not import click, duckdb or torch"
    if root(imp.module) == "vllm" and imp.top_level:
        return "vllm only inside functions (the module must import without vLLM)"
    return None


def replay_rule(name: str, imp: Import) -> str | None:
    if not under(name, "kvtrace.replay"):
        return None
    if under(imp.module, "kvtrace.capture", "kvtrace.analysis", "kvtrace.engine", "kvtrace.cli"):
        return "replay must not import capture, analysis, the engine or the CLI"
    if root(imp.module) == "vllm" and name not in ("kvtrace.replay.vllm_backend",
                                                 "kvtrace.replay.variants"):
        return "vllm only in the real-vLLM backend"
    if root(imp.module) == "torch" and not name.startswith("kvtrace.replay.execute"):
        return "torch only in the execute mode"
    return None


def workloads_rule(name: str, imp: Import) -> str | None:
    """Workload producers only write traces: no cache, no engine, no analysis."""
    if not under(name, "kvtrace.workloads"):
        return None
    if under(imp.module, "kvtrace.capture", "kvtrace.replay", "kvtrace.engine",
             "kvtrace.analysis", "kvtrace.probes", "kvtrace.cli"):
        return "workloads write traces; they never import capture, replay, engine or analysis"
    if root(imp.module) in ("vllm", "torch", "duckdb", "click"):
        return "workloads never import vllm, torch, duckdb or click"
    return None


def engine_rule(name: str, imp: Import) -> str | None:
    """The CPU engine runs vLLM's scheduler over replay's cache pieces; capture attaches to it
    from outside, so the engine never imports capture (or analysis, or the CLI)."""
    if not under(name, "kvtrace.engine"):
        return None
    if under(imp.module, "kvtrace.capture", "kvtrace.analysis", "kvtrace.cli"):
        return "the engine must not import capture, analysis or the CLI"
    if root(imp.module) in ("vllm", "torch") and imp.top_level:
        return "vllm only inside functions (kvtrace engine --help must stay fast)"
    return None


def geometry_rule(name: str, imp: Import) -> str | None:
    """geometry/ is its own stage: it reads configs and vLLM, and feeds the others."""
    if not under(name, "kvtrace.geometry"):
        return None
    if under(imp.module, "kvtrace.replay", "kvtrace.capture", "kvtrace.analysis",
             "kvtrace.engine", "kvtrace.workloads", "kvtrace.probes", "kvtrace.cli"):
        return "geometry must not import replay, capture, analysis, the engine or the CLI"
    if root(imp.module) in ("vllm", "torch", "duckdb", "click") and imp.top_level:
        return "vllm / torch only inside functions; no duckdb or click at import time"
    return None


def analysis_rule(name: str, imp: Import) -> str | None:
    if not under(name, "kvtrace.analysis"):
        return None
    # The one exception: the variants' table, whose roles word the verdict (it imports vLLM
    # only inside the functions that install a policy on a real engine).
    if under(imp.module, "kvtrace.capture", "kvtrace.replay", "kvtrace.probes") \
            and imp.module != "kvtrace.replay.variants":
        return "analysis reads traces; it never imports capture or replay internals"
    if root(imp.module) in ("vllm", "torch"):
        return "analysis never imports vllm or torch"
    return None


def cli_rule(name: str, imp: Import) -> str | None:
    if not under(name, "kvtrace.cli") or not imp.top_level:
        return None
    if root(imp.module) in ("vllm", "torch", "duckdb") or under(
        imp.module, "kvtrace.replay", "kvtrace.capture", "kvtrace.analysis", "kvtrace.probes"
    ):
        return "heavy imports go inside command bodies, so `kvtrace --help` stays fast"
    return None


RULES = [core_rule, traceio_rule, files_rule, native_rule, in_engine_rule, replay_rule,
         workloads_rule, engine_rule, geometry_rule, analysis_rule, cli_rule]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_module_boundaries(rule):
    assert violations(rule) == []


def test_the_walker_sees_imports():
    """Guards the checker itself: it must find known imports, top-level and nested."""
    traceio_imports = {i.module for name, imports in MODULES.items()
                       if under(name, "kvtrace.traceio") for i in imports}
    assert {"msgspec", "kvtrace.events", "zlib"} <= traceio_imports
    cat_imports = MODULES["kvtrace.cli.cat"]
    assert any(i.module == "kvtrace.traceio" and not i.top_level for i in cat_imports)
    fake = Import("vllm.v1.core.block_pool", top_level=True, line=1)
    assert in_engine_rule("kvtrace.capture.hook", fake)
    assert not in_engine_rule("kvtrace.capture.hook", Import(fake.module, False, 1))
    assert replay_rule("kvtrace.replay.scheduler", fake)
    assert core_rule("kvtrace.events", Import("numpy", True, 1))


# --- The house's size and shape (issue #33): no circles, no oversized rooms. ---

MAX_PYTHON_LINES, MAX_C_LINES = 600, 1200
CSRC = PACKAGE.parent / "csrc"


def import_graph() -> dict[str, set[str]]:
    """kvtrace module -> the kvtrace modules it imports, at import time or inside a function
    (a nested import that runs back up is a circle all the same, only deferred)."""
    return {name: {imp.module for imp in imports if imp.module in KVTRACE_MODULES} - {name}
            for name, imports in MODULES.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_circles():
    """Guards the checker: a loop through three modules is one circle, a chain none."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# A definition's name starts a line (the type on the line above, vLLM's C style and ours) or
# follows its type on the same line; either way it opens a body, not a prototype's `;`.
_C_DEFINITION = re.compile(r"^(?:(?P<type>[A-Za-z_][\w \t*]*?)[ \t*]+)?(?P<name>\w+)\s*\([^;{]*?\)\s*\{",
                           re.M | re.S)
_C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_C_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof"}


def exported_functions(text: str) -> set[str]:
    """The functions a C file defines for other files: not static, not a keyword."""
    names = set()
    for match in _C_DEFINITION.finditer(text):
        line_start = text.rfind("\n", 0, match.start()) + 1
        above = text[text.rfind("\n", 0, max(line_start - 1, 0)) + 1:line_start]
        declared = (match.group("type") or "") + " " + (above if not match.group("type") else "")
        if match.group("name") not in _C_KEYWORDS and "static" not in declared.split():
            names.add(match.group("name"))
    return names


def c_calls() -> dict[str, set[str]]:
    """csrc file -> the csrc files whose exported functions it calls (by name)."""
    texts = {path.name: _C_COMMENT.sub("", path.read_text()) for path in sorted(CSRC.glob("*.c"))}
    defined = {name: exported_functions(text) for name, text in texts.items()}
    return {caller: {owner for owner, functions in defined.items() if owner != caller
                     and any(re.search(rf"\b{f}\s*\(", text) for f in functions)}
            for caller, text in texts.items()}


def test_c_files_call_each_other_one_way():
    assert circles(c_calls()) == []


@pytest.mark.parametrize("paths,limit", [
    (sorted(PACKAGE.rglob("*.py")), MAX_PYTHON_LINES),
    (sorted(CSRC.glob("*.[ch]")), MAX_C_LINES),
], ids=["python", "c"])
def test_no_file_is_oversized(paths, limit):
    over = {str(p.relative_to(PACKAGE.parent)): n for p in paths
            if (n := len(p.read_text().splitlines())) > limit}
    assert over == {}


def test_the_c_reader_sees_exported_functions_only():
    """Guards the C checker: both definition styles count, static ones and prototypes do not."""
    text = ("static int\nhidden(int a)\n{\n}\nvoid\nshown(PyObject *self)\n{\n}\n"
            "int also_shown(void) {\n}\nint prototype(void);\n")
    assert exported_functions(text) == {"shown", "also_shown"}
