"""The public read interface: what a store reader declares, what ``Checkpoint`` offers on top
(``stored``, ``shards``, ``describe``, ``blocks``, ``read``, ``read_bits``, ``read_region``,
``verify``), and the structure rules that keep every module outside a package off its
private names (readers' internals included)."""

from __future__ import annotations

import ast
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import zarr_chunk_file

import lean_store as ls
from lean_store.errors import CheckpointError, IntegrityError
from lean_store.stores.base import StorageDescription, StoredTensor, StoreReader

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lean_store"
ROWS, COLS = 50, 100  # float32, chunk_bytes=4096 -> 5 chunks of 10 rows
A = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
BIG = np.arange(4 << 18, dtype=np.float32).reshape(16, -1)  # 4 MiB in chunks of 1 MiB


def _save(tmp_path: Path, suffix: str, **kwargs: object) -> Path:
    path = tmp_path / f"ck{suffix}"
    state = {"w": A, "s": np.float64(2.5), "z": (A[:3, :4] + 1j).astype(np.complex64)}
    ls.save(state, path, chunk_bytes=4096, **kwargs)
    return path


def _flip_hdf5_chunk(path: Path, name: str, number: int) -> None:
    with h5py.File(path, "r") as f:
        info = f[name].id.get_chunk_info(number)
    with open(path, "r+b") as f:
        f.seek(info.byte_offset + 5)
        byte = f.read(1)
        f.seek(info.byte_offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def _flip_zarr_chunk(path: Path, name: str, key: str) -> None:
    chunk = zarr_chunk_file(path / name, *map(int, key.split("/")))
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))


def _flip(path: Path, row_chunk: int) -> None:
    if path.suffix == ".h5":
        _flip_hdf5_chunk(path, "w", row_chunk)
    else:
        _flip_zarr_chunk(path, "w", f"{row_chunk}/0")


# --------------------------------------------------------------------- what a reader declares


def test_store_reader_declares_every_capability_callers_use() -> None:
    declared = {"nodes", "stored", "describe", "type_mismatch", "read", "structure_problems",
                "close"}
    assert declared <= StoreReader.__abstractmethods__
    for method in ("chunk_crcs", "read_unchecked", "check_chunk", "check_metadata",
                   "check_current", "checks_deferred"):
        assert callable(getattr(StoreReader, method))


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_stored_and_describe(tmp_path: Path, suffix: str) -> None:
    path = _save(tmp_path, suffix)
    with ls.open(path) as ck:
        info = ck.stored("w")
        assert isinstance(info, StoredTensor)
        assert info.stored_shape == (ROWS, COLS) and info.chunk_shape == (10, COLS)
        storage = ck.describe("w")
        assert isinstance(storage, StorageDescription)
        assert storage.chunk_shape == (10, COLS)
        assert storage.compression == ()
        assert storage.stored_bytes is not None and storage.stored_bytes >= A.nbytes
        assert ("crc32c" if suffix == ".h5" else "Crc32cCodec") in storage.codecs
        assert ck.shards("w") == []
        assert ck.structure_problems("w") == []
        with pytest.raises(KeyError):
            ck.stored("nope")
        with pytest.raises(CheckpointError, match="no.*shard|not a shard"):
            ck.blocks("w", shard=0)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_describe_names_the_compression(tmp_path: Path, suffix: str) -> None:
    path = _save(tmp_path, suffix, compression="gzip" if suffix == ".h5" else "zstd")
    with ls.open(path) as ck:
        assert ck.describe("w").compression == (
            ("shuffle", "gzip") if suffix == ".h5" else ("zstd",))


# ------------------------------------------------------------------------------ whole reads


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_whole_and_partial_reads(tmp_path: Path, suffix: str) -> None:
    path = _save(tmp_path, suffix)
    with ls.open(path) as ck:
        assert np.array_equal(ck.read("w"), A)
        assert np.array_equal(ck["w"].read(), A)
        assert ck.read("s") == 2.5 and ck.read("s").shape == ()
        assert np.array_equal(ck.read("z"), (A[:3, :4] + 1j).astype(np.complex64))
        bits = ck.read_bits("z")
        assert bits.shape == (3, 4, 2) and bits.dtype == np.uint32
        part = ck.read_region("w", (slice(12, 31), slice(5, 9)))
        assert np.array_equal(part.view(np.float32), A[12:31, 5:9])
        assert np.array_equal(ck["w"][12:31, 5:9], A[12:31, 5:9])


