"""Chunk keys ``c.0.1`` (separator "."): every file of an array sits in the array's own folder.
Checkpoints written before 2026-12-05 (separator "/", ``c/0/1``) are still read through the
direct path, bit for bit, and verified."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import flip_bits, to_slash_layout

import lean_store as ls
from lean_store.stores.zarr.plain import plain_array

RNG = np.random.default_rng(1205)
STATE = {
    "w": RNG.standard_normal((77, 32), dtype=np.float32),  # 10 chunks of 1 KiB: sharded
    "rows": RNG.standard_normal((20, 32), dtype=np.float32),  # 3 chunks, one file each
    "conv": RNG.standard_normal((4, 2, 3, 3), dtype=np.float32),
    "b": RNG.standard_normal(5, dtype=np.float32),
    "c": (RNG.standard_normal(6) + 1j).astype(np.complex64),
    "s": np.float64(2.5),
}


def _same(loaded: dict, want: dict) -> None:
    assert sorted(loaded) == sorted(want)
    for name, value in want.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes(), name


@pytest.mark.parametrize("compression", [None, "weights"])
def test_new_saves_write_dot_keys_in_the_array_folder(tmp_path: Path,
                                                      compression: str | None) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path, chunk_bytes=1024, compression=compression)
    for name in STATE:
        array_dir = path / name
        doc = json.loads((array_dir / "zarr.json").read_text())
        assert doc["chunk_key_encoding"] == {"name": "default",
                                             "configuration": {"separator": "."}}
        entries = os.listdir(array_dir)
        assert all((array_dir / e).is_file() for e in entries), entries  # no folders
        assert sorted(e for e in entries if e != "zarr.json") == sorted(
            key[len(name) + 1:] for key, _c, _s in plain_array(name, doc).files())
    group = zarr.open_group(str(path), mode="r", zarr_format=3)  # stock zarr finds every chunk
    for name in ("w", "rows", "conv", "b"):
        assert np.array_equal(group[name][...], STATE[name]), name
    _same(ls.load_state(path), STATE)


@pytest.mark.parametrize("compression", [None, "weights"])
def test_slash_layout_of_earlier_saves_reads_through_the_direct_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str | None) -> None:
    path = tmp_path / "old.zarr"
    ls.save(STATE, path, chunk_bytes=1024, compression=compression)
    to_slash_layout(path)
    assert (path / "w" / "c" / "0" / "0").is_file() and not (path / "w" / "c.0.0").exists()
    group = zarr.open_group(str(path), mode="r", zarr_format=3)
    assert np.array_equal(group["w"][...], STATE["w"])  # what zarr-python sees

    def refuse(*args, **kwargs):
        raise AssertionError("the store was opened through zarr")

    monkeypatch.setattr(zarr, "open_group", refuse)
    monkeypatch.setattr(zarr, "open_array", refuse)
    _same(ls.load_state(path), STATE)
    with ls.open(path) as ck:
        ck.verify()
        assert np.array_equal(ck["w"][40:50, 3:9], STATE["w"][40:50, 3:9])
    # a damaged chunk at its "/" key is found and named
    flip_bits(path / "rows" / "c" / "1" / "0", 7, 0x20)
    with pytest.raises(ls.IntegrityError, match=r"'rows'.*chunk \(1, 0\)"):
        ls.load_state(path)


def test_a_document_with_another_separator_is_left_to_zarr(tmp_path: Path) -> None:
    """A separator other than "." or "/" (valid JSON, not a layout lean_store writes) is not
    taken for the direct layout."""
    path = tmp_path / "ck.zarr"
    ls.save({"b": STATE["b"]}, path)
    doc = json.loads((path / "b" / "zarr.json").read_text())
    assert plain_array("b", doc) is not None
    for odd in ("-", "", None, 1, ["."]):
        changed = {**doc, "chunk_key_encoding": {"name": "default",
                                                 "configuration": {"separator": odd}}}
        assert plain_array("b", changed) is None, odd
    assert plain_array("b", {**doc, "chunk_key_encoding": {"name": "default",
                                                            "configuration": "."}}) is None
    assert plain_array("b", {**doc, "chunk_key_encoding": "."}) is None
