"""The package reads top-down: no import cycles (outside ``formats/``), counting the imports made
inside functions too: a cycle held together by a function-local import is still a cycle."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import lean_store as ls

PACKAGE = Path(ls.__file__).parent

def _modules() -> dict[str, tuple[Path, list[str]]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            package = parts
        else:
            package = parts[:-1]
        found[".".join(parts)] = (path, package)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the lean_store modules it imports (at module level or in a function)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, (path, package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # ``from package import module`` depends on that module, not on the package
                submodules = [f"{target}.{a.name}" for a in node.names
                              if f"{target}.{a.name}" in modules]
                candidates = submodules if len(submodules) == len(node.names) else [target]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            graph[name].update(c for c in candidates if c in modules and c != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_outside_formats() -> None:
    in_cycles = {m for c in cycles(import_graph()) for m in c
                 if not m.startswith("lean_store.formats")}
    assert in_cycles == set()


def test_the_core_does_not_import_the_layers_above_it() -> None:
    core = ["lean_store.layout", "lean_store.chunking", "lean_store.integrity",
            "lean_store.metadata", "lean_store.errors", "lean_store.naming",
            "lean_store.encoded", "lean_store.hardening", "lean_store.indexing"]
    above = ("lean_store.checkpoint", "lean_store.async_save", "lean_store.training",
             "lean_store.distributed", "lean_store.interop", "lean_store.inspection",
             "lean_store.cli")
    graph = import_graph()
    offenders = {m: sorted(t for t in graph[m] if t.startswith(above)) for m in core}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_importing_lean_store_loads_no_backend_library() -> None:
    """h5py, zarr and torch load when first needed: ``import lean_store`` stays cheap (forked
    writers, CLIs and workers import it often)."""
    import subprocess
    import sys

    code = ("import sys, lean_store\n"
            "print(sorted(m for m in ('h5py', 'zarr', 'torch') if m in sys.modules))")
    env_path = str(PACKAGE.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"