# ------------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_blocks_cover_the_tensor_in_c_order(tmp_path: Path, suffix: str) -> None:
    path = _save(tmp_path, suffix)
    with ls.open(path) as ck:
        regions = [r for r, _ in ck.blocks("w")]  # the store's chunks
        assert [r[0].start for r in regions] == [0, 10, 20, 30, 40]
        words = np.concatenate([w.copy() for _, w in ck.blocks("w", block_bytes=1200)])
        assert np.array_equal(words.view(np.float32), A)
        small = [r for r, _ in ck.blocks("w", block_bytes=1200)]
        assert len(small) == 17 and all(r[1] == slice(0, COLS) for r in small)
        assert [r for r, _ in ck.blocks("w", unit=(7, COLS))][1] == (slice(7, 14),
                                                                      slice(0, COLS))
        with pytest.raises(CheckpointError, match="row blocks"):
            ck.blocks("w", unit=(10, 10))
        out = np.zeros((ROWS, COLS), np.uint32)
        for _ in ck.blocks("w", out=out):
            pass
        assert np.array_equal(out.view(np.float32), A)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_corrupt_chunk_raises_from_blocks_and_is_never_handed_out(
    tmp_path: Path, suffix: str
) -> None:
    path = _save(tmp_path, suffix)
    _flip(path, 2)
    with ls.open(path) as ck:
        seen = []
        with pytest.raises(IntegrityError):
            for region, _ in ck.blocks("w"):
                seen.append(region[0].start)
        assert seen == [0, 10]
        with pytest.raises(IntegrityError):
            ck.read("w")
        with pytest.raises(IntegrityError):
            ck.verify()
        with pytest.raises(IntegrityError):
            ck.read_region("w", (slice(25, 26), slice(0, 3)))
        assert np.array_equal(ck["w"][:20], A[:20])  # the chunks around it read fine
        assert np.array_equal(ck.read_region("w", (slice(30, 50), slice(0, COLS))
                                              ).view(np.float32), A[30:])
        failed: list = []
        kept = [r[0].start for r, _ in ck.blocks(
            "w", on_error=lambda region, exc: failed.append((region, type(exc))))]
        assert kept == [0, 10, 30, 40]
        assert failed == [((slice(20, 30), slice(0, COLS)), IntegrityError)]  # no digest


def test_big_chunks_checked_ahead_still_never_hand_out_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "big.h5"
    ls.save({"b": BIG}, path, chunk_bytes=1 << 20)
    with ls.open(path) as ck:
        assert np.array_equal(np.concatenate([w.copy() for _, w in ck.blocks("b", reuse=True)]
                                             ).view(np.float32), BIG)
    _flip_hdf5_chunk(path, "b", 2)
    with ls.open(path) as ck:
        seen = []
        with pytest.raises(IntegrityError, match=r"chunk \(2, 0\)"):
            for region, _ in ck.blocks("b", reuse=True):
                seen.append(region[0].start)
        assert seen == [0, 4]


def test_a_stale_digest_is_caught_by_blocks(tmp_path: Path) -> None:
    """Every chunk passes its own check, the digest does not: raised after the last block,
    or reported once through ``on_error``."""
    path = tmp_path / "ck.h5"
    ls.save({"w": A}, path, chunk_bytes=4096)
    with h5py.File(path, "r+") as f:  # the manifest holds the attributes read
        del f.attrs["manifest"]
        f["w"].attrs["crc32c"] = np.int64(f["w"].attrs["crc32c"] ^ 1)
    with ls.open(path) as ck:
        blocks = ck.blocks("w", block_bytes=4096)
        for _ in range(5):
            next(blocks)
        with pytest.raises(IntegrityError, match="crc32c"):
            next(blocks)
        failed: list = []
        for _ in ck.blocks("w", block_bytes=1200, on_error=lambda r, e: failed.append(r)):
            pass
        assert failed == [None]
    report = ls.verify(path)
    assert [(p.tensor, p.chunk) for p in report.problems] == [("w", None)]


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_verify_names_the_bad_chunk(tmp_path: Path, suffix: str) -> None:
    path = _save(tmp_path, suffix)
    _flip(path, 3)
    report = ls.verify(path)
    assert [(p.tensor, p.chunk) for p in report.problems] == [("w", (3, 0))]
    assert report.chunks == 5 + 1 + 1


