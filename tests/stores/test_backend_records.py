"""The backend registry: each backend is one record, and code outside ``stores/`` never branches
on a backend's name."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls
from lean_store.stores.registry import BACKENDS, backend_for, backend_record, detect_backend

PACKAGE = Path(ls.__file__).parent


def test_every_backend_has_one_record_with_its_suffixes() -> None:
    assert BACKENDS == ("hdf5", "zarr")
    for name in BACKENDS:
        record = backend_record(name)
        assert record.name == name
        for suffix in record.suffixes:
            assert backend_for(f"run/step{suffix}") == name
            assert backend_for(f"RUN/STEP{suffix.upper()}") == name
    with pytest.raises(ls.CheckpointError, match="unknown backend 'tiff'"):
        backend_record("tiff")
    with pytest.raises(ls.CheckpointError, match="cannot tell the backend"):
        backend_for("run/step.bin")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_record_recognises_what_its_backend_wrote(tmp_path: Path, backend: str) -> None:
    record = backend_record(backend)
    path = tmp_path / f"ck{record.suffixes[0]}"
    ls.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
    assert record.holds(path)
    assert detect_backend(path) == backend
    assert path.is_dir() == record.directory
    other = backend_record(next(b for b in BACKENDS if b != backend))
    assert not other.holds(path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checksum_the_backend_lacks_is_a_clear_error(tmp_path: Path, backend: str) -> None:
    record = backend_record(backend)
    path = tmp_path / f"ck{record.suffixes[0]}"
    with pytest.raises(ls.CheckpointError, match=f"{record.title} checksums are .*'md5'"):
        ls.save({"w": np.zeros(3, np.float32)}, path, checksum="md5")
    assert not path.exists()


def _name_branches(path: Path, root: Path = PACKAGE) -> list[str]:
    """``x == "hdf5"`` / ``x != "zarr"`` comparisons (any operand): a branch on a backend name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq))
                                                 for op in node.ops):
            for operand in [node.left, *node.comparators]:
                if isinstance(operand, ast.Constant) and operand.value in BACKENDS:
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_no_backend_name_branches_outside_stores() -> None:
    branches = [hit for path in sorted(PACKAGE.rglob("*.py"))
                if "stores" not in path.relative_to(PACKAGE).parts
                for hit in _name_branches(path)]
    assert branches == []


def test_the_branch_finder_finds_a_branch(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(backend):\n    return 1 if backend == 'zarr' else 2\n")
    assert _name_branches(sample, tmp_path) == ["sample.py:2"]
