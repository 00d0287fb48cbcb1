"""The backend-independent per-tensor work of save and load: each thing computed once, no
scan per tensor, and the fast paths give exactly what the general paths give."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import ALL_FORMATS

import lean_store as ls
from lean_store import formats
from lean_store.chunking import iter_regions
from lean_store.formats import registry
from lean_store.metadata import check_stored
from lean_store.naming import node_name
from lean_store.stores.registry import open_reader
from lean_store.stream import CopyEngine, staged

SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


class _NoScanList(list):
    """A node list that refuses membership tests: each would be a scan of every node."""

    def __contains__(self, item: object) -> bool:
        raise AssertionError("check_stored scanned the node list")


def test_check_stored_looks_nodes_up_without_scanning_the_list(
    tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f"ck{suffix}"
    state = {f"t{i}": np.full(3, i, np.float32) for i in range(20)}
    ls.save(state, path, progress=False)
    with ls.open(path) as ck, open_reader(path, None, None) as reader:
        nodes = _NoScanList(reader.nodes())
        reader.nodes = lambda: nodes  # type: ignore[method-assign]
        stored = check_stored(reader, ck.layout, str(path))
    assert list(stored) == list(state)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=str)
def test_format_properties_are_computed_once_and_stay_right(
    fmt: ls.ScalarFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = formats.from_config(fmt.to_config())  # a new object: nothing cached yet
    calls: list[Any] = []
    tag_of, numpy_dtype_of = registry.tag_of, registry.numpy_dtype_of
    monkeypatch.setattr(registry, "tag_of", lambda f: calls.append(f) or tag_of(f))
    monkeypatch.setattr(registry, "numpy_dtype_of",
                        lambda f: calls.append(f) or numpy_dtype_of(f))
    first = (fresh.tag, fresh.storage_dtype, fresh.numpy_dtype)
    asked = len(calls)
    for _ in range(3):
        assert (fresh.tag, fresh.storage_dtype, fresh.numpy_dtype) == first
    assert len(calls) == asked  # later asks are answered from the object
    assert first == (tag_of(fmt), formats.model.storage_dtype_for(fmt.word_width),
                     numpy_dtype_of(fmt))
    sizes = (fresh.width, fresh.word_width, fresh.words_per_value)
    assert sizes == (fmt.width, fmt.word_width, fmt.words_per_value)
    assert fresh.word_width * fresh.words_per_value == fresh.width
    assert fresh.storage_dtype.itemsize * 8 >= fresh.word_width
    if isinstance(fmt, formats.BinaryFormat):
        assert fresh.embeds_in_float64 == (fmt.fraction_bits <= 52 and fmt.max_exponent <= 1023
                                           and fmt.min_exponent - fmt.fraction_bits >= -1074)
    # the cache is no field: equality and hashing are unchanged
    assert fresh == fmt and hash(fresh) == hash(fmt)
    assert formats.get(fresh.tag) == fresh


@pytest.mark.parametrize("name", [
    "a", "layer0.weight", "A-b_c.9", ".hidden", "_private", "a/b", "é", "a b", "..", "x%y",
    "_", ".", "-lead",
])
def test_node_name_fast_path_matches_the_escaping_rule(name: str) -> None:
    expected = "".join(
        ch if ch in SAFE and not (i == 0 and ch in "._")
        else "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        for i, ch in enumerate(name)
    )
    assert node_name(name) == expected


@pytest.mark.parametrize("shape,unit", [
    ((64,), (64,)), ((64,), (100,)), ((3, 4), (3, 4)), ((3, 4), (5, 9)), ((1,), (1,)),
    ((64,), (16,)), ((3, 4), (1, 4)), ((0, 4), (1, 4)), ((5, 4, 2), (2, 4, 2)),
])
def test_iter_regions_one_region_fast_path(shape: tuple[int, ...], unit: tuple[int, ...]
                                           ) -> None:
    regions = list(iter_regions(shape, unit))
    covered = np.zeros(shape, np.int64)
    for region in regions:
        assert all(s.step is None and 0 <= s.start < s.stop for s in region)
        covered[region] += 1
    assert (covered == 1).all()
    if all(d == 0 for d in shape[:1]):
        assert regions == []
    elif all(u >= d for d, u in zip(shape, unit)):
        assert regions == [tuple(slice(0, d) for d in shape)]


class _Host:
    stage_engine = None

    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag, self.log = tag, log

    def read(self, region: Any) -> np.ndarray:
        self.log.append(f"read {self.tag}")
        return np.full(1, len(self.log))


def test_staged_reads_host_items_when_their_turn_comes() -> None:
    log: list[str] = []
    items = [("a", _Host("a", log), (slice(0, 1),)), ("a", None, None),
             ("b", _Host("b", log), (slice(0, 1),)), ("b", None, None)]
    out = []
    for key, region, bits in staged(iter(items)):
        log.append(f"got {key} {'marker' if bits is None else 'bits'}")
        out.append((key, region))
    assert log == ["read a", "got a bits", "got a marker", "read b", "got b bits",
                   "got b marker"]
    assert out == [(k, r) for k, _, r in items]


def test_layout_from_json_is_the_checked_inverse_of_to_json() -> None:
    layout = ls.Layout.from_specs(
        [(f"t{i}", (i % 3, 2)[: i % 3], fmt) for i, fmt in enumerate(ALL_FORMATS)]
    )
    back = ls.Layout.from_json(layout.to_json())
    assert back == layout and back.names() == layout.names()
    assert all(back[e.name] == e for e in layout)
    items = layout.to_json()
    with pytest.raises(ls.LayoutError, match="duplicate tensor name 't0'"):
        ls.Layout.from_json(items + [dict(items[0], index=len(items))])
    for bad in ([-1], [True], [1.0], "3"):
        with pytest.raises(ls.LayoutError, match="t0|entry 0"):
            ls.Layout.from_json([dict(items[0], shape=bad)] + items[1:])


class _Engine(CopyEngine):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def allocate(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def nbytes(self, tensor: Any, region: Any) -> int:
        return 8

    def start(self, tensor: Any, region: Any, buffer: Any) -> Any:
        self.log.append(f"copy {tensor.tag}")
        return lambda: buffer[:8].view(np.uint64)


class _Device(_Host):
    def __init__(self, tag: str, log: list[str], engine: _Engine) -> None:
        super().__init__(tag, log)
        self.stage_engine = engine


def test_staged_still_copies_device_units_ahead_of_host_ones() -> None:
    log: list[str] = []
    engine = _Engine(log)
    region = (slice(0, 1),)
    items = [("h1", _Host("h1", log), region), ("d1", _Device("d1", log, engine), region),
             ("h2", _Host("h2", log), region), ("d2", _Device("d2", log, engine), region)]
    for key, _, _ in staged(iter(items)):
        log.append(f"got {key}")
    # once a device unit has been met, the copy of the next one starts before the host unit
    # ahead of it is handed out, as before: host units do not stall the copies
    assert log.index("copy d2") < log.index("got h2")
    assert [x for x in log if x.startswith("got")] == ["got h1", "got d1", "got h2", "got d2"]
