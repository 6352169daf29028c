"""Layer contracts of the package, from its static import graph (every `import` statement, at module
level or inside a function, outside `if TYPE_CHECKING:`):
- no import cycles;
- at most 10 imports between the package's own modules inside functions (a lazy import hides a
  dependency from the reader; heavy third-party imports may stay lazy);
- the planning core imports neither the application edge, nor the config schema's Hydra side, nor
  any backend's worker part; importing it loads neither hydra nor omegaconf.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "launcher"
CORE = ("launcher.planner", "launcher.speed", "launcher.memory.estimate", "launcher.backends.registry",
        "launcher.trace", "launcher.host_time", "launcher.peft", "launcher.emit")
EDGE = ("launcher.app", "launcher.cli", "launcher.__main__", "launcher.validate", "launcher.launch",
        "launcher.slurm", "launcher.slurm_job", "launcher.fallback", "launcher.measure", "launcher.calibrate",
        "launcher.recipes", "launcher.recipe_export", "launcher.report", "launcher.report_html")
MAX_FUNCTION_IMPORTS = 10


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(module: str, node, is_package: bool, modules: dict) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parent = module.split(".") if is_package else module.split(".")[:-1]
            parent = parent[:len(parent) - (node.level - 1)]
            base = ".".join(parent + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("launcher"):
            out.append(name)
    return out


def import_graph():
    """(module -> imported package modules, [(module, target, line) imported inside a function])."""
    modules = _modules()
    edges, in_functions = defaultdict(set), []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"

        def walk(node, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(module, child, is_package, modules):
                        if target != module:
                            edges[module].add(target)
                            if in_function:
                                in_functions.append((module, target, child.lineno))
                walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        walk(ast.parse(path.read_text()), False)
    return edges, in_functions


def _cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _reachable(edges, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(edges.get(v, ()))
    return seen


def test_no_import_cycles():
    edges, _ = import_graph()
    assert _cycles(edges) == []


def test_few_imports_inside_functions():
    _, in_functions = import_graph()
    assert len(in_functions) <= MAX_FUNCTION_IMPORTS, in_functions


def test_the_core_imports_neither_the_edge_nor_worker_parts():
    edges, _ = import_graph()
    for core in CORE:
        reached = _reachable(edges, core)
        bad = sorted(m for m in reached if m in EDGE or m.startswith("launcher.worker")
                     or (m.startswith("launcher.backends.") and m.endswith(".worker")))
        assert not bad, f"{core} reaches {bad}"


def test_importing_the_core_loads_no_hydra_or_omegaconf():
    code = ("import sys; import " + ", ".join(CORE) +
            "; print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_contract_checks_fail_on_a_cycle():
    """The cycle finder sees a planted cycle (so a green run is not vacuous)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
