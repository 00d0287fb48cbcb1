"""Zarr across releases and stores: one module touches zarr internals, lean_store reads what
zarr.open_group takes, and a missing chunk is damage on every read path (issue 11, items 5,
11 and 15)."""

from __future__ import annotations

import ast
import shutil
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
import zarr.storage
from helpers import without_save_id
from zarr.buffer import cpu

import lean_store as ls
from lean_store.chunking import touched_cells
from lean_store.errors import IntegrityError
from lean_store.stores.zarr import compat as zarr_compat

PACKAGE = Path(ls.__file__).parent
COMPAT = PACKAGE / "stores" / "zarr" / "compat.py"
ROWS, COLS = 64, 16
CHUNK_BYTES = 1024  # 16 rows of 16 (re, im) bfloat16 pairs per chunk: 4 chunks, unsharded
FMT = ls.formats.complex_of("bfloat16")  # no numpy dtype: stored as raw word pairs


def _state() -> dict[str, ls.Encoded]:
    grid = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    return {"z": ls.Encoded.from_values((grid + 1j * -grid).astype(np.complex64), FMT)}


def _save(tmp_path: Path, **kw) -> tuple[Path, ls.Encoded]:
    state = _state()
    path = tmp_path / "c.zarr"
    ls.save(state, path, chunk_bytes=CHUNK_BYTES, **kw)
    return path, state["z"]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}



class SubclassedLocalStore(zarr.storage.LocalStore):
    """A LocalStore with behaviour of its own: read through zarr, not straight from disk."""


def _as_store(kind: str, root: Path, tmp_path: Path):
    """The store at ``root`` as ``kind`` presents it to ``ls.open``."""
    if kind == "path":
        return root
    if kind == "url":
        return "file://" + str(root)
    if kind == "local_store":
        return zarr.storage.LocalStore(root, read_only=True)
    if kind == "subclassed_local_store":
        return SubclassedLocalStore(root, read_only=True)
    if kind == "memory":
        return zarr.storage.MemoryStore(
            {k: cpu.Buffer.from_bytes(v) for k, v in _files(root).items()}, read_only=True
        )
    if kind == "zip":
        zpath = tmp_path / "c.zip"
        with zipfile.ZipFile(zpath, "w") as zf:
            for key, data in _files(root).items():
                zf.writestr(key, data)
        return zarr.storage.ZipStore(zpath, mode="r")
    raise AssertionError(kind)


STORES = ["path", "url", "local_store", "subclassed_local_store", "memory", "zip"]


# ------------------------------------------------------------------ item 11: what open takes


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("backend", [None, "zarr"])
def test_open_takes_what_zarr_open_group_takes(tmp_path: Path, kind: str, backend) -> None:
    root, expected = _save(tmp_path)
    store = _as_store(kind, root, tmp_path)
    zarr.open_group(store=store, mode="r", zarr_format=3)  # zarr itself takes it
    with ls.open(store, backend=backend) as ck:
        assert ck.backend == "zarr"
        part = ck["z"][20:40:3, 5:9]
        np.testing.assert_array_equal(part.bits, expected.bits[20:40:3, 5:9])
        np.testing.assert_array_equal(ck["z"].read().bits, expected.bits)
    loaded = ls.load_state(store)
    np.testing.assert_array_equal(loaded["z"].bits, expected.bits)


def test_open_of_a_compressed_store_object(tmp_path: Path) -> None:
    root, expected = _save(tmp_path, compression="zstd")
    with ls.open(zarr.storage.LocalStore(root, read_only=True)) as ck:
        np.testing.assert_array_equal(ck["z"][33:35].bits, expected.bits[33:35])


# ---------------------------------------------- item 5: a missing chunk is damage, every path


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_missing_chunk_of_word_pair_complex_is_damage(tmp_path: Path, kind: str,
                                                       compression) -> None:
    root, _ = _save(tmp_path, compression=compression)
    victim = root / "z" / "c.1.0.0"  # rows 16..31: key has the (re, im) axis
    assert victim.is_file()
    victim.unlink()
    store = _as_store(kind, root, tmp_path)
    with pytest.raises(IntegrityError, match="missing"):
        with ls.open(store) as ck:
            ck["z"][20:22, 3:5]  # a partial read inside the missing chunk
    with pytest.raises(IntegrityError, match="missing"):
        ls.load_state(store)


def _drop_hdf5_chunk(path: Path, node: str, chunk_offset: tuple[int, ...]) -> None:
    """Rebuild dataset ``node`` with every chunk but the one at ``chunk_offset``."""
    with h5py.File(path, "r+") as f:
        ds = f[node]
        dcpl = ds.id.get_create_plist()
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_INCR)  # lean_store allocates every chunk early
        tmp = h5py.h5d.create(f.id, b"rebuilt", ds.id.get_type(), ds.id.get_space(), dcpl=dcpl)
        for i in range(ds.id.get_num_chunks()):
            info = ds.id.get_chunk_info(i)
            if tuple(info.chunk_offset) == chunk_offset:
                continue
            mask, raw = ds.id.read_direct_chunk(info.chunk_offset)
            tmp.write_direct_chunk(info.chunk_offset, raw, mask)
        attrs = dict(ds.attrs)
        del f[node]
        f.move("rebuilt", node)
        for key, value in attrs.items():
            f[node].attrs[key] = value


