"""Zarr conventions: every array has ``dimension_names`` (unique per tensor and axis) and the
root ``zarr.json`` carries consolidated metadata, so xarray, zarr and TensorStore open a
lean_store Zarr checkpoint in one read; lean_store still reads stores without it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr
from zarr.storage import LocalStore, LoggingStore

import lean_store as ls
from lean_store import formats


def state() -> dict[str, object]:
    rng = np.random.default_rng(0)
    return {
        "model/a": rng.standard_normal((3, 4)).astype(np.float32),
        "model/b": rng.standard_normal((4, 3)).astype(np.float32),  # same axes, other lengths
        "step": np.array(7, dtype=np.int64),  # a scalar
        "c": (rng.standard_normal(5) + 1j * rng.standard_normal(5)).astype(np.complex64),
        "bf": ls.Encoded(np.arange(6, dtype=np.uint16), formats.get("bfloat16")),
        "cbf": ls.Encoded(np.arange(8, dtype=np.uint16).reshape(4, 2),
                          formats.complex_of(formats.get("bfloat16"))),
        "big": rng.standard_normal(40_000).astype(np.float32),  # sharded
    }


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ck.zarr"
    ls.save(state(), path, chunk_bytes=4096)
    return path


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_every_array_has_unique_dimension_names(saved: Path) -> None:
    group = zarr.open_group(saved, mode="r", use_consolidated=False)
    dims = {name: array.metadata.dimension_names for name, array in group.arrays()}
    assert dims["model%2Fa"] == ("model/a.dim_0", "model/a.dim_1")
    assert dims["step"] == ("step.scalar",)
    assert dims["cbf"] == ("cbf.dim_0", "cbf.word")  # raw words of a complex value
    every = [d for names in dims.values() for d in names]
    assert len(every) == len(set(every))


@pytest.mark.parametrize("consolidated", [False, True, None])
def test_xarray_opens_the_store_and_reads_exact_values(saved: Path, consolidated) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # xarray warns when it must fall back from consolidated
        ds = xr.open_zarr(saved, consolidated=consolidated)
    want = state()
    for name in ("model/a", "model/b", "c", "big"):
        node = name.replace("/", "%2F")
        got = ds[node].values
        assert got.dtype == want[name].dtype
        assert got.tobytes() == want[name].tobytes()
    assert ds["model%2Fa"].dims == ("model/a.dim_0", "model/a.dim_1")
    assert ds.sizes["model/b.dim_0"] == 4
    assert ds["bf"].values.tobytes() == want["bf"].bits.tobytes()
    assert ds["step"].values.tolist() == [7]
    assert ds.attrs["complete"] is True


def test_consolidated_metadata_equals_every_array_json(saved: Path) -> None:
    root = _json(saved / "zarr.json")
    copies = root["consolidated_metadata"]["metadata"]
    nodes = sorted(p.parent.name for p in saved.glob("*/zarr.json"))
    assert sorted(copies) == nodes
    for node in nodes:
        assert copies[node] == _json(saved / node / "zarr.json"), node
    assert root["attributes"]["complete"] is True


def test_zarr_opens_the_whole_hierarchy_in_one_read(saved: Path) -> None:
    store = LoggingStore(LocalStore(saved, read_only=True))
    group = zarr.open_group(store, mode="r", use_consolidated=True, zarr_format=3)
    arrays = dict(group.arrays())
    metadata = {name: (a.shape, a.metadata.dimension_names) for name, a in arrays.items()}
    assert metadata["big"] == ((40_000,), ("big.dim_0",))
    assert len(arrays) == len(state())
    calls = {k: v for k, v in store.counter.items() if k not in ("read_only", "_ensure_open")}
    assert calls == {"get": 1}  # the root zarr.json, nothing else, no listing


def test_store_without_consolidated_metadata_still_loads(saved: Path) -> None:
    """Stores written before consolidation (or edited by tools that drop it) read as before."""
    root = _json(saved / "zarr.json")
    del root["consolidated_metadata"]
    (saved / "zarr.json").write_text(json.dumps(root))
    got = ls.load_state(saved)
    assert got["model/a"].tobytes() == state()["model/a"].tobytes()
    assert ls.verify(saved).ok


def test_consolidated_copy_that_disagrees_is_refused(saved: Path) -> None:
    """xarray reads the consolidated copy, lean_store the array's own zarr.json: a store where
    they differ was altered, and no data is read from it."""
    root = _json(saved / "zarr.json")
    root["consolidated_metadata"]["metadata"]["model%2Fa"]["dimension_names"] = ["x", "y"]
    (saved / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(ls.IntegrityError, match="consolidated metadata"):
        ls.load_state(saved)
    assert not ls.verify(saved).ok
    with ls.open(saved) as ck:  # other tensors are unaffected
        assert ck["model/b"][:].tobytes() == state()["model/b"].tobytes()


def test_tensorstore_opens_the_store(saved: Path) -> None:
    import tensorstore as ts  # a test dependency: the third reader of the Zarr stores
    for name in ("model/a", "big", "c"):
        node = name.replace("/", "%2F")
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{saved}/{node}"}}
        array = ts.open(spec, read=True).result()
        assert array.domain.labels == tuple(
            zarr.open_array(saved / node, mode="r").metadata.dimension_names)
        assert np.asarray(array.read().result()).tobytes() == state()[name].tobytes()
