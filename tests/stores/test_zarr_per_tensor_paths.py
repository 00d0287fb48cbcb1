"""Issue 13's per-tensor shortcuts on the Zarr paths give what the general code gives: an
array document's one-pass encoding (same bytes as ``json.dumps(indent=...)``, whatever the
attributes hold), plain documents being the direct layout, a plain array's chunk file names
and the one-chunk listing of its files; a damaged one-chunk file is still refused."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
import zarr

import lean_store as ls
from lean_store.errors import IntegrityError
from lean_store.stores.zarr import compat
from lean_store.stores.zarr.compat import (
    json_document_bytes,
    key_of_document,
    plain_array_document,
)
from lean_store.stores.zarr.direct_write import direct_ok
from lean_store.stores.zarr.plain import PlainArray, plain_array

DTYPES = ("bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64",
          "complex64", "complex128")


def _reference(doc: dict) -> bytes:
    return json.dumps(doc, indent=zarr.config.get("json_indent"), allow_nan=True).encode()


ODD_ATTRIBUTES = [
    {},
    {"index": 3, "name": "blocks.0.ln1.weight", "shape": [2, 3], "crc32c": 4294967295},
    {"name": "naïve\u2603 \"quoted\" \\ tab\t", "flag": True, "off": False, "none": None},
    {"nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"), "tiny": 5e-324,
     "big": 1e300, "neg": -0.0},
    {"empty": [], "nested": {"a": [1, [2, {}]], "b": {}}, "strs": ["x", "y"],
     "mixed": [1, "a", 2.5, None, True]},
    {"shape": [], "width": 0, "bias": -127},
]


@pytest.mark.parametrize("attrs", ODD_ATTRIBUTES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shards", [None, (64, 3)])
def test_array_document_text_is_json_dumps(attrs: dict, dtype: str,
                                           shards: tuple[int, ...] | None) -> None:
    doc = plain_array_document((128, 3), np.dtype(dtype), (8, 3), shards, attrs,
                               ["a.dim_0", "a.dim_1"])
    assert doc is not None
    for _ in range(2):  # the second time from the memoised members
        assert json_document_bytes(doc) == _reference(doc)


def test_other_documents_take_the_general_encoder() -> None:
    doc = plain_array_document((4,), np.dtype("float32"), (4,), None, {"a": 1}, ["x"])
    assert doc is not None
    variants = [
        {**doc, "storage_transformers": [{"name": "t"}]},  # not the plain layout
        {k: doc[k] for k in reversed(list(doc))},  # another key order
        {**doc, "extra": 1},
        {**doc, "zarr_format": True},
    ]
    odd_members = [  # the array's key order: unusual members go to the general encoder
        {**doc, "attributes": []},
        {**doc, "dimension_names": None},
        {**doc, "shape": [True, 2]},
    ]
    for variant in variants:
        assert compat._array_text(variant, "  ") is None
        assert json_document_bytes(variant) == _reference(variant)
    for variant in odd_members:
        assert compat._array_text(variant, "  ") is not None
        assert json_document_bytes(variant) == _reference(variant)
    odd_key = {**doc, "attributes": {1: 2}}  # json.dumps writes the key as a string
    assert json_document_bytes(odd_key) == _reference(odd_key)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_documents_are_the_direct_layout(dtype: str) -> None:
    """The writer skips ``direct_ok`` for documents built without a compressor."""
    for shape, chunks, shards in (((5,), (5,), None), ((64, 2), (8, 2), (64, 2))):
        doc = plain_array_document(shape, np.dtype(dtype), chunks, shards, {}, ["a", "b"][
            : len(shape)])
        assert doc is not None and direct_ok(doc)


def test_plain_chunk_keys_match_the_documents_encoding(tmp_path: Path) -> None:
    state = {"one": np.arange(6, dtype=np.float32).reshape(2, 3),
             "rows": np.arange(3 * 1024 * 1024 // 4, dtype=np.float32).reshape(-1, 256),
             "scalar": np.float64(2.5)}
    path = tmp_path / "k.zarr"
    ls.save(state, path, chunk_bytes=1 << 20)
    for node in ("one", "rows", "scalar"):
        doc = json.loads((path / node / "zarr.json").read_text())
        grid = doc["chunk_grid"]["configuration"]["chunk_shape"]
        cells = [range(-(-d // g)) for d, g in zip(doc["shape"], grid)]
        for coords in np.ndindex(*[len(c) for c in cells]):
            assert (path / node / key_of_document(doc, coords)).is_file()
    got = ls.load_state(path)
    for name, value in state.items():
        np.testing.assert_array_equal(got[name], value)
    group = zarr.open_group(str(path), mode="r")  # stock zarr finds every chunk
    np.testing.assert_array_equal(group["rows"][:], state["rows"])


@pytest.mark.parametrize("shape,chunks,shards", [
    ((5,), (5,), None), ((2, 3, 4), (2, 3, 4), None), ((10, 4), (3, 4), None),
    ((64, 2), (8, 2), (32, 2)), ((1,), (1,), None),
])
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("sep", [".", "/"])  # "/": checkpoints written before 2026-12-05
def test_one_chunk_listing_matches_the_grid_walk(shape: tuple[int, ...], chunks: tuple[int, ...],
                                                 shards: tuple[int, ...] | None,
                                                 compressed: bool, sep: str) -> None:
    array = PlainArray("n", {}, shape, np.dtype("float32"), chunks, shards, compressed, sep)
    got = list(array.files())
    grid = [-(-d // g) for d, g in zip(shape, shards or chunks)]
    keys = [f"n/c{sep}{sep.join(map(str, c))}" for c in np.ndindex(*grid)]
    assert [k for k, _c, _s in got] == keys
    assert [c for _k, c, _s in got] == list(np.ndindex(*grid))
    if not compressed and shards is None:
        assert {s for _k, _c, s in got} == {int(np.prod(chunks)) * 4 + 4}


def test_plain_array_of_a_saved_one_chunk_tensor(tmp_path: Path) -> None:
    path = tmp_path / "p.zarr"
    ls.save({"w": np.ones((3, 4), np.float32)}, path)
    doc = json.loads((path / "w" / "zarr.json").read_text())
    array = plain_array("w", doc)
    assert array is not None
    assert list(array.files()) == [("w/c.0.0", (0, 0), 3 * 4 * 4 + 4)]


@pytest.mark.parametrize("damage", ["truncate", "extend", "remove"])
def test_damaged_one_chunk_file_is_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "d.zarr"
    ls.save({"a": np.arange(12, dtype=np.float32), "b": np.ones(3, np.float32)}, path)
    chunk = path / "a" / "c.0"
    if damage == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:-1])
    elif damage == "extend":
        chunk.write_bytes(chunk.read_bytes() + b"\0")
    else:
        os.remove(chunk)
    with pytest.raises(IntegrityError, match="'a'"):
        ls.load_state(path)


def test_tampered_array_document_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.zarr"
    ls.save({"a": np.arange(12, dtype=np.float32)}, path)
    own = path / "a" / "zarr.json"
    doc = json.loads(own.read_text())
    doc["attributes"]["name"] = "b"
    own.write_text(json.dumps(doc, indent=2))
    with pytest.raises(IntegrityError, match="disagrees with its copy"):
        ls.load_state(path)


def test_documents_like_a_known_plain_one_get_the_same_verdict_as_rebuilt() -> None:
    """:func:`plain_array` compares a document with one of its kind found plain before
    (all members but shape, attributes and names); any other difference, or a change to the
    first document after it was taken, still gets the verdict of the rebuilt document."""
    from lean_store.stores.zarr import plain

    plain._KNOWN.clear()
    first = plain_array_document((6, 3), np.dtype("float32"), (2, 3), None, {"a": 1}, ["x", "y"])
    assert first is not None
    described = plain_array("w", first)
    assert described is not None and plain._KNOWN
    other = {**copy.deepcopy(first), "shape": [9, 3], "attributes": {"b": 2},
             "dimension_names": ["p", "q"]}
    again = plain_array("v", other)
    assert again is not None and again.shape == (9, 3) and again.attrs == {"b": 2}
    assert (again.chunks, again.shards, again.separator) == ((2, 3), None, ".")
    first["codecs"].pop()  # the holder changes its document: the known one is a copy
    assert plain_array("w", first) is None
    assert plain_array("v", other) is not None
    refused = [
        {**other, "codecs": [{"name": "bytes", "configuration": {"endian": "big"}},
                             {"name": "crc32c"}]},
        {**other, "fill_value": 1.0},
        {**other, "extra": 1},
        {**other, "chunk_key_encoding": {"name": "default", "configuration": {"separator": "-"}}},
        {**other, "shape": [9, 3, 1]},  # another rank than its chunks
        {**other, "shape": [9, -3]},
        {**other, "attributes": [1]},
        {**other, "dimension_names": ["p", 1]},
        {k: v for k, v in other.items() if k != "storage_transformers"},
    ]
    for doc in refused:
        assert plain_array("v", doc) is None, doc
    renamed = {k: v for k, v in other.items() if k != "zarr_format"}
    renamed["zarr_format "] = 3  # as many members, one of another name
    assert plain_array("v", renamed) is None