def test_missing_chunk_of_word_pair_complex_is_damage_in_hdf5(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "c.h5"
    ls.save(state, path, chunk_bytes=CHUNK_BYTES)
    with ls.open(path) as ck:
        chunks = ck["z"].chunks
    _drop_hdf5_chunk(path, "z", (chunks[0],) + (0,) * (len(chunks) - 1))
    with pytest.raises(IntegrityError, match="chunks are present"):
        with ls.open(path) as ck:
            ck["z"][chunks[0] + 1]
    assert not ls.verify(path).ok


def test_touched_cells_cover_the_trailing_pair_axis() -> None:
    # selection over the tensor's two axes; the stored array has a third (re, im) axis
    cells = list(touched_cells((20, 3), (2, 2), (1, 1), (16, 16, 2), (64, 16, 2)))
    assert cells == [(1, 0, 0)]
    assert list(touched_cells((0,), (0,), (1,), (4, 2), (8, 2))) == []
    strided = list(touched_cells((1, 0), (3, 16), (30, 1), (16, 16), (64, 16)))
    assert strided == [(0, 0), (1, 0), (3, 0)]  # rows 1, 31, 61
    with pytest.raises(ValueError):
        list(touched_cells((0,), (1,), (1,), (4,), (8, 2)))


# ---------------------------------------------------- item 15: zarr internals in one module


def _zarr_internal_uses(path: Path) -> list[str]:
    """``zarr.core`` / private-name imports and ``zarr.core`` attribute chains in ``path``."""
    uses = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "zarr":
            private = [a.name for a in node.names if a.name.startswith("_")]
            if node.module.startswith("zarr.core") or private or ".codecs." in node.module:
                uses.append(f"{path.name}:{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import):
            uses += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                     if a.name.startswith("zarr.core") or a.name.startswith("zarr.codecs.")]
        elif isinstance(node, ast.Attribute) and node.attr == "core" and \
                isinstance(node.value, ast.Name) and node.value.id == "zarr":
            uses.append(f"{path.name}:{node.lineno} zarr.core")
    return uses


def test_zarr_internals_are_used_in_one_module_only() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        uses = _zarr_internal_uses(path)
        if uses:
            offenders[path.relative_to(PACKAGE).as_posix()] = uses
    assert offenders == {}
    assert _zarr_internal_uses(COMPAT)  # the one place that probes


def test_load_without_regular_chunk_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """zarr >= 3.2 has no ``zarr.core.chunk_grids.RegularChunkGrid``: loading must not need it.
    (zarr 3.1 itself still uses the class, so only lean_store's imports of it are refused.)"""
    import builtins

    real_import = builtins.__import__

    def import_as_zarr_3_2(name, globals=None, locals=None, fromlist=(), level=0):
        caller = (globals or {}).get("__name__", "")
        if caller.startswith("lean_store") and "RegularChunkGrid" in (fromlist or ()):
            raise ImportError("cannot import name 'RegularChunkGrid' (zarr >= 3.2)")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", import_as_zarr_3_2)
    root, expected = _save(tmp_path)
    big = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)  # sharded: 8+ chunks
    ls.save({"w": big}, tmp_path / "w.zarr", chunk_bytes=4096)
    np.testing.assert_array_equal(ls.load_state(root)["z"].bits, expected.bits)
    np.testing.assert_array_equal(ls.load_state(tmp_path / "w.zarr")["w"], big)
    assert ls.verify(tmp_path / "w.zarr").ok


def test_grid_and_keys_read_from_the_spec_document(tmp_path: Path) -> None:
    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w", zarr_format=3)
    sharded = group.create_array("s", shape=(40, 6), dtype="u2", chunks=(4, 6), shards=(16, 6))
    v2_keys = group.create_array("v", shape=(5, 3), dtype="u1", chunks=(2, 3),
                                 chunk_key_encoding={"name": "v2", "separator": "."})
    assert zarr_compat.regular_grid(sharded) == (16, 6)
    assert tuple(zarr_compat.sharding_document(sharded)["chunk_shape"]) == (4, 6)
    assert zarr_compat.sharding_document(v2_keys) is None
    assert zarr_compat.chunk_key(sharded, (2, 0)) == "c/2/0"
    assert zarr_compat.chunk_key(v2_keys, (2, 0)) == "2.0"


class _NoEncoder:
    """An array whose metadata lacks ``encode_chunk_key``: the spec's encodings apply."""

    def __init__(self, array) -> None:
        self._doc = array.metadata.to_dict()
        self.metadata = self

    def to_dict(self):
        return self._doc


