"""dask and xarray views: lazy, chunked like the store, exact decoding, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import dask
import numpy as np
import pytest

import lean_store as ls
from lean_store.inspection.analysis import to_dask, to_xarray
from lean_store.layout import Entry, Layout
from lean_store.sources.base import SourceTensor, TensorSource
from lean_store.writing import write_source


def test_to_dask_is_lazy_chunked_like_the_store_and_exact(tmp_path: Path) -> None:
    values = np.random.default_rng(0).standard_normal((300, 40)).astype(np.float32)
    twelve = ls.Encoded.from_values(np.linspace(-3, 3, 1000), ls.formats.binary(5, 6))
    for name in ("a.h5", "a.zarr"):
        ls.save({"w": values, "t": twelve, "s": np.float64(2.5)}, tmp_path / name,
                chunk_bytes=4096)
        with ls.open(tmp_path / name) as ck:
            w = to_dask(ck, "w")
            assert w.chunks[0][0] == ck["w"].chunks[0] == 4096 // (40 * 4)
            assert w.dtype == np.float32 and w.shape == (300, 40)
            assert np.array_equal(w.compute(), values)
            assert float(w[10:20, 3].sum().compute()) == float(values[10:20, 3].sum())
            t = to_dask(ck, "t")
            assert t.dtype == np.float64  # no numpy dtype: decoded lazily, exactly
            assert np.array_equal(t.compute(), twelve.decode())
            assert float(to_dask(ck, "s").compute()) == 2.5
            with pytest.raises(KeyError):
                to_dask(ck, "nope")


def test_to_xarray_dataset_of_all_tensors(tmp_path: Path) -> None:
    bf = ls.Encoded.from_values([1.0, 2.0, 3.5], "bfloat16")
    cpx = ls.Encoded.from_values(np.array([1 + 1j, -2j]), "complex(bfloat16)")
    ls.save({"layer.w": np.ones((2, 3), np.float32), "bf": bf, "cpx": cpx}, tmp_path / "x.zarr")
    with ls.open(tmp_path / "x.zarr") as ck:
        ds = to_xarray(ck)
        assert list(ds.data_vars) == ["layer.w", "bf", "cpx"]
        assert ds["layer.w"].dims == ("layer.w.dim_0", "layer.w.dim_1")
        assert ds["bf"].attrs["format"] == "bfloat16"
        assert ds["cpx"].dtype == np.complex128 and ds["cpx"].attrs["width"] == 32
        assert ds.attrs["lean_store_kind"] == "state"
        assert float(ds["bf"].sum()) == 6.5
        assert ds["cpx"].values.tolist() == [1 + 1j, -2j]


class _Ramp(TensorSource):
    """A large float32 tensor generated block by block (value = column % 4096)."""

    def __init__(self, rows: int, cols: int) -> None:
        self.layout = Layout([Entry(0, "big", (rows, cols), ls.formats.get("float32"))])
        self._row = (np.arange(cols) % 4096).astype(np.float32).view(np.uint32)

    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]:
        ramp = self

        class _Tensor(SourceTensor):
            def read(self, region: tuple[slice, ...]) -> np.ndarray:
                rows = region[0].stop - region[0].start
                return np.broadcast_to(ramp._row[region[1]], (rows, ramp._row[region[1]].size))

        yield self.layout[0], _Tensor()


REDUCE = textwrap.dedent(
    """
    import json, sys
    import dask
    import lean_store as ls
    from lean_store.inspection.analysis import to_dask
    with ls.open(sys.argv[1]) as ck:
        big = to_dask(ck, "big")
        with dask.config.set(scheduler="threads", num_workers=2):
            total = float(big.sum(dtype="float64").compute())
            top = float(big.max().compute())
        chunks = len(big.chunks[0])
    # VmHWM: this process's peak RSS. (ru_maxrss would not do: Linux carries it over from the
    # parent across fork and exec, so it reports pytest's own size.)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    print(json.dumps({"total": total, "max": top, "chunks": chunks, "rss": rss}))
    """
)


def test_dask_reduction_over_a_tensor_larger_than_the_memory_budget(tmp_path: Path) -> None:
    rows = cols = 1 << 14  # 2**28 float32 = 1 GiB on disk
    budget = 320 << 20  # the reducing process may not come near the tensor's size
    path = tmp_path / "big.h5"
    write_source(_Ramp(rows, cols), path, kind="state", chunk_bytes=4 << 20)
    assert path.stat().st_size > 1 << 30
    result = subprocess.run([sys.executable, "-c", REDUCE, str(path)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["total"] == rows * 4 * (4095 * 4096 // 2)  # exact: every partial sum is an integer
    assert doc["max"] == 4095.0
    assert doc["chunks"] == rows // 64  # 4 MiB chunks of 64 rows, one dask task each
    assert doc["rss"] < budget, f"peak RSS {doc['rss'] >> 20} MiB {doc}"


def test_dask_graph_holds_a_path_not_an_open_file(tmp_path: Path) -> None:
    ls.save({"w": np.arange(10.0)}, tmp_path / "p.h5")
    with ls.open(tmp_path / "p.h5") as ck:
        arr = to_dask(ck, "w")
    from lean_store.inspection.analysis import close_handles

    close_handles()
    assert float(arr.sum().compute(scheduler="sync")) == 45.0  # reopened on demand
    close_handles()
    assert dask.base.tokenize(arr) == dask.base.tokenize(arr)
