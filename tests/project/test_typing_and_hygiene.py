"""Package hygiene: the type marker ships, modules use each other's public names only, and the
mypy configuration that ``./dev test`` runs is present (the mypy run itself is in ``./dev``)."""

from __future__ import annotations

import ast
import importlib.resources
import tomllib
from pathlib import Path

import pytest
from torch_optional import needs_torch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lean_store"

# `_private` names still imported from another package (importing module, imported name);
# the list only shrinks.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_py_typed_marker_is_in_the_package_and_declared_as_package_data() -> None:
    assert importlib.resources.files("lean_store").joinpath("py.typed").is_file()
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["lean_store"]


def test_mypy_checks_the_package_for_the_oldest_supported_python() -> None:
    project = _pyproject()
    mypy = project["tool"]["mypy"]
    assert mypy["packages"] == ["lean_store"]
    oldest = project["project"]["requires-python"].removeprefix(">=")
    assert mypy["python_version"] == oldest
    assert "ignore_errors" not in mypy
    assert all("ignore_errors" not in o for o in mypy.get("overrides", []))
    for extra in ("test", "test-without-torch"):
        assert any(d.startswith("mypy") for d in project["project"]["optional-dependencies"][extra])
    assert ".venv/bin/mypy" in (ROOT / "dev").read_text()


def _private_imports() -> set[tuple[str, str]]:
    """``_private`` names a module imports from a module of another package (directory)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        package = path.parent
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                source = package
                for _ in range(node.level - 1):
                    source = source.parent
                source = source.joinpath(*(node.module or "").split(".")) if node.module else source
            elif (node.module or "").startswith("lean_store"):
                source = ROOT.joinpath(*node.module.split("."))
            else:
                continue  # another project's private names are that project's business
            same_package = source == package or source.parent == package
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") \
                        and not same_package:
                    found.add((path.relative_to(ROOT).as_posix(), alias.name))
    return found


def test_no_private_names_imported_across_packages() -> None:
    assert _private_imports() <= KNOWN_PRIVATE_IMPORTS


@needs_torch
def test_dcp_write_item_without_tensor_data_is_a_clear_error(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    import lean_store.interop.dcp as lsd
    from lean_store.errors import CheckpointError

    writer = lsd.StorageWriter(tmp_path / "c.zarr")
    item = WriteItem(index=MetadataIndex("model.w"), type=WriteItemType.TENSOR)
    with pytest.raises(CheckpointError, match="'model.w'.*no tensor data"):
        writer.prepare_global_plan([SavePlan([item])])
    assert not (tmp_path / "c.zarr").exists()
