"""The package's shape: no import circles and no import back up the floors (module-level or lazy,
function-level imports alike), in ``hf_tensorcomp/`` and in ``benchmarks/``; no module over 600 lines.

The floors (`FLOORS`), lowest first; a module may import its own floor and those below, never one above:

0. foundation: `validation`, `layout`, `distributed`, `atomic` (atomic folder / file writes), `memory`
   (process memory), `shards` (safetensors reads), `heal_settings` -- torch and the standard library only
1. `decompositions`: the numerical kernels (SVD, CP / Tucker, quantization, pivoted QR, allocation)
2. `layers`: the compressed modules
3. data and measures: `assets`, `calibration`, `eval`, `training`
4. `methods`: one subpackage or module per compression method
5. the pipeline: `config`, `plan`, `checks`, `surgery`, `healing`, `embedding_tables`, `layer_stream`, `budget`,
   `pipeline`, `sweep`
6. integration: `integration` (transformers' quantizer, the Hub, PEFT, atomic saving), `streaming`, `convert`,
   `hybrid`
7. entry points: `cli` (and `cli_report`, its compress report) and the package's ``__init__``

A module's floor is that of its longest dotted prefix in `FLOORS` (``hf_tensorcomp.methods.qlr.layer`` is on
`methods`' floor); every module must have one. In ``benchmarks/`` each script may import the package and
``benchmarks/common.py`` (the helpers scripts share), never another script.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_tensorcomp

ROOT = Path(hf_tensorcomp.__file__).parent
PKG = "hf_tensorcomp"
BENCHMARKS = ROOT.parent / "benchmarks"
MAX_LINES = 600

FLOORS = [
    {"validation", "layout", "distributed", "atomic", "memory", "shards", "heal_settings"},
    {"decompositions"},
    {"layers"},
    {"assets", "calibration", "eval", "training"},
    {"methods"},
    {"config", "plan", "checks", "surgery", "healing", "embedding_tables", "layer_stream", "budget", "pipeline", "sweep"},
    {"integration", "streaming", "convert", "hybrid"},
    {"cli", "cli_report", ""},  # "": the package's __init__
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """{module: modules of this package it imports anywhere in its body}; ``from . import x`` points
    at submodule ``x`` when there is one, else at the package itself."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t.startswith(PKG) and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_lazy_imports():
    graph = import_graph()
    assert "hf_tensorcomp.plan" in graph["hf_tensorcomp.pipeline"]
    assert "hf_tensorcomp.calibration" in graph["hf_tensorcomp.pipeline"]  # imported inside a function


def floor(module: str) -> int | None:
    """The floor of `module` (``hf_tensorcomp.x.y``): that of its longest prefix named in `FLOORS`."""
    parts = module.split(".")[1:]
    for n in range(len(parts), -1, -1):
        for i, names in enumerate(FLOORS):
            if ".".join(parts[:n]) in names:
                return i
    return None


def test_every_module_has_a_floor():
    assert [m for m in _modules() if floor(m) is None] == []


def test_no_import_runs_back_up_the_floors():
    graph = import_graph()
    up = sorted(f"{m} (floor {floor(m)}) imports {t} (floor {floor(t)})" for m, ts in graph.items() for t in ts
                if floor(t) > floor(m))
    assert up == []


def test_the_floor_check_sees_an_import_up():
    assert floor("hf_tensorcomp.methods.qlr.layer") == 4 and floor("hf_tensorcomp") == len(FLOORS) - 1
    assert floor("hf_tensorcomp.integration.hub") > floor("hf_tensorcomp.methods.einsort.method")


def test_no_module_over_600_lines():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def benchmark_graph() -> dict[str, set[str]]:
    """{script: the other ``benchmarks/`` modules it imports anywhere in its body} (the scripts put their own
    folder on ``sys.path`` and import each other by bare name)."""
    scripts = {p.stem: p for p in BENCHMARKS.glob("*.py")}
    graph = {}
    for name, path in scripts.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                targets = [node.module or ""]
            else:
                continue
            graph[name] |= {t.split(".")[0] for t in targets if t.split(".")[0] in scripts} - {name}
    return graph


def test_benchmark_scripts_import_only_common():
    graph = benchmark_graph()
    assert len(graph) > 5 and "common" in graph
    assert graph["common"] == set()
    assert {s: ts for s, ts in graph.items() if ts - {"common"}} == {}
    assert cycles(graph) == []


def test_no_import_circles():
    """Package ``__init__`` files that re-export their submodules are left out: importing a submodule
    runs its package first, which is how Python works, not a circle in the design."""
    graph = import_graph()
    inits = {m for m, p in _modules().items() if p.name == "__init__.py"}
    pruned = {m: {t for t in ts if t not in inits or not m.startswith(t + ".")} for m, ts in graph.items()}
    assert cycles(pruned) == []


def test_heal_settings_are_checked_without_the_trainer():
    """The config validates ``heal=`` through `heal_settings` (which needs nothing but `validation`), never
    importing the healing trainer."""
    graph = import_graph()

    def reach(module):
        seen, todo = set(), [module]
        while todo:
            for t in graph[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        return seen

    assert reach("hf_tensorcomp.heal_settings") <= {"hf_tensorcomp.validation"}
    assert "hf_tensorcomp.healing" not in reach("hf_tensorcomp.config")
