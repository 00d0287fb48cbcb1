"""A local Zarr save opens no zarr group unless an array goes through zarr (issue 15: the fixed
costs of a save): the temporary directory is made with one ``mkdir`` and lean_store's own
layouts write every document, the root's last. An array that zarr must create opens the group
late, in a directory already holding the directly written arrays; the store is the same."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import through_zarr_python

import lean_store as ls
from lean_store.stores.zarr import store as zarr_store

RNG = np.random.default_rng(15)
STATE = {
    "a": RNG.standard_normal((40, 8), dtype=np.float32),
    "b": RNG.integers(-5, 5, 9, dtype=np.int16),
    "c": RNG.standard_normal((77, 32), dtype=np.float32),  # sharded at chunk_bytes=1024
    "d": np.arange(6, dtype=np.float64),
}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _root(files: dict[str, bytes]) -> dict:
    doc = json.loads(files.pop("zarr.json"))
    doc["attributes"]["save_id"] = ""
    return doc


def test_direct_save_opens_no_zarr_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("zarr.open_group called by a save of lean_store's own layout")

    with monkeypatch.context() as m:
        m.setattr(zarr, "open_group", refuse)
        ls.save(STATE, tmp_path / "ck.zarr", chunk_bytes=1024)
    group = zarr.open_group(tmp_path / "ck.zarr", mode="r")  # stock zarr reads it alone
    for name, value in STATE.items():
        np.testing.assert_array_equal(group[name][...], value)
    assert group.attrs["complete"] is True
    assert ls.verify(tmp_path / "ck.zarr").ok


def test_save_of_one_empty_tensor(tmp_path: Path) -> None:
    """No chunk file is written: the array's folder and documents still are, and the root."""
    ls.save({"e": np.zeros((0, 4), np.float32)}, tmp_path / "e.zarr")
    root = json.loads((tmp_path / "e.zarr" / "zarr.json").read_text())
    assert root["node_type"] == "group" and root["attributes"]["complete"] is True
    assert zarr.open_group(tmp_path / "e.zarr", mode="r")["e"].shape == (0, 4)
    assert ls.load_state(tmp_path / "e.zarr")["e"].shape == (0, 4)
    assert ls.verify(tmp_path / "e.zarr").ok


def test_group_opened_late_among_direct_arrays(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays "a", "b" written directly, then "c" through zarr's create_array (its group
    opened only then, beside them), then "d" directly: every file equals the stock save's."""
    real = zarr_store.plain_array_document

    def all_but_c(shape, dtype, chunks, shards, attrs, *rest):
        return None if attrs.get("name") == "c" else real(shape, dtype, chunks, shards, attrs,
                                                         *rest)

    opened = []
    real_open = zarr.open_group

    def counting(*args, **kwargs):
        opened.append(kwargs.get("mode"))
        return real_open(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(zarr_store, "plain_array_document", all_but_c)
        m.setattr(zarr, "open_group", counting)
        ls.save(STATE, tmp_path / "mixed.zarr", chunk_bytes=1024)
    assert opened == ["a"]  # once, when "c" needed zarr
    with monkeypatch.context() as m:  # everything through zarr, as zarr-python writes it
        through_zarr_python(m)
        ls.save(STATE, tmp_path / "stock.zarr", chunk_bytes=1024)
    mixed, stock = _files(tmp_path / "mixed.zarr"), _files(tmp_path / "stock.zarr")
    assert _root(mixed) == _root(stock)
    assert sorted(mixed) == sorted(stock)
    assert [k for k in mixed if mixed[k] != stock[k]] == []
    loaded = ls.load_state(tmp_path / "mixed.zarr")
    for name, value in STATE.items():
        assert np.asarray(loaded[name]).tobytes() == value.tobytes(), name
    assert ls.verify(tmp_path / "mixed.zarr").ok