SHARDED_SAVE = """
import sys
import numpy as np
import torch.distributed as dist
import lean_store as ls
from lean_store.distributed.local_state import LocalShard

dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
values = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
ls.save({"w": LocalShard(values, (64, 8), (0, 0))}, sys.argv[2], chunk_bytes=1024)
dist.destroy_process_group()
import os, sys; sys.stdout.flush(); os._exit(0)  # why: tests/gloo_world.py leave_world
"""


def test_sharded_hdf5_through_the_read_interface(tmp_path: Path) -> None:
    """A sharded HDF5 directory: one recorded shard, read whole, by shard, in C-order
    blocks; the storage checks are those of the shard file; a corrupt shard chunk raises."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torch.distributed")
    path = tmp_path / "sharded.h5"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", SHARDED_SAVE, str(tmp_path / "pg"), str(path)],
                   env=env, check=True, timeout=300)
    values = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    with ls.open(path) as ck:
        (shard,) = ck.shards("w")
        assert shard.rank == 0 and shard.box.lengths == (64, 8)
        assert np.array_equal(ck.read("w"), values)
        assert np.array_equal(np.concatenate([w.copy() for _, w in ck.blocks("w", shard=0)]
                                             ).view(np.float32), values)
        regions = [r for r, _ in ck.blocks("w", block_bytes=512)]
        assert [r[0].start for r in regions] == list(range(0, 64, 16))
        assert ck.structure_problems("w") == []
        assert ck.describe("w").stored_bytes
    (shard_file,) = path.glob("shard-*.h5")
    with h5py.File(shard_file, "r") as f:
        (dset,) = list(f)
    _flip_hdf5_chunk(shard_file, dset, 1)
    with ls.open(path) as ck:
        with pytest.raises(IntegrityError):
            for _ in ck.blocks("w", shard=0):
                pass
        with pytest.raises(IntegrityError):
            ck.read_region("w", (slice(0, 64), slice(0, 8)))
    report = ls.verify(path)
    assert report.bad_tensors == ["w"]


# ------------------------------------------------------------------------- structure rules


def _package_of(path: Path, root: Path) -> str:
    """Modules directly in lean_store/ are each their own unit; any other module belongs to
    its directory's package (lean_store/stores/hdf5/ apart from lean_store/stores/)."""
    rel = path.relative_to(root.parent).with_suffix("")
    if rel.parent == Path(root.name):
        return ".".join(rel.parts)
    return ".".join(rel.parent.parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: ``self._x``/``cls._x`` targets, and private methods,
    properties and class attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(
            node.value, ast.Name
        ) and node.value.id in ("self", "cls") and _private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found = [item.name]
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found = [item.target.id]
                elif isinstance(item, ast.Assign):
                    found = [t.id for t in item.targets if isinstance(t, ast.Name)]
                else:
                    found = []
                names.update(n for n in found if _private(n))
    return names


def private_reaches(sources: dict[Path, str], root: Path) -> list[str]:
    """``module:line: expr`` for each attribute access to a private name of lean_store on
    anything but ``self``/``cls`` from a package that does not define that name."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    definers: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for name in _defined_privates(tree):
            definers.setdefault(name, set()).add(_package_of(path, root))
    found = []
    for path, tree in trees.items():
        package = _package_of(path, root)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = definers.get(node.attr)
            if owners and package not in owners:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                             f"{ast.unparse(node)}")
    return found


def _sources() -> dict[Path, str]:
    return {p: p.read_text("utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


KNOWN_PRIVATE_REACHES: list[str] = []  # empty: nothing outside a package uses its privates


def test_no_module_reaches_into_another_packages_private_names() -> None:
    assert private_reaches(_sources(), PACKAGE) == KNOWN_PRIVATE_REACHES


def test_the_private_name_rule_can_fail(tmp_path: Path) -> None:
    root = tmp_path / "lean_store"
    sources = {
        root / "checkpoint.py": "class C:\n    def __init__(self):\n        self._reader = 1\n",
        root / "cli.py": "def f(ck):\n    return ck._reader.read()\n",
        root / "stores" / "hdf5" / "store.py": "class R:\n    def _dataset(self): ...\n",
        root / "stores" / "hdf5" / "verify.py": "def g(r):\n    return r._dataset()\n",
        root / "inspection" / "verify.py": "def h(r):\n    return r._dataset(), r._nothing\n",
    }
    assert private_reaches(sources, root) == [
        "lean_store/cli.py:2: ck._reader",
        "lean_store/inspection/verify.py:2: r._dataset",
    ]


def test_no_capability_probes_on_readers() -> None:
    """What a reader can do is declared on StoreReader, not probed with hasattr/getattr."""
    probes = []
    for path, text in _sources().items():
        if "stores" in path.relative_to(PACKAGE).parts[:1]:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("hasattr", "getattr") and node.args and \
                    "reader" in ast.unparse(node.args[0]).lower():
                probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert probes == []


def test_checkpoint_does_not_import_the_layers_above_it() -> None:
    """inspection/ and interop/ are built on Checkpoint; checkpoint.py imports neither."""
    tree = ast.parse((PACKAGE / "checkpoint.py").read_text("utf-8"))
    modules = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert modules and not [m for m in modules if m.split(".")[0] in ("inspection", "interop")]


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_misuse_of_an_open_checkpoint_is_a_checkpoint_error(tmp_path, suffix) -> None:
    """A name it does not hold (a KeyError too, with the closest names), a boolean or fancy
    index, a slice step of 0, a read after close: each a CheckpointError saying so (they
    raised a bare KeyError, numpy's ValueError, range's ValueError and libhdf5's 'Invalid
    dataset identifier')."""
    path = tmp_path / f"m{suffix}"
    ls.save({"fc.weight": np.arange(20.0).reshape(4, 5), "fc.bias": np.ones(4)}, path)
    ck = ls.open(path)
    handle = ck["fc.weight"]
    with pytest.raises(ls.TensorNotFoundError, match=r"did you mean 'fc.weight'") as info:
        ck["module.fc.weight"]
    assert isinstance(info.value, KeyError)
    with pytest.raises(KeyError):
        ck.read("fc.wieght")
    with pytest.raises(ls.CheckpointError, match="unsupported index"):
        handle[np.array([True, False, True, False])]
    with pytest.raises(ls.CheckpointError, match="step cannot be zero"):
        handle[::0]
    assert handle[..., 1].tolist() == [1.0, 6.0, 11.0, 16.0]
    ck.close()
    for read in (lambda: handle[0], lambda: handle.read(), lambda: ck["fc.bias"]):
        with pytest.raises(ls.CheckpointError, match="was closed"):
            read()


def test_a_name_that_is_no_string_is_a_missing_tensor(tmp_path, suffix) -> None:
    """``ck[0]`` and ``0 in ck`` raised a raw TypeError ("'int' object is not iterable", from
    the close-match hint); a checkpoint is a mapping of names: a KeyError, and False."""
    ls.save({"a": np.arange(3.0)}, tmp_path / f"m{suffix}")
    with ls.open(tmp_path / f"m{suffix}") as ck:
        for key in (0, None, b"a", ("a",), ["a"]):
            with pytest.raises(ls.TensorNotFoundError, match="names are strings"):
                ck[key]
            assert key not in ck and ck.get(key) is None
        with pytest.raises(KeyError):
            ck[0]
        assert "a" in ck
