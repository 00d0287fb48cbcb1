"""Lazy analysis: dask arrays chunked like the store, and an xarray Dataset of every tensor.

>>> from lean_store.inspection.analysis import to_dask, to_xarray
>>> with ls.open("run.h5") as ck:
...     w = to_dask(ck, "layer.weight")       # nothing read yet
...     w.mean().compute()                    # reads chunk by chunk, in parallel
...     ds = to_xarray(ck)                    # one variable per tensor, all lazy

``to_dask`` keeps formats with a numpy dtype (ml_dtypes included) and decodes every other format
exactly to float64 (complex128 for complex formats), chunk by chunk, inside the dask graph;
``to_xarray`` also decodes the ml_dtypes formats, which xarray cannot reduce. Each chunk
read is checked by the store's per-chunk checksum (HDF5 chunk_crc32c, Zarr crc32c).

The graph holds the checkpoint's path, not an open file: every process (a dask worker on a
distributed cluster included) opens its own read-only handle the first time it needs a chunk, so
a graph can be shipped to ``dask.distributed`` workers that see the same file system.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..checkpoint import Checkpoint, as_values
from ..errors import CheckpointError
from ..fork_safe import ForkSafeLock
from ..formats import BoolFormat, IntegerFormat
from .reading import decoder, values_dtype

_OPEN: dict[tuple[str, str], Checkpoint] = {}
_OPEN_LOCK = ForkSafeLock()


def _checkpoint(path: str, backend: str) -> Checkpoint:
    """A per-process shared read-only handle (opened and validated once)."""
    key = (path, backend)
    with _OPEN_LOCK:
        ck = _OPEN.get(key)
        if ck is None:
            ck = _OPEN[key] = Checkpoint(path, backend=backend)
        return ck


def close_handles() -> None:
    """Close the handles that lazy arrays opened in this process."""
    with _OPEN_LOCK:
        for ck in _OPEN.values():
            ck.close()
        _OPEN.clear()


class TensorBlocks:
    """Array-like block reader for ``dask.array.from_array`` (holds a path, not a file)."""

    def __init__(
        self, path: str, backend: str, name: str, shape: tuple[int, ...], fmt: Any, decode: bool
    ) -> None:
        self.path, self.backend, self.name = path, backend, name
        self.shape = shape
        self.ndim = len(shape)
        self.format = fmt
        self.decode = decode or fmt.numpy_dtype is None
        self.dtype = values_dtype(fmt) if self.decode else fmt.numpy_dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        handle = _checkpoint(self.path, self.backend)[self.name]
        words = handle.bits(key)
        fmt = self.format
        if self.decode:
            return decoder(fmt)(words)
        return np.asarray(as_values(words, fmt))


def _plain_numpy(dtype: Any) -> bool:
    return dtype is not None and type(dtype).__module__ == "numpy.dtypes"


def to_dask(ck: Checkpoint, name: str, *, decode: bool | None = None) -> Any:
    """A lazy dask array of tensor ``name``, one dask chunk per stored chunk.

    ``decode=None`` (default): formats with a numpy or ml_dtypes dtype keep it, the rest are
    decoded exactly to float64 (complex128). ``decode=True`` also decodes the ml_dtypes
    formats (bfloat16, float8, ...) to float64, which every numpy/xarray operation accepts.
    """
    try:
        import dask.array as da
        from dask.base import tokenize
    except ImportError:  # pragma: no cover - dask is an optional dependency
        raise CheckpointError("to_dask needs dask: pip install 'lean_store[analysis]'") from None
    if name not in ck.layout:
        raise KeyError(name)
    handle = ck[name]
    if not isinstance(ck.path, (str, os.PathLike)):
        raise CheckpointError("to_dask needs a checkpoint opened from a path")
    path = os.path.abspath(os.fspath(ck.path))
    fmt = handle.format
    if decode is None:
        decode = fmt.numpy_dtype is None
    if isinstance(fmt, (IntegerFormat, BoolFormat)):
        decode = False  # integers and bools are their own values
    blocks = TensorBlocks(path, ck.backend, name, handle.shape, fmt, bool(decode))
    chunks: Any = tuple(handle.chunks[: handle.ndim]) if handle.ndim else ()
    stat = os.stat(path)
    token = tokenize(path, stat.st_mtime_ns, stat.st_size, name)
    return da.from_array(
        blocks, chunks=chunks, name=f"lean_store-{token}", asarray=False, fancy=False,
        lock=False, meta=np.empty((0,) * handle.ndim, dtype=blocks.dtype),
    )


def to_xarray(ck: Checkpoint) -> Any:
    """An ``xarray.Dataset`` with one lazy (dask) variable per tensor, in layout order.

    Dimensions are named ``"<tensor>.dim_<i>"`` so that tensors never share an axis by accident.
    Each variable's attrs carry its ``format`` tag, ``width`` and ``index``. Formats without a
    plain numpy dtype (bfloat16, float8, ... and configured formats) are decoded exactly to
    float64 (complex128), because xarray's reductions reject ml_dtypes dtypes.
    """
    try:
        import xarray as xr
    except ImportError:  # pragma: no cover - xarray is an optional dependency
        raise CheckpointError("to_xarray needs xarray: pip install lean_store[analysis]") from None
    variables = {}
    for entry in ck.layout:
        dims = tuple(f"{entry.name}.dim_{i}" for i in range(len(entry.shape)))
        attrs = {"format": entry.format.tag, "width": entry.format.width, "index": entry.index}
        decode = not _plain_numpy(entry.format.numpy_dtype)
        variables[entry.name] = xr.Variable(dims, to_dask(ck, entry.name, decode=decode),
                                            attrs=attrs)
    attrs = {"lean_store_kind": ck.kind, "format_version": ck.format_version,
             "path": os.fspath(ck.path)}
    return xr.Dataset(variables, attrs=attrs)


__all__ = ["TensorBlocks", "close_handles", "to_dask", "to_xarray"]
