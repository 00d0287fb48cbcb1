"""The test suite's own structure: test files grouped in subdirectories of tests/, shared
helpers at its top, and no test reaching into tools/ through sys.path (tests run a tool as a
child process, tests/tool_runner.py)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TOOLS = TESTS.parent / "tools"


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_test_files_are_grouped_in_subdirectories():
    assert len(_test_files()) > 50
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert top == [], f"place these in a subdirectory of tests/ by what they test: {top}"
    for path in _test_files():
        assert path.parent.parent == TESTS, path  # one level: tests/<group>/test_x.py


def test_test_file_names_are_unique():
    """pytest imports test files by base name (pytest's default 'prepend' import mode, no
    __init__.py): two files of one name in different groups would clash."""
    names = [p.name for p in _test_files()]
    assert sorted(set(names)) == sorted(names)


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """Lines that call sys.path.insert/append/extend (code, not text in strings)."""
    return [
        node.lineno for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr in {"insert", "append", "extend"}
        and ast.unparse(node.func.value) == "sys.path"
    ]


def _imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_no_test_imports_tools_through_sys_path():
    tool_modules = {p.stem for p in TOOLS.rglob("*.py")} | {"tools"}
    assert {"crash_soak", "fuzz_soak", "peers"} <= tool_modules
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text("utf-8"))
        name = path.relative_to(TESTS).as_posix()
        offenders += [f"{name}:{line}: edits sys.path" for line in _sys_path_edits(tree)]
        offenders += [f"{name}: imports {m}" for m in _imported_modules(tree) & tool_modules]
    assert offenders == []
