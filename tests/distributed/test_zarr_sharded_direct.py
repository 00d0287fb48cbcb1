"""Sharded Zarr saves to a local store write metadata and chunk files directly (issue 13): every
file is byte for byte what the same save through zarr's own calls writes (the fsspec URL path),
stock zarr reads it, and compressed stores keep zarr's path. One process, no torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from lean_store.chunking import iter_regions
from lean_store.distributed.plan import make_plan, shard_records
from lean_store.stores.zarr import sharded as zarr_sharded

# (name, shape, format, numpy dtype of the stored words, boxes of rank 0 and rank 1)
TENSORS = [
    ("rows", [512, 6], "float32", np.uint32, [[[0, 0], [256, 6]], [[256, 0], [256, 6]]]),
    ("cols", [64, 512], "float32", np.uint32, [[[0, 0], [64, 256]], [[0, 256], [64, 256]]]),
    ("edge", [1000, 3], "bfloat16", np.uint16, [[[0, 0], [512, 3]], [[512, 0], [488, 3]]]),
    ("pair", [600], "complex64", np.uint32, [[[0], [300]], [[300], [300]]]),
    ("odd", [4000], "float32", np.uint32, [[[0], [1999]], [[1999], [2001]]]),  # misaligned
    # chunks split the second axis and its edge chunk is partial: not a prefix, so zarr writes
    ("ragged", [64, 500], "float32", np.uint32, [[[0, 0], [64, 256]], [[0, 256], [64, 244]]]),
    ("same", [5], "int64", np.uint64, [[[0], [5]], [[0], [5]]]),  # replicated
]


def _plans():
    layout = [{"name": n, "shape": s, "format": f} for n, s, f, _, _ in TENSORS]
    descriptions = [{"layout": layout, "boxes": [t[4][r] for t in TENSORS]} for r in range(2)]
    return make_plan(descriptions)[1]


def _words(i: int, shape: list[int], words: type, pair: bool) -> np.ndarray:
    full = tuple(shape) + ((2,) if pair else ())
    rng = np.random.default_rng(i)
    return rng.integers(0, np.iinfo(words).max, size=full, dtype=words)


def _save(root: str, compression=None) -> list:
    plans = _plans()
    chunks = [zarr_sharded.chunk_plan(p, 4096) for p in plans]
    zarr_sharded.create_arrays(root, plans, chunks, compression)
    data = []
    for i, (plan, cp, t) in enumerate(zip(plans, chunks, TENSORS)):
        pair = plan.entry.format.words_per_value == 2
        words = _words(i, t[1], t[3], pair)
        data.append(words)
        for rank in (0, 1):  # each rank's own writer, as in a real save
            for _k, box in plan.owned(rank):
                sink = zarr_sharded.open_writer(root, plan, cp)
                unit = cp.chunks if cp.aligned else box.lengths
                for local in iter_regions(box.lengths, unit):
                    region = tuple(slice(s.start + o, s.stop + o)
                                   for s, o in zip(local, box.offsets))
                    sink.write(region, words[region])
    records = [shard_records(p, {k: [k, [1] * len(p.stored_shape)]
                                 for k in range(len(p.shards))}) for p in plans]
    zarr_sharded.finish(root, plans, records, {"format": "lean_store", "kind": "state"})
    return data


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_direct_files_equal_zarrs_own(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    direct, through_zarr = tmp_path / "direct", tmp_path / "zarr"
    direct.mkdir()
    through_zarr.mkdir()
    data = _save(str(direct))
    _save(f"file://{through_zarr}")
    got, want = _files(direct), _files(through_zarr)
    assert sorted(got) == sorted(want)
    for key in want:
        if key == "zarr.json":  # the root: zarr 3.1 orders the consolidated metadata's keys
            assert json.loads(got[key]) == json.loads(want[key])  # otherwise than later releases
        else:
            assert got[key] == want[key], key
    group = zarr.open_group(str(direct), mode="r")
    assert group.attrs["complete"] is True
    assert group.metadata.consolidated_metadata is not None
    for (name, _shape, fmt, _, _), words in zip(TENSORS, data):
        stored = group[name][...]
        if fmt == "complex64":
            assert np.array_equal(stored.view(np.uint32).reshape(words.shape), words)
        else:
            assert np.array_equal(stored.view(words.dtype).reshape(words.shape), words)
        assert "shards" in group[name].attrs


def test_the_direct_path_skips_zarr_for_aligned_uncompressed_arrays(tmp_path: Path,
                                                                  monkeypatch) -> None:
    calls = []
    real = zarr.open_array
    monkeypatch.setattr(zarr, "open_array", lambda *a, **k: calls.append(k["path"]) or real(
        *a, **k))
    monkeypatch.setattr(zarr_sharded.zarr, "open_array", zarr.open_array)
    _save(str(tmp_path / "s"))
    # only the misaligned tensor (written in turns) and the one whose partial edge chunks are
    # not a prefix of a full chunk go through zarr, once per rank
    assert calls == ["odd", "odd", "ragged", "ragged"]


def test_compressed_stores_keep_zarrs_path(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    data = _save(str(root), compression="zstd")
    group = zarr.open_group(str(root), mode="r")
    codecs = [c["name"] for c in group["rows"].metadata.to_dict()["codecs"]]
    assert "zstd" in codecs
    assert np.array_equal(group["rows"][...].view(np.uint32), data[0])
