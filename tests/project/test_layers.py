"""The API layer sits on top: whether a save or load is sharded and whether it blocks is
decided in ``lean_store.api`` (and the training verbs that call it), and nothing below imports
it. Checked on the import graph of every ``import`` statement, function-local ones included."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import lean_store

PACKAGE = Path(lean_store.__file__).resolve().parent

API_LAYER = {"lean_store", "lean_store.api", "lean_store.training", "lean_store.training.api",
             "lean_store.training.checkpointer"}
"""The package root, the API layer, and the training verbs built on it."""
USERS = {"lean_store.cli", "lean_store.__main__"}
"""Programs on top of the API: they may import it."""


def import_graph() -> dict[str, set[str]]:
    modules: dict[str, tuple[Path, list[str]]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[:-1]
        if parts[-1] == "__init__":
            parts = package = parts[:-1]
        modules[".".join(parts)] = (path, package)
    graph: dict[str, set[str]] = defaultdict(set)
    for name, (path, package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name].update(m for m in found if m in modules and m != name)
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_nothing_below_the_api_layer_imports_it() -> None:
    graph = import_graph()
    offenders = {name: sorted(graph[name] & API_LAYER) for name in list(graph)
                 if name not in API_LAYER | USERS and graph[name] & API_LAYER}
    assert not offenders, offenders


def test_the_save_and_load_paths_form_no_import_cycle() -> None:
    """checkpoint <-> async_save <-> distributed <-> training was one cycle of 12 modules."""
    graph = import_graph()
    for name in ("lean_store.api", "lean_store.async_save", "lean_store.writing",
                 "lean_store.training.api", "lean_store.training.state",
                 "lean_store.training.checkpointer", "lean_store.distributed.sharded_save",
                 "lean_store.distributed.sharded_load", "lean_store.distributed.training",
                 "lean_store.distributed.collective", "lean_store.options"):
        assert name not in reachable(graph, name), f"{name} is on an import cycle"


def test_the_core_decides_nothing_about_sharding() -> None:
    """checkpoint.py (reads, single-process load), writing.py and async_save.py never reach
    the sharded save or load, nor the training layer."""
    graph = import_graph()
    for name in ("lean_store.checkpoint", "lean_store.writing", "lean_store.async_save"):
        reached = reachable(graph, name)
        assert not {m for m in reached if m.startswith("lean_store.training")}, name
        assert not reached & {"lean_store.distributed.sharded_save",
                              "lean_store.distributed.sharded_load",
                              "lean_store.distributed.training"}, name