def test_chunk_key_fallback_matches_zarr(tmp_path: Path) -> None:
    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w", zarr_format=3)
    for i, encoding in enumerate([{"name": "default", "separator": "/"},
                                  {"name": "default", "separator": "."},
                                  {"name": "v2", "separator": "."},
                                  {"name": "v2", "separator": "/"}]):
        array = group.create_array(f"a{i}", shape=(9, 4), dtype="u1", chunks=(2, 4),
                                   chunk_key_encoding=encoding)
        for coords in [(0, 0), (4, 0), (3, 1)]:
            assert zarr_compat.chunk_key(_NoEncoder(array), coords) == \
                array.metadata.encode_chunk_key(coords)


def test_store_exists_without_zarrs_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, expected = _save(tmp_path)
    monkeypatch.setattr(zarr_compat, "_SYNC", None)  # a zarr without zarr.core.sync.sync
    store = zarr.storage.MemoryStore(
        {k: cpu.Buffer.from_bytes(v) for k, v in _files(root).items()}, read_only=True
    )
    assert zarr_compat.store_has(store, "z/c.0.0.0")
    assert not zarr_compat.store_has(store, "z/c.0.0")
    with ls.open(store) as ck:
        np.testing.assert_array_equal(ck["z"][3:5].bits, expected.bits[3:5])


def test_stock_crc_codec_when_the_encoder_hook_is_gone(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Where zarr lacks the private hook the fast encoder overrides, the stock codec writes the
    same bytes."""
    state = {"w": np.arange(300, dtype=np.float32).reshape(30, 10)}
    ls.save(state, tmp_path / "fast.zarr", compression="zstd")
    monkeypatch.setattr(zarr_compat, "LEAN_ENCODER", False)
    assert type(zarr_compat.crc32c_codec()) is zarr.codecs.Crc32cCodec
    ls.save(state, tmp_path / "stock.zarr", compression="zstd")
    assert without_save_id(_files(tmp_path / "fast.zarr")) == \
        without_save_id(_files(tmp_path / "stock.zarr"))
    np.testing.assert_array_equal(ls.load_state(tmp_path / "stock.zarr")["w"], state["w"])


def test_lean_encoder_is_used_where_the_hook_exists() -> None:
    # zarr 3.1.x (later patches) to 3.4 encode crc32c through _encode_sync(chunk_bytes,
    # chunk_spec); zarr 3.1.0 only has the async _encode_single: the stock codec is used there
    hook = getattr(zarr.codecs.Crc32cCodec, "_encode_sync", None)
    assert zarr_compat.LEAN_ENCODER == (hook is not None)
    expected = zarr_compat.LeanCrc32cCodec if hook is not None else zarr.codecs.Crc32cCodec
    assert type(zarr_compat.crc32c_codec()) is expected


# --------------------------------------------------------- declared dependencies (item 15)


def _module_level_imports() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level: needed to import it
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"lean_store", "__future__"}


def test_every_imported_distribution_is_declared() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    optional = [r for extra, reqs in project["optional-dependencies"].items()
                if not extra.startswith("test") for r in reqs]
    declared, required = set(), set()
    for requirement in project["dependencies"] + optional:
        name = requirement.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        name = name.strip().lower().replace("-", "_")
        declared.add(name)
        if requirement in project["dependencies"]:
            required.add(name)
    assert _module_level_imports() <= declared
    # google_crc32c (zarr's own) for short buffers, crc32c (releases the GIL) for long ones
    assert {"numcodecs", "google_crc32c", "crc32c", "zarr", "h5py", "numpy"} <= required


def test_one_module_chooses_the_crc_library() -> None:
    """Only lean_store.integrity imports ``crc32c``: every other CRC-32C of a long buffer
    goes through ``integrity.crc32c_extend``, which falls back to google_crc32c."""
    import re

    importers = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                 if re.search(r"^\s*(?:import crc32c|from crc32c)\b", p.read_text(),
                              re.MULTILINE)]
    assert importers == ["integrity.py"]


def test_shutil_roundtrip_of_the_whole_store_is_exact(tmp_path: Path) -> None:
    """A store copied file by file is read the same through every opener (sanity for the
    stores above: they see the bytes ls.save wrote)."""
    root, expected = _save(tmp_path)
    copy = tmp_path / "copy.zarr"
    shutil.copytree(root, copy)
    np.testing.assert_array_equal(ls.load_state(copy)["z"].bits, expected.bits)


def test_requires_python_admits_no_python_the_minimum_dependencies_refuse() -> None:
    """Every dependency installed at pyproject's lower bound (all of them in ./dev test's
    oldest run) supports the oldest Python pyproject claims: zarr 3.1 needs Python >= 3.11."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    claimed = SpecifierSet(project["requires-python"])
    oldest = min((Version(f"3.{minor}") for minor in range(30) if f"3.{minor}.0" in claimed),
                 default=None)
    assert oldest is not None and oldest >= Version("3.11")
    checked = []
    for line in project["dependencies"]:
        req = Requirement(line)
        floor = next((Version(s.version) for s in req.specifier if s.operator == ">="), None)
        installed = Version(md.version(req.name))
        assert floor is not None and installed >= floor, req.name
        needs = md.metadata(req.name).get("Requires-Python")
        if installed == floor and needs:
            assert f"{oldest}.0" in SpecifierSet(needs), (req.name, needs)
            checked.append(req.name)
    assert sys.version_info >= (oldest.major, oldest.minor)
