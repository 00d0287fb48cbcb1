"""A hostile ``master_manifest`` (docs/FORMAT.md 6.1.1) is refused with a typed error before any
of it is used: not JSON, nested too deep, another version, malformed records, duplicate nodes,
sizes that are not sizes, boxes of the wrong rank, sources outside the checkpoint's shard
files. One process, no torch."""

from __future__ import annotations

import json

import pytest

from lean_store.distributed.shard_spec import Box
from lean_store.errors import IntegrityError, UnsafeFileError
from lean_store.stores.hdf5.master_manifest import (
    master_differences,
    master_manifest_text,
    parse_master_manifest,
    record_json,
)

GOOD_SOURCE = (Box((0, 0), (2, 3)), "shard-00000-of-00002.h5", "/t000000-s00000")


def _text(**changes) -> str:
    record = record_json("w", {"name": "w", "shape": (4, 3), "shards": "[]"}, (4, 3),
                         [GOOD_SOURCE, (Box((2, 0), (2, 3)), "shard-00001-of-00002.h5",
                                        "/t000000-s00001")])
    record.update(changes)
    return master_manifest_text([record])


def test_a_good_manifest_parses_to_records() -> None:
    (record,) = parse_master_manifest(_text(), "m").values()
    assert record.node == "w" and record.stored_shape == (4, 3)
    assert record.attrs["shape"] == (4, 3)  # lists come back as tuples, as read from HDF5
    assert record.sources[0] == GOOD_SOURCE


@pytest.mark.parametrize("text,error,words", [
    ("{", IntegrityError, "not valid JSON"),
    (123, IntegrityError, "not a string"),
    ('{"version": 2, "tensors": []}', IntegrityError, "version"),
    ('{"version": 1}', IntegrityError, "no list of tensors"),
    ('{"version": 1, "tensors": [' + "[" * 10 + "]" * 10 + "]}", UnsafeFileError, "nested"),
    ('{"version": 1, "tensors": [{"node": "w"}]}', IntegrityError, "malformed"),
])
def test_malformed_documents_are_refused(text, error, words) -> None:
    with pytest.raises(error, match=words):
        parse_master_manifest(text, "m")


@pytest.mark.parametrize("changes,error,words", [
    ({"stored_shape": [4, -3]}, IntegrityError, "not a list of sizes"),
    ({"stored_shape": [4.0, 3]}, IntegrityError, "not a list of sizes"),
    ({"stored_shape": [4]}, IntegrityError, "offsets"),  # the sources' boxes are 2-D
    ({"attrs": []}, IntegrityError, "malformed"),
    ({"sources": [{"offsets": [0, 0], "lengths": [4, 3], "file": "../evil.h5",
                   "dataset": "/t000000-s00000"}]}, UnsafeFileError, "not a shard"),
    ({"sources": [{"offsets": [0, 0], "lengths": [4, 3], "file": "shard-00000-of-00002.h5",
                   "dataset": "/etc"}]}, UnsafeFileError, "not a shard"),
    ({"sources": [{"offsets": [0, 0], "lengths": [4, 3], "file": "shard-00000-of-00002.h5",
                   "dataset": "/t000000-s00000", "extra": 1}]}, IntegrityError, "malformed"),
])
def test_malformed_records_are_refused(changes, error, words) -> None:
    with pytest.raises(error, match=words):
        parse_master_manifest(_text(**changes), "m")


def test_duplicate_nodes_are_refused() -> None:
    doc = json.loads(_text())
    doc["tensors"].append(doc["tensors"][0])
    with pytest.raises(IntegrityError, match="unique"):
        parse_master_manifest(json.dumps(doc), "m")


def test_a_dataset_that_differs_from_its_record_is_named() -> None:
    (record,) = parse_master_manifest(_text(), "m").values()
    same = master_differences(record, dict(record.attrs), (4, 3), list(record.sources))
    assert same == []
    attrs = {**record.attrs, "name": "x"}
    attrs.pop("shards")
    problems = master_differences(record, {**attrs, "extra": 1}, (4, 4),
                                  list(reversed(record.sources)))
    text = "; ".join(problems)
    assert "attribute name is 'x'" in text and "shards is missing" in text
    assert "extra was not written" in text and "shape (4, 4)" in text
    assert "virtual mappings differ" in text
