"""Whether a directory holds a lean_store Zarr checkpoint is read from three members of its
root ``zarr.json`` (``stores/json_top.py``). The whole document was parsed with
``json.loads``: a save over a checkpoint of 50,000 tiny tensors built every array's
consolidated metadata twice (+255 MiB of peak RSS and ~3 s more than a save to a new path;
now +37-46 MiB, as a new path)."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls
from lean_store.errors import ForeignPathError
from lean_store.stores import target
from lean_store.stores.json_top import last_member, leading_members, top_level_members

WANTED = {"zarr_format", "node_type", "attributes"}


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -7, 3, 2**40, 1.5, -0.25])
    if kind in (2, 3):
        return rng.choice(["", "group", 'a "quoted" }', "node_type", "\u00e9\u4e2d", "\\"])
    if kind in (4, 5):
        keys = ["attributes", "zarr_format", "node_type", "x", "consolidated_metadata"]
        return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _documents() -> list[str]:
    rng = random.Random(7)
    docs = []
    for _ in range(120):
        value = _random_value(rng)
        if not isinstance(value, dict):
            value = {"zarr_format": 3, "v": value}
        text = json.dumps(value, indent=rng.choice([None, 2]))
        docs.append(text)
        docs.append(text[: rng.randrange(len(text) + 1)])  # cut short: mostly not JSON
        docs.append(text + rng.choice([" ", "\n", " x", ",", "}"]))
    return docs


@pytest.mark.parametrize("text", _documents())
def test_top_level_members_are_those_json_loads_gives(text: str) -> None:
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    got = top_level_members(text, WANTED)
    if not isinstance(doc, dict):
        assert got is None
    else:
        assert got == {k: v for k, v in doc.items() if k in WANTED}


@pytest.mark.parametrize("text", _documents()[::3])
def test_leading_members_of_any_prefix_are_none_or_the_whole_answer(text: str) -> None:
    names = {"zarr_format", "v", "attributes"}
    whole = leading_members(text, names)
    for n in range(len(text) + 1):
        assert leading_members(text[:n], names) in (None, whole)


def test_the_last_member_is_the_outer_objects_own() -> None:
    assert last_member('{"a": 1,\n  "node_type": "group"\n}\n') == ("node_type", "group")
    assert last_member('{"a": {"b": 1, "node_type": "group"}}') is None  # a nested one
    assert last_member('{"a": "x", "node_type": 3}') == ("node_type", 3)
    assert last_member('{"node_type": "group"}') is None  # no member before it
    assert last_member('{"a": [1, {"c": 2}]}') is None  # not a plain value


def _large_root(tmp_path: Path, name: str, head: dict, members: dict, last: dict,
                arrays: int = 6000) -> Path:
    """A directory with a root zarr.json of several MiB: ``head`` members, a large
    consolidated metadata, ``last`` members, in that order."""
    folder = tmp_path / name
    folder.mkdir()
    meta = {f"a{i}": {"shape": [3], "attributes": {"name": "x" * 300}, "node_type": "array"}
            for i in range(arrays)}
    doc = {**head, "consolidated_metadata": {"kind": "inline", "metadata": meta}, **members,
           **last}
    (folder / "zarr.json").write_text(json.dumps(doc, indent=2))
    assert (folder / "zarr.json").stat().st_size > 2 * target._ROOT_HEAD_BYTES
    return folder


OURS = {"attributes": {"lean_store": "lean_store", "layout": "[" + "1," * 400_000 + "1]"},
        "zarr_format": 3}


def test_large_roots_are_told_apart_as_a_whole_parse_would(tmp_path: Path) -> None:
    # as lean_store and zarr write it; the head longer than the first read (a long layout)
    assert target.is_checkpoint(_large_root(tmp_path, "ours", OURS, {}, {"node_type": "group"}))
    # the same members in another order: parsed whole
    assert target.is_checkpoint(_large_root(tmp_path, "reordered", {"zarr_format": 3}, {
        "attributes": {"lean_store": "lean_store"}}, {"node_type": "group"}))
    foreign = [
        _large_root(tmp_path, "array", OURS, {}, {"node_type": "array"}),
        _large_root(tmp_path, "v2", {**OURS, "zarr_format": 2}, {}, {"node_type": "group"}),
        _large_root(tmp_path, "theirs", {"attributes": {"lean_store": "other"},
                                          "zarr_format": 3}, {}, {"node_type": "group"}),
        _large_root(tmp_path, "no-type", OURS, {}, {"extra": 1}),
    ]
    for folder in foreign:
        assert not target.is_checkpoint(folder), folder.name
        with pytest.raises(ForeignPathError):
            ls.save({"w": np.ones(3, np.float32)}, folder, backend="zarr")
        assert (folder / "zarr.json").exists()  # untouched


def test_a_large_root_is_probed_without_parsing_its_arrays(tmp_path: Path) -> None:
    head = {"attributes": {"lean_store": "lean_store"}, "zarr_format": 3}
    folder = _large_root(tmp_path, "ours", head, {}, {"node_type": "group"}, arrays=20000)
    size = (folder / "zarr.json").stat().st_size
    tracemalloc.start()
    try:
        assert target.occupant(folder) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 2, (peak, size)  # json.loads of it: ~5x its size


def test_a_save_over_a_many_tensor_zarr_checkpoint_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "many.zarr"
    first = {f"t{i}": np.full(2, i, np.float32) for i in range(3000)}
    ls.save(first, path)
    assert (path / "zarr.json").stat().st_size > target._ROOT_HEAD_BYTES
    second = {k: v + 1 for k, v in first.items()}
    ls.save(second, path)
    back = ls.load_state(path)
    assert all(np.array_equal(back[k], v) for k, v in second.items())
