"""The save's digests of one-chunk datasets' headers and chunk indexes (stores/hdf5/
header_digests.py): an open takes a dataset whose bytes are those the save recorded without
parsing its header; anything else (a changed attribute, a relinked dataset, an edited manifest
or table, a repacked file, a file without the table) is checked as before."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.errors import IntegrityError
from lean_store.hardening import MAX_ATTR_BYTES
from lean_store.stores.hdf5 import checks, header_digests
from lean_store.stores.hdf5 import store as hdf5_store
from lean_store.stores.hdf5.checks import read_hdf5_attrs
from lean_store.stores.hdf5.header_digests import COLUMNS, DIGESTS_ATTR, MAX_COMPACT_ATTRS
from lean_store.stores.hdf5.manifest import MANIFEST_ATTR


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    state: dict[str, np.ndarray] = {}
    for i in range(12):  # like-shaped layers: vectors, matrices, a scalar, ints
        state[f"blocks.{i}.w"] = rng.standard_normal((16, 8), dtype=np.float32)
        state[f"blocks.{i}.b"] = rng.standard_normal(8, dtype=np.float32)
    state["step"] = np.array(7, np.int64)
    state["mask"] = np.array([True, False, True])
    state["big"] = rng.standard_normal(70_000, dtype=np.float32)  # several chunks
    return state


def _saved(tmp_path: Path, name: str = "ck.h5", **kw) -> tuple[Path, dict[str, np.ndarray]]:
    state = _state()
    path = tmp_path / name
    ls.save(state, path, chunk_bytes=64 << 10, **kw)
    return path, state


def _table(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f.attrs[DIGESTS_ATTR].reshape(-1, COLUMNS)


def _spy(monkeypatch) -> dict[str, list]:
    """Which path each dataset's open checks took."""
    seen: dict[str, list] = {"digest": [], "header": []}
    digest, header = (hdf5_store.HDF5Reader._stored_from_digest,
                      hdf5_store.HDF5Reader._stored_from_header)

    def spy_digest(self, node, record):
        found = digest(self, node, record)
        seen["digest"].append((node, found is not None))
        return found

    def spy_header(self, node, record):
        seen["header"].append(node)
        return header(self, node, record)

    monkeypatch.setattr(hdf5_store.HDF5Reader, "_stored_from_digest", spy_digest)
    monkeypatch.setattr(hdf5_store.HDF5Reader, "_stored_from_header", spy_header)
    return seen


