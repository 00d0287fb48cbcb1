"""The save pipeline's per-tensor work: format attributes built once per format, one-unit
tensors passed as one item, tensors closed in order with their whole digest, and the HDF5
manifest text unchanged by records that keep shapes as tuples."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import lean_store as ls
from lean_store import writing
from lean_store.formats import of_numpy_dtype
from lean_store.integrity import crc32c_combine, crc32c_of
from lean_store.layout import Layout
from lean_store.metadata import format_attrs, tensor_attrs
from lean_store.stores.hdf5.manifest import manifest_text, record_json

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.uint64, np.bool_,
          np.complex64, np.complex128]


def _layout() -> Layout:
    specs = [(f"t{i}", (3, i + 1), of_numpy_dtype(np.dtype(d))) for i, d in enumerate(DTYPES)]
    specs += [(f"again{i}", (2,), of_numpy_dtype(np.dtype(d))) for i, d in enumerate(DTYPES)]
    return Layout.from_specs(specs)


def test_tensor_attrs_keep_their_keys_and_order() -> None:
    entry = next(iter(Layout.from_specs(
        [("w", (2, 3), of_numpy_dtype(np.dtype(np.float32)))])))
    attrs = tensor_attrs(entry, "float")
    assert list(attrs) == ["index", "name", "shape", "format", "width", "storage",
                           "exponent_bits", "fraction_bits", "bias", "encoding"]
    assert attrs["shape"] == (2, 3) and attrs["storage"] == "float"
    z = next(iter(Layout.from_specs([("z", (2,), of_numpy_dtype(np.dtype(np.complex64)))])))
    assert list(tensor_attrs(z, "compound"))[-1] == "component"
    assert list(format_attrs(z.format, "compound"))[:3] == ["format", "width", "storage"]


def test_attrs_of_a_save_are_tensor_attrs_built_once_per_format() -> None:
    calls: list[Any] = []

    def storage_name(fmt: Any) -> str:
        calls.append(fmt)
        return f"kind-of-{fmt.tag}"

    attrs_of = writing._AttrsOfSave(storage_name)
    layout = _layout()
    for entry in layout:
        got = attrs_of(entry)
        want = tensor_attrs(entry, f"kind-of-{entry.format.tag}")
        assert got == want and list(got) == list(want)  # same values, same order
    assert len(calls) == len(DTYPES)  # the second tensor of each format reuses the first's
    entry = next(iter(layout))
    first, second = attrs_of(entry), attrs_of(entry)
    first["crc32c"] = 1  # a store adding to one tensor's attributes leaves the next alone
    assert "crc32c" not in second


def _counting_staged(counts: list[tuple[str, bool, bool]]) -> Any:
    """``writing.staged`` noting each item it is given: (tensor name, a unit, its last)."""
    real = writing.staged

    def staged(items: Any, **kwargs: Any) -> Any:
        def counted() -> Any:
            for item in items:
                (sink, _, last), _, region = item
                counts.append((sink.entry.name, region is not None, last))
                yield item
        return real(counted(), **kwargs)

    return staged


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_one_unit_tensors_are_one_item(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       suffix: str) -> None:
    counts: list[tuple[str, bool, bool]] = []
    monkeypatch.setattr(writing, "staged", _counting_staged(counts))
    state = {f"v{i}": np.full(5, i, np.float32) for i in range(7)}
    ls.save(state, tmp_path / f"one{suffix}")
    assert counts == [(k, True, True) for k in state]  # no separate end-of-tensor item
    counts.clear()
    # 64 x 32 float32 in chunks of 1 KiB (HDF5: 8 units); an empty tensor: its end alone
    state = {"multi": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
             "empty": np.zeros((0, 4), np.float32), "one": np.ones(3, np.float32)}
    ls.save(state, tmp_path / f"multi{suffix}", chunk_bytes=1024)
    multi = [c for c in counts if c[0] == "multi"]
    assert multi[-1] == ("multi", True, True) and all(c == ("multi", True, False)
                                                      for c in multi[:-1])
    assert counts[len(multi):] == [("empty", False, True), ("one", True, True)]
    if suffix == ".h5":
        assert len(multi) == 8
    back = ls.load_state(tmp_path / f"multi{suffix}")
    for key, value in state.items():
        assert back[key].shape == value.shape and back[key].tobytes() == value.tobytes()


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_tensors_close_in_order_with_their_whole_digest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    closed: list[tuple[str, int]] = []
    real = writing._InOrder.end

    def end(self: Any, sink: Any) -> None:
        sink_close = sink.close

        def close(attrs: dict[str, Any]) -> None:
            closed.append((sink.entry.name, attrs["crc32c"]))
            sink_close(attrs)

        sink.close = close
        real(self, sink)

    monkeypatch.setattr(writing._InOrder, "end", end)
    rng = np.random.default_rng(13)
    state = {"a": rng.standard_normal((40, 16)).astype(np.float32),  # 3 units of 1 KiB
             "e": np.zeros((0,), np.float32), "b": np.arange(5, dtype=np.int16),
             "c": rng.standard_normal(300).astype(np.float64)}
    ls.save(state, tmp_path / f"d{suffix}", chunk_bytes=1024)
    assert closed == [(k, crc32c_of(v)) for k, v in state.items()]


class _Sink:
    def __init__(self, log: list[tuple[str, int]], name: str) -> None:
        self._log, self._name = log, name

    def close(self, attrs: dict[str, Any]) -> None:
        self._log.append((self._name, attrs["crc32c"]))


def test_in_order_waits_for_units_behind_before_later_tensors() -> None:
    log: list[tuple[str, int]] = []
    a, b, c = _Sink(log, "a"), _Sink(log, "b"), _Sink(log, "c")
    order = writing._InOrder()
    behind: Future[int] = Future()
    order.unit(a, behind, 4)
    order.end(a)
    order.unit(b, 7, 3)  # written in order, but queued behind a's unit
    order.end(b)
    assert log == []
    behind.set_result(5)
    order.settle()
    assert log == [("a", 5), ("b", 7)]
    head, tail = b"abcd", b"xyz"
    order.unit(c, crc32c_of(np.frombuffer(head, np.uint8)), 4)
    order.unit(c, crc32c_of(np.frombuffer(tail, np.uint8)), 3)
    order.end(c)  # nothing queued: closed at once, the units' CRCs combined
    assert log[-1] == ("c", crc32c_of(np.frombuffer(head + tail, np.uint8)))
    assert log[-1][1] == crc32c_combine(crc32c_of(np.frombuffer(head, np.uint8)),
                                        crc32c_of(np.frombuffer(tail, np.uint8)), 3)


def test_manifest_text_is_the_same_with_shapes_as_tuples() -> None:
    table = np.array([0, 1, 2**32 - 1], np.uint32)
    attrs = {"index": 0, "name": "w", "shape": (3, 1), "format": "float32", "crc32c": 9}
    text = manifest_text([record_json("w", attrs, (3, 1), (1, 1), table)])
    listed = {"version": 1, "tensors": [{
        "node": "w", "attrs": {**attrs, "shape": [3, 1]}, "stored_shape": [3, 1],
        "chunks": [1, 1], "chunk_crc32c": [0, 1, 2**32 - 1]}]}
    assert text == json.dumps(listed, separators=(",", ":"))


def test_hdf5_chunk_tables_of_one_and_many_chunks(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    one = np.arange(7, dtype=np.float32)
    many = np.arange(40 * 16, dtype=np.float32).reshape(40, 16)  # 1 KiB chunks: 16 rows each
    ls.save({"one": one, "many": many}, tmp_path / "t.h5", chunk_bytes=1024)
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert f["one"].attrs["chunk_crc32c"].tolist() == [crc32c_of(one)]
        rows = f["many"].chunks[0]
        assert f["many"].attrs["chunk_crc32c"].tolist() == [
            crc32c_of(many[i:i + rows]) for i in range(0, 40, rows)]
