"""An array's own ``zarr.json`` compared with its copy in the root as text first (issue 13).

lean_store writes the same text to the array's ``zarr.json`` and (re-indented) into the
root's consolidated metadata; a load compares the two texts and parses the array's document
only when they differ. Pinned here: the text path takes a fresh save without a parse, any other
text is parsed and compared as before (a tamper reported with the same error, at first read,
by ``verify`` and by ``load_state``), a document re-encoded by zarr-python with other
whitespace or key order still loads, and the root's walk parses exactly as ``json.loads``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import lean_store as ls
from lean_store.stores.zarr import store as zarr_store
from lean_store.stores.zarr.root_text import parse_root

STATE = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.arange(5, dtype=np.int64),
    "c": np.float64(2.5),
}
DISAGREES = r"'b': b/zarr.json disagrees with its copy in the consolidated metadata"


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of the array documents the reader parses (the text comparison failed)."""
    seen: list[str] = []
    real = zarr_store.parse_json

    def spy(raw: bytes, key: str) -> Any:
        seen.append(key)
        return real(raw, key)

    monkeypatch.setattr(zarr_store, "parse_json", spy)
    return seen


def _load_all(path: Path) -> None:
    out = ls.load_state(path)
    for name, value in STATE.items():
        np.testing.assert_array_equal(out[name], value)


def test_fresh_save_checked_without_parsing(tmp_path: Path, parses: list[str]) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    _load_all(path)
    with ls.open(path) as ck:
        ck.verify()
    assert parses == []


def _edit_byte(path: Path, node: str, old: bytes, new: bytes) -> None:
    doc = path / node / "zarr.json"
    raw = doc.read_bytes()
    assert raw.count(old) == 1
    doc.write_bytes(raw.replace(old, new))


def test_one_changed_byte_is_parsed_and_refused(tmp_path: Path, parses: list[str]) -> None:
    """A digit of the stored index changed: the text differs, the parse finds the values
    differ, and the error is the one the parse-only check gave."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    _edit_byte(path, "b", b'"index": 1,', b'"index": 7,')
    with ls.open(path) as ck:
        np.testing.assert_array_equal(ck["a"].read(), STATE["a"])
        with pytest.raises(ls.IntegrityError, match=DISAGREES):
            ck["b"].read()
    assert parses == ["b/zarr.json"]
    with ls.open(path) as ck, pytest.raises(ls.IntegrityError, match=DISAGREES):
        ck.verify()
    with pytest.raises(ls.IntegrityError, match=DISAGREES):
        ls.load_state(path)


def test_changed_whitespace_is_parsed_and_accepted(tmp_path: Path, parses: list[str]) -> None:
    """Other text, the same values: parsed, equal, loaded."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    doc = path / "b" / "zarr.json"
    doc.write_bytes(doc.read_bytes().replace(b"\n", b"\n ") + b"\n")
    _load_all(path)
    assert parses == ["b/zarr.json"]


@pytest.mark.parametrize("indent", [4, 0])
def test_rewritten_by_zarr_python_still_loads(tmp_path: Path, parses: list[str],
                                              indent: int) -> None:
    """zarr-python rewrites an array's document (an attribute set to its own value) with
    another indent: parsed, equal to the root's copy, loaded."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    before = (path / "b" / "zarr.json").read_bytes()
    with zarr.config.set({"json_indent": indent}):
        array = zarr.open_array(store=str(path), path="b", mode="r+", zarr_format=3)
        array.attrs.update({"index": array.attrs["index"]})
    assert (path / "b" / "zarr.json").read_bytes() != before
    _load_all(path)
    assert parses == ["b/zarr.json"]


def test_key_order_changed_still_loads(tmp_path: Path, parses: list[str]) -> None:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    doc = path / "a" / "zarr.json"
    doc.write_text(json.dumps(json.loads(doc.read_text()), indent=2, sort_keys=True))
    _load_all(path)
    assert parses == ["a/zarr.json"]


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
def test_reconsolidated_by_zarr_python_takes_the_text_path(tmp_path: Path,
                                                           parses: list[str]) -> None:
    """zarr's ``consolidate_metadata`` writes each member as the array's own text, indented
    at its depth: the text comparison holds there too."""
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    zarr.consolidate_metadata(str(path), zarr_format=3)
    _load_all(path)
    assert parses == []


ROOTS = [
    b'{"attributes": {"k": [1, 2.5, null]}, "zarr_format": 3, "consolidated_metadata": '
    b'{"kind": "inline", "metadata": {"x": {"q": 1}, "y": [1]}, "must_understand": false}, '
    b'"node_type": "group"}',
    b"{}",
    b' {\n "consolidated_metadata" :\t{ "metadata" : { } } }\r\n',
    b'{"consolidated_metadata": null}',
    b'{"consolidated_metadata": {"metadata": {"x": {}}}, '
    b'"consolidated_metadata": {"metadata": {"y": {"z": 1}}}}',
    b'{"k\\u00e9y": 1, "consolidated_metadata": {"metadata": {"n\\"q": {"a": 1}, "n": 2}}}',
    b'{"a": 1, "a": 2}',
    '{"n\u00e9": {"x": "\u00fc"}}'.encode(),
]
MALFORMED = [b'{"a": 1,}', b"{", b'{"a": 1} x', b'{"a" 1}', b'{"a": "\n"}', b"\xff{}",
             b'{"a": [1,]}']


@pytest.mark.parametrize("raw", ROOTS)
def test_root_parsed_as_json_loads(raw: bytes) -> None:
    assert parse_root(raw).doc == json.loads(raw)


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_root_refused_as_json_loads(raw: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(raw)
    with pytest.raises(ValueError):
        parse_root(raw)


def test_members_text_compared_at_their_depth() -> None:
    own = json.dumps({"q": [1, 2], "s": "t"}, indent=2)
    root = json.dumps({"consolidated_metadata": {"metadata": {"x": json.loads(own)}}},
                      indent=2).encode()
    text = parse_root(root)
    assert text.same_text("x", own.encode())
    assert not text.same_text("x", own.replace("1", "3").encode())
    assert not text.same_text("x", own.replace("\n", "\n ").encode())
    assert not text.same_text("y", own.encode())  # no such member
    # duplicated key: the last value counts, for the document and the text alike
    twice = root[:-2] + b', "consolidated_metadata": {"metadata": {"x": {"q": 9}}}}'
    text = parse_root(twice)
    assert text.doc["consolidated_metadata"]["metadata"]["x"] == {"q": 9}
    assert not text.same_text("x", own.encode())
    assert text.same_text("x", b'{"q": 9}')