def _load_exact(path: Path, state: dict[str, np.ndarray]) -> None:
    back = ls.load_state(path)
    assert list(back) == list(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k


def _hits(seen: dict[str, list]) -> set[str]:
    return {node for node, hit in seen["digest"] if hit}


def _covered(path: Path, state: dict[str, np.ndarray]) -> list[str]:
    """The nodes of ``state`` whose rows hold a digest. Most: a header libhdf5 spread over
    more than three chunks (a few in a thousand) is left to the header path."""
    rows = _table(path)[1:]
    return [hdf5_store.node_name(k) for k, row in zip(state, rows) if row[1]]


def test_a_save_records_every_one_chunk_dataset_and_an_open_takes_them(
        tmp_path: Path, monkeypatch) -> None:
    path, state = _saved(tmp_path)
    table = _table(path)
    assert table.shape == (len(state) + 1, COLUMNS)
    assert table[0, :2].tolist() == [header_digests.VERSION, len(state)]
    covered = _covered(path, state)
    single = {hdf5_store.node_name(k) for k in state if k != "big"}  # "big": several chunks
    assert set(covered) <= single and len(covered) >= 0.8 * len(single)
    seen = _spy(monkeypatch)
    _load_exact(path, state)
    assert _hits(seen) == set(covered)
    assert set(seen["header"]) == set(state) - set(covered)  # parsed as before
    ls.verify(path).raise_if_bad()


def test_chunk_zero_is_walked_once_per_plan(tmp_path: Path, monkeypatch) -> None:
    walked = []
    walk = header_digests._walk_chunk0

    def spy(*args):
        known = walk(*args)
        at = known.index_at  # the chunk index's address differs from dataset to dataset
        walked.append((args[4], known.prefix[:at], known.prefix[at + 8:]))
        return known

    monkeypatch.setattr(header_digests, "_walk_chunk0", spy)
    state = {f"l{i}.{k}": np.full(shape, i, np.float32)
             for i in range(50) for k, shape in (("w", (4, 4)), ("b", (4,)))}
    ls.save(state, tmp_path / "many.h5")
    assert {shape for shape, *_ in walked} == {(4,), (4, 4)}
    # each layout once: a new one comes only from the header's times ticking during the
    # save or from libhdf5 placing a message elsewhere (HDF5 1.14: the attribute info
    # message of some datasets in chunk 0, of others in a continuation chunk)
    assert len(walked) == len(set(walked)) < len(state) / 4
    assert len(_covered(tmp_path / "many.h5", state)) >= 0.8 * len(state)


def test_a_changed_attribute_misses_its_digest_and_is_named(tmp_path: Path,
                                                            monkeypatch) -> None:
    path, state = _saved(tmp_path)
    covered = _covered(path, state)
    node = next(n for n in covered if n.endswith(".b"))
    name = node[:-1] + "x"  # same length: only its bytes differ
    with h5py.File(path, "r+") as f:
        f[node].attrs.create("name", np.array(name.encode(), h5py.string_dtype("utf-8",
                                                                                 len(name))))
    seen = _spy(monkeypatch)
    with pytest.raises(IntegrityError, match="changed after the save"):
        ls.load_state(path)
    assert (node, False) in seen["digest"]
    assert len(_hits(seen)) == len(covered) - 1


def test_a_relinked_dataset_is_not_taken_from_the_digest(tmp_path: Path,
                                                         monkeypatch) -> None:
    """One vector's name made a second name of another vector (same shape): its link no
    longer leads to the header the save recorded for it."""
    path, state = _saved(tmp_path)
    one, two = [n for n in _covered(path, state) if n.endswith(".b")][:2]
    with h5py.File(path, "r+") as f:
        del f[one]
        f[one] = f[two]
    seen = _spy(monkeypatch)
    with pytest.raises(IntegrityError):
        ls.load_state(path)
    assert (one, False) in seen["digest"]
    assert (two, False) in seen["digest"]  # its header now counts two links: other bytes


@pytest.mark.parametrize("edit", ["manifest", "table", "removed"])
def test_a_table_not_bound_to_the_manifest_is_set_aside(tmp_path: Path, monkeypatch,
                                                        edit: str) -> None:
    path, state = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        if edit == "manifest":  # the same records, other bytes
            doc = json.loads(f.attrs[MANIFEST_ATTR])
            f.attrs[MANIFEST_ATTR] = np.bytes_(json.dumps(doc, indent=1).encode())
        elif edit == "table":  # one digest changed: the rows' CRC no longer holds
            table = f.attrs[DIGESTS_ATTR].copy()
            table[2 * COLUMNS - 1] ^= np.uint64(1)
            f.attrs[DIGESTS_ATTR] = table
        else:  # a file written before the table existed
            del f.attrs[DIGESTS_ATTR]
    seen = _spy(monkeypatch)
    _load_exact(path, state)
    assert not _hits(seen)
    assert len(seen["header"]) == len(state)


def test_a_copied_file_is_checked_from_its_headers(tmp_path: Path, monkeypatch) -> None:
    """Every object of a copy (as h5repack makes) lies elsewhere: the table copied with the
    root's attributes matches no dataset."""
    path, state = _saved(tmp_path)
    copy = tmp_path / "copy.h5"
    with h5py.File(path, "r") as src, h5py.File(copy, "w", libver="latest",
                                                  track_order=True) as dst:
        dst.create_dataset("padding", data=np.zeros(1000, np.uint8))
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        for name in src:
            src.copy(src[name], dst, name=name)
        del dst["padding"]
    seen = _spy(monkeypatch)
    _load_exact(copy, state)
    assert not _hits(seen)


def test_compressed_and_fletcher32_datasets_have_no_digest(tmp_path: Path) -> None:
    path, state = _saved(tmp_path, "z.h5", compression="weights")
    with h5py.File(path, "r") as f:
        assert DIGESTS_ATTR not in f.attrs  # no dataset of one unfiltered chunk
    _load_exact(path, state)
    path, state = _saved(tmp_path, "f.h5", checksum="fletcher32+crc32c")
    with h5py.File(path, "r") as f:
        assert DIGESTS_ATTR not in f.attrs
    _load_exact(path, state)


def test_the_table_is_an_attribute_every_reader_takes(tmp_path: Path) -> None:
    """A 1-D array of uint64 within the attribute size bound: what lean_store readers of
    earlier releases accept (they leave it aside); h5py and h5dump read it as numbers."""
    path, state = _saved(tmp_path)
    with h5py.File(path, "r") as f:
        raw = f.attrs[DIGESTS_ATTR]
        assert raw.dtype == np.uint64 and raw.ndim == 1
        assert raw.nbytes <= MAX_ATTR_BYTES
        attrs = read_hdf5_attrs(f, str(path))
    assert isinstance(attrs[DIGESTS_ATTR], np.ndarray)
    assert DIGESTS_ATTR in checks._ARRAY_ATTRS  # (named there without the import)


def test_a_dataset_with_attributes_outside_its_header_gets_no_row(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    datasets = header_digests.SingleChunkDatasets()
    with h5py.File(path, "r") as f:
        dsid = f[hdf5_store.node_name("blocks.0.b")].id
        place = datasets.add(((8,), (8,), 4))
        assert place is not None and datasets[0] is None  # its address not yet known
        datasets.addresses.append(h5py.h5o.get_info(dsid).addr)
        datasets.attributes[place[1]] = 12
        fd = f.id.get_vfd_handle()
        size = os.fstat(fd).st_size
        rows = header_digests.DigestRows(lambda n, at: os.pread(fd, n, at), size)
        dataset = datasets[0]
        assert dataset is not None
        row = rows.row(dataset)
        assert row is not None and row[:2] == [dataset[0], row[1]]
        datasets.attributes[0] = MAX_COMPACT_ATTRS + 1  # more than a header keeps
        dataset = datasets[0]
        assert dataset is not None and rows.row(dataset) is None
        assert rows.row((dataset[0], (9,), (9,), 4, 12)) is None  # not its shape
    assert header_digests.parse_table(np.zeros(3, np.uint64), "{}", 0) is None
