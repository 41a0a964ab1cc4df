"""House rules as tests: imports point down the layers; files and functions stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pyast
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("areal/**/*.py"), *ROOT.glob("examples/**/*.py")])

# Lowest first. A module may import areal modules of its own layer or any layer below.
LAYERS = [
    {"utils"},
    {"api"},
    {"algo"},
    {"engine", "rollout", "serving"},  # trainer side, rollout client, generation server
    {"workflow", "reward", "dataset"},
    {"runtime"},
    {"launcher", "core", "tinker"},  # tinker: the Tinker API service over engine + serving
    {"cli", "quickstart", "evaluate", "config_docs", "__main__", "examples"},
]
# Imports forbidden even where the layers allow them: the three programs of the middle layer
# stay apart, and workflows see only the InferenceEngine protocol (areal.api.engine).
NEVER: dict[str, set[str]] = {
    "engine": {"rollout", "serving"},
    "rollout": {"engine", "serving"},
    "serving": {"engine", "rollout"},
    "workflow": {"rollout"},
}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
# "path" or "path::function" -> the written reason it may exceed its budget.
EXEMPT: dict[str, str] = {}


def _package(module: str) -> str:
    parts = module.split(".")
    return "examples" if parts[0] == "examples" else (parts[1] if len(parts) > 1 else "__init__")


def _layer(module: str) -> int:
    top = _package(module)
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    if top == "__init__":
        return 0
    raise AssertionError(f"{module}: package areal.{top} is in no layer; add it to LAYERS")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or parts
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    tree = pyast.parse(path.read_text(), str(path))
    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    type_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If)
        and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:  # annotations only; nothing is imported at run time
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return [(line, n) for line, n in out if n == "areal" or n.startswith("areal.")]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    module = _module_name(path)
    if module in ("areal", "areal.__init__"):
        return
    mine = _layer(module)
    for line, name in _imports(path, module):
        if name == "areal":
            continue
        theirs = _layer(name)
        assert theirs <= mine, (
            f"{path.relative_to(ROOT)}:{line} imports {name} (layer {sorted(LAYERS[theirs])}) "
            f"from layer {sorted(LAYERS[mine])}: imports must point down (see ARCHITECTURE.md)"
        )
        assert _package(name) not in NEVER.get(_package(module), set()), (
            f"{path.relative_to(ROOT)}:{line} imports {name}: areal.{_package(module)} never "
            f"imports areal.{_package(name)} (see NEVER and ARCHITECTURE.md)"
        )


def test_never_rules_name_real_packages():
    known = set().union(*LAYERS)
    for pkg, banned in NEVER.items():
        assert {pkg, *banned} <= known, f"NEVER[{pkg!r}] names a package in no layer"


def test_files_and_functions_stay_within_budget():
    problems = []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        n_lines = text.count("\n") + 1
        if n_lines > MAX_FILE_LINES and rel not in EXEMPT:
            problems.append(f"{rel}: {n_lines} lines > {MAX_FILE_LINES}")
        for node in ast.walk(pyast.parse(text, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES and f"{rel}::{node.name}" not in EXEMPT:
                    problems.append(f"{rel}::{node.name}: {size} lines > {MAX_FUNCTION_LINES}")
    assert not problems, "over budget (split, or add to EXEMPT with a reason):\n" + "\n".join(
        problems
    )


def test_exemptions_have_reasons_and_still_exist():
    for key, reason in EXEMPT.items():
        assert len(reason) > 20, f"EXEMPT[{key!r}] needs a written reason"
        assert (ROOT / key.split("::")[0]).exists(), f"EXEMPT[{key!r}] names a file that is gone"


def test_every_module_imports():
    import importlib

    for path in SOURCES:
        if path.parts[len(ROOT.parts)] == "areal":
            importlib.import_module(_module_name(path))


def test_launch_env_variables_are_named_only_in_the_launch_contract():
    from areal.api import launch

    names = {v for k, v in vars(launch).items() if k.isupper() and isinstance(v, str)}
    assert {"RANK", "AREAL_LAUNCH_ATTEMPT", "CUDA_VISIBLE_DEVICES"} <= names
    contract = ROOT / "areal" / "api" / "launch.py"
    found = []
    for path in SOURCES:
        if path == contract:
            continue
        for node in ast.walk(pyast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} names {node.value!r}")
    assert not found, "use the names in areal/api/launch.py:\n" + "\n".join(found)


TENSOR_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
}


def test_tensor_collectives_go_through_the_device_aware_door():
    # areal/utils/comm.py refuses a tensor on a device its group cannot serve (a CPU tensor on an
    # NCCL-only group crashed every GPU run at its first stats export); a direct dist.* call
    # skips it.
    found = []
    for path in SOURCES:
        if path.name == "comm.py" and path.parent.name == "utils":
            continue
        for node in ast.walk(pyast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in TENSOR_COLLECTIVES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in {"dist", "torch_dist"}
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} dist.{node.func.attr}")
    assert not found, f"use areal.utils.comm instead: {found}"


# Reviewed pairs of files that import each other, one side inside a function (run only when
# called, after both are loaded). module set -> why the lazy side stays.
LAZY_CYCLES: dict[frozenset[str], str] = {
    frozenset({"areal.runtime.run", "areal.runtime.replay"}): (
        "the run records replays (ReplayRecorder), and areal replay re-runs a run (init_run): "
        "replay_run loads run.py only when a replay starts"
    ),
    frozenset(
        {
            "areal.utils.name_resolve",
            "areal.utils.name_resolve_etcd",
            "areal.utils.name_resolve_ray",
        }
    ): (
        "make_repository loads the etcd and Ray backends only when configured (their clients "
        "are optional dependencies); they build on name_resolve's base classes"
    ),
}


def _areal_imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The areal modules ``path`` imports at run time, at module level or inside a function
    (not under ``if TYPE_CHECKING``: annotations only). ``from pkg import mod`` names the module
    ``pkg.mod`` when that is a file."""
    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = pyast.parse(path.read_text(), str(path))
    type_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for n in ast.walk(block)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != module}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[frozenset[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(graph[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            part = stack[stack.index(m) :]
            del stack[stack.index(m) :]
            if len(part) > 1:
                cycles.append(frozenset(part))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return cycles


def test_no_two_areal_files_import_each_other_in_a_cycle():
    # A cycle hides which file is the lower one and works only while nobody imports its files
    # in another order; core/record -> core/replay -> core/session -> core/record was one (its
    # first edge inside a function). Function-local imports count; TYPE_CHECKING ones do not.
    paths = {_module_name(p): p for p in SOURCES if p.parts[len(ROOT.parts)] == "areal"}
    known = set(paths)
    cycles = _cycles({m: _areal_imports(p, m, known) for m, p in paths.items()})
    new = [" <-> ".join(sorted(c)) for c in cycles if c not in LAZY_CYCLES]
    assert not new, (
        "files importing each other in a cycle (import one of them lower, or move the shared "
        "part down):\n" + "\n".join(new)
    )
    gone = [sorted(c) for c in LAZY_CYCLES if c not in cycles]
    assert not gone, f"LAZY_CYCLES lists pairs that no longer import each other: {gone}"


def test_the_cycle_finder_finds_a_cycle_through_three_files():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]
