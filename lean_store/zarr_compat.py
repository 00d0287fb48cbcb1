"""The one module that knows how the installed zarr-python differs between releases.

zarr-python's ``zarr.core`` and its codecs' private methods change between minor releases
(3.2 removed ``zarr.core.chunk_grids.RegularChunkGrid``; 3.4 turned ``ShardingCodec``'s
``index_location`` from an enum into a string). Everything else in lean_store asks this module
instead of reaching into zarr: what an array's chunk grid, chunk keys and codecs are is read
from the array's metadata document (``zarr.json``, defined by the Zarr v3 spec and stable across
releases); the internals below are probed once and replaced by stock public zarr API where the
installed release lacks them. ``tests/test_zarr_compat.py`` checks both paths.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import zarr
import zarr.errors
import zarr.storage
from zarr.codecs import Crc32cCodec

ZarrUserWarning: type[Warning] = getattr(zarr.errors, "ZarrUserWarning", UserWarning)
"""zarr's own warning class (zarr >= 3.1.x; plain ``UserWarning`` before it existed)."""

# --------------------------------------------------------------------------- metadata (spec)


def metadata_document(array: Any) -> dict[str, Any]:
    """The array's ``zarr.json`` document as zarr would write it (plain JSON values)."""
    return array.metadata.to_dict()


def regular_grid(array: Any) -> tuple[int, ...] | None:
    """The shape of one cell of the array's chunk grid (the shard shape when sharded, else the
    chunk shape), or None when the grid is not the spec's ``regular`` grid."""
    grid = array.metadata.chunk_grid
    to_dict = getattr(grid, "to_dict", None)
    doc = to_dict() if to_dict is not None else metadata_document(array)["chunk_grid"]
    if not isinstance(doc, dict) or doc.get("name") != "regular":
        return None
    shape = doc.get("configuration", {}).get("chunk_shape")
    if not isinstance(shape, (list, tuple)):
        return None
    return tuple(int(c) for c in shape)


def codec_documents(array: Any) -> list[dict[str, Any]]:
    """The array's codec pipeline as the spec's ``{"name", "configuration"}`` documents."""
    codecs = metadata_document(array).get("codecs", [])
    return [c if isinstance(c, dict) else {"name": str(c)} for c in codecs]


def sharding_document(array: Any) -> dict[str, Any] | None:
    """The configuration of the array's ``sharding_indexed`` codec, or None when unsharded.
    Keys: ``chunk_shape``, ``codecs``, ``index_codecs``, ``index_location`` (spec names)."""
    for codec in codec_documents(array):
        if codec.get("name") == "sharding_indexed":
            return dict(codec.get("configuration") or {})
    return None


def chunk_key(array: Any, coords: Sequence[int]) -> str:
    """The store key (relative to the array) of the chunk (shard) at grid ``coords``."""
    coords = tuple(int(c) for c in coords)
    encode = getattr(array.metadata, "encode_chunk_key", None)
    if encode is not None:
        return str(encode(coords))
    doc = metadata_document(array).get("chunk_key_encoding", {})  # the spec's two encodings
    sep = doc.get("configuration", {}).get("separator")
    if doc.get("name") == "v2":
        sep = sep or "."
        return sep.join(map(str, coords)) if coords else "0"
    sep = sep or "/"
    return "c" + "".join(sep + str(c) for c in coords)


def plain_codecs(codecs: Sequence[dict[str, Any]]) -> bool:
    """The codecs are exactly ``bytes`` (little endian or none) + ``crc32c``: a chunk file is
    its raw little-endian bytes followed by their CRC-32C."""
    if len(codecs) != 2 or [c.get("name") for c in codecs] != ["bytes", "crc32c"]:
        return False
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    return endian in (None, "little")


# --------------------------------------------------------------------------------- stores


def local_root(source: Any) -> Path | None:
    """The directory of a store that is a plain local directory (a path, or zarr's own
    ``LocalStore``), or None for every other store (zip, memory, fsspec, a subclass of
    ``LocalStore`` with behaviour of its own, ...): those are read through zarr."""
    if isinstance(source, (str, os.PathLike)):
        return None if "://" in os.fspath(source) else Path(source)
    if type(source) is zarr.storage.LocalStore:
        return Path(source.root)
    return None


def store_and_prefix(array: Any) -> tuple[Any, str]:
    """The store holding ``array`` and the array's key prefix in it ("" at the root)."""
    store_path = array.store_path
    return store_path.store, str(store_path.path or "")


def _sync_probe() -> Any:
    try:
        from zarr.core.sync import sync  # zarr's own loop: where its async stores live
    except ImportError:
        return None
    return sync


_SYNC = _sync_probe()


def store_has(store: Any, key: str) -> bool:
    """Whether ``key`` exists in zarr ``store`` (its async ``exists``, run to completion)."""
    if _SYNC is not None:
        return bool(_SYNC(store.exists(key)))
    return bool(asyncio.run(store.exists(key)))


# --------------------------------------------------------------------------------- codecs


@dataclass(frozen=True)
class LeanCrc32cCodec(Crc32cCodec):
    """zarr's ``crc32c`` codec with a one-allocation, one-copy encoder.

    zarr 3.1's encoder (``np.append(data, checksum)``) ravels, allocates and copies; this one
    allocates the output once, copies the chunk into it and computes the CRC-32C over the
    copy while it is in cache. The bytes are the spec's and the stock codec's (the chunk, then
    its CRC-32C as little-endian uint32), and the metadata is ``{"name": "crc32c"}``."""

    def _encode_sync(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
        data = chunk_bytes.as_numpy_array().reshape(-1).view(np.uint8)
        n = data.size
        out = np.empty(n + 4, np.uint8)
        out[:n] = data
        out[n:] = np.array([google_crc32c.value(out[:n])], dtype="<u4").view(np.uint8)
        return chunk_spec.prototype.buffer.from_array_like(out)


def _lean_encoder_fits() -> bool:
    """The installed zarr encodes the crc32c codec through ``_encode_sync(chunk, spec)`` (a
    private method lean_store overrides), and the override gives the stock bytes."""
    import inspect

    stock = getattr(Crc32cCodec, "_encode_sync", None)
    if stock is None or inspect.iscoroutinefunction(stock):
        return False
    try:
        params = list(inspect.signature(stock).parameters)
    except (TypeError, ValueError):
        return False
    return params[:3] == ["self", "chunk_bytes", "chunk_spec"]


LEAN_ENCODER = _lean_encoder_fits()


def crc32c_codec() -> Crc32cCodec:
    """The crc32c codec lean_store's writer passes to ``create_array``: the faster encoder
    where the installed zarr has the hook it overrides, else the stock codec."""
    return LeanCrc32cCodec() if LEAN_ENCODER else Crc32cCodec()


__all__ = [
    "LEAN_ENCODER", "LeanCrc32cCodec", "chunk_key", "codec_documents", "crc32c_codec",
    "local_root", "metadata_document", "plain_codecs", "regular_grid", "sharding_document",
    "store_and_prefix", "store_has",
]
