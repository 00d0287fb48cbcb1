"""Arrays of lean_store's direct layout described from their metadata document alone.

Opening a store through zarr builds zarr's metadata objects for every array (about 0.1 ms a
tensor, and more when each is turned into a ``zarr.Array``). A local store whose root
``zarr.json`` carries consolidated metadata in which every member is exactly a document
:func:`.compat.plain_array_document` writes (the uncompressed or ``"weights"`` layout the
direct writer and reader handle) needs none of that: :func:`plain_array` recognises such a
document by rebuilding it from its own fields and comparing, and :class:`PlainArray` carries
what the reader needs (shape, data type, chunk and shard shapes, attributes). Any other
document (other codecs, grids, key encodings, extra keys) is left to zarr.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ...chunking import grid_shape
from ...hardening import MAX_CHUNK_BYTES, MAX_RANK, MAX_SHARD_BYTES
from . import shard_index
from .blosc_read import blosc_layout
from .chunk_keys import KEY_SEPARATOR, default_chunk_key, key_separator
from .compat import plain_array_document

_DATA_TYPES = {
    name: np.dtype(name) for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}
_CODEC_CLASSES = {"bytes": "BytesCodec", "crc32c": "Crc32cCodec", "blosc": "BloscCodec",
                  "sharding_indexed": "ShardingCodec"}


@dataclass(frozen=True, eq=False)
class PlainArray:
    """One array of the direct layout: ``document`` is its ``zarr.json`` (the root's copy),
    ``chunks`` the (inner) chunk shape, ``shards`` the shard shape or None."""

    node: str
    document: dict[str, Any]
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    shards: tuple[int, ...] | None
    compressed: bool
    separator: str = KEY_SEPARATOR  # the chunk key encoding's: "." or "/"

    @property
    def attrs(self) -> dict[str, Any]:
        return self.document["attributes"]

    @property
    def grid(self) -> tuple[int, ...]:
        """The shape of one file's cell: the shard, or the chunk when unsharded."""
        return self.shards or self.chunks

    @cached_property
    def length_checked_file(self) -> tuple[str, int] | None:
        """(key below the store root, exact size) of the one uncompressed chunk file that
        holds the whole, non-empty array, else None. Every direct read of such a file reads it
        whole and checks its length (one byte more asked), so the walk of the tree need not
        ``stat`` it (:func:`.checks.check_zarr_present`)."""
        if self.shards is None and not self.compressed and self._one_chunk:
            return (f"{self.node}/{self.key((0,) * len(self.shape))}",
                    math.prod(self.chunks) * self.dtype.itemsize + 4)
        return None

    @property
    def _one_chunk(self) -> bool:
        """One chunk holds the whole, non-empty array."""
        return all(self.shape) and all(c >= d for c, d in zip(self.chunks, self.shape))

    def key(self, coords: tuple[int, ...]) -> str:
        """The key (relative to the array) of the chunk (shard) file at grid ``coords``: the
        default chunk key encoding with the document's separator."""
        return default_chunk_key(self.separator, coords)

    def codec_names(self) -> tuple[list[str], list[str]]:
        """(outer, inner) codec class names, as :func:`.checks.codec_names` gives zarr's."""
        codecs = self.document["codecs"]
        outer = [_CODEC_CLASSES[c["name"]] for c in codecs]
        if self.shards is None:
            return outer, outer
        inner = codecs[0]["configuration"]["codecs"]
        return outer, [_CODEC_CLASSES[c["name"]] for c in inner]

    def files(self) -> Iterator[tuple[str, tuple[int, ...], int | None]]:
        """(key below the store root, grid coordinates, exact size or None when compressed)
        of every chunk (shard) file the array has, in C order of its grid."""
        itemsize = self.dtype.itemsize
        stored_chunk = math.prod(self.chunks) * itemsize + 4
        if self.shards is None and self._one_chunk:
            # one chunk holds the array (most small tensors): its one file
            coords = (0,) * len(self.shape)
            yield (f"{self.node}/{self.key(coords)}", coords,
                   None if self.compressed else stored_chunk)
            return
        slots = math.prod(s // c for s, c in zip(self.shards or (), self.chunks))
        for coords in itertools.product(*map(range, grid_shape(self.shape, self.grid))):
            key = f"{self.node}/{self.key(coords)}"
            if self.compressed:
                yield key, coords, None
            elif self.shards is None:
                yield key, coords, stored_chunk
            else:
                inside = math.prod(
                    -(-min(s, d - i * s) // c)
                    for s, c, d, i in zip(self.shards, self.chunks, self.shape, coords))
                yield key, coords, inside * stored_chunk + shard_index.index_bytes(slots)


def _ints(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not all(
            type(v) is int and v >= 0 for v in value):
        return None
    return tuple(value)


_PER_ARRAY = ("shape", "attributes", "dimension_names")  # the members that differ per array
_KNOWN: dict[tuple[Any, ...], tuple[dict[str, Any], PlainArray]] = {}
"""Documents found plain, by data type, chunk grid and rank: every member but
:data:`_PER_ARRAY`, and the array described. A document equal to one of them in those members
gets the same verdict (:func:`_plain_array` depends on nothing else but its shape's rank and
its attributes' and names' types), without rebuilding it."""
_KNOWN_LIMIT = 256


def plain_array(node: str, doc: Any) -> PlainArray | None:
    """``doc`` as a :class:`PlainArray` when it is exactly the document lean_store's direct
    writer writes (rebuilt from its fields, it compares equal) and the direct reader reads it
    (row-block chunks within a shard, bounded rank, chunk and shard sizes); else None (zarr
    then opens the array, and reports what is wrong with it). Most arrays of a checkpoint
    share all but their shape, attributes and names: those are compared with an array of
    the same kind found plain before (:data:`_KNOWN`) instead of rebuilt."""
    if not isinstance(doc, dict):
        return None
    shape, names = _ints(doc.get("shape")), doc.get("dimension_names")
    key: tuple[Any, ...] | None = None
    known = None
    try:
        key = (doc.get("data_type"), len(shape) if shape is not None else None,
               tuple(doc["chunk_grid"]["configuration"]["chunk_shape"]))
        known = _KNOWN.get(key)
    except (KeyError, TypeError, AttributeError):  # not shaped as a plain document
        key = None
    if known is not None and shape and isinstance(doc.get("attributes"), dict) \
            and isinstance(names, list) and all(isinstance(n, str) for n in names) \
            and len(doc) == len(known[0]) + len(_PER_ARRAY) \
            and all(k in doc and doc[k] == v for k, v in known[0].items()):
        a = known[1]
        return PlainArray(node, doc, shape, a.dtype, a.chunks, a.shards, a.compressed,
                          a.separator)
    array = _plain_array(node, doc)
    if array is not None and key is not None:
        if len(_KNOWN) >= _KNOWN_LIMIT:
            _KNOWN.clear()
        # a copy: a document changed later by its holder changes no verdict
        _KNOWN[key] = (copy.deepcopy({k: v for k, v in doc.items() if k not in _PER_ARRAY}),
                       array)
    return array


def _plain_array(node: str, doc: dict[str, Any]) -> PlainArray | None:
    """:func:`plain_array`, by rebuilding the document from its fields."""
    if not isinstance(doc.get("attributes"), dict):
        return None
    data_type, shape = doc.get("data_type"), _ints(doc.get("shape"))
    dtype = _DATA_TYPES.get(data_type) if isinstance(data_type, str) else None
    codecs, grid, names = doc.get("codecs"), doc.get("chunk_grid"), doc.get("dimension_names")
    if dtype is None or not shape or len(shape) > MAX_RANK or not isinstance(grid, dict) \
            or not isinstance(codecs, list) or not codecs or not isinstance(codecs[0], dict) \
            or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    outer = _ints((grid.get("configuration") or {}).get("chunk_shape"))
    if codecs[0].get("name") == "sharding_indexed":
        config = codecs[0].get("configuration")
        if not isinstance(config, dict):
            return None
        chunks, shards, inner = _ints(config.get("chunk_shape")), outer, config.get("codecs")
    else:
        chunks, shards, inner = outer, None, codecs
    if chunks is None or outer is None or not isinstance(inner, list) \
            or len(inner) not in (2, 3) or not all(isinstance(c, dict) for c in inner):
        return None
    compressor = inner[1] if len(inner) == 3 else None
    separator = key_separator(doc)
    if separator is None:
        return None
    rebuilt = plain_array_document(shape, dtype, chunks, shards, doc["attributes"], names,
                                   compressor, separator)
    if rebuilt != doc or sys.byteorder != "little" \
            or compressor is not None and not blosc_layout(doc):
        return None  # rebuilt equal: plain ``bytes`` + ``crc32c`` around the compressor
    if len(chunks) != len(shape) or len(outer) != len(shape) or min(chunks) < 1 \
            or min(outer) < 1:
        return None
    if shards is not None and (any(s % c for s, c in zip(shards, chunks)) or sum(
            s != c for s, c in zip(shards, chunks)) > 1):
        return None  # the direct reader's shards: row blocks of whole chunks
    if math.prod(chunks) * dtype.itemsize > MAX_CHUNK_BYTES \
            or math.prod(outer) * dtype.itemsize > MAX_SHARD_BYTES:
        return None
    return PlainArray(node, doc, shape, dtype, chunks, shards, compressor is not None,
                      separator)


def plain_members(copies: Any) -> dict[str, PlainArray] | None:
    """Every member of a root's consolidated metadata (``copies``: node -> document) as a
    :class:`PlainArray`, when each is one and sits at the root; else None (zarr opens it)."""
    if not isinstance(copies, dict):
        return None
    out: dict[str, PlainArray] = {}
    for node, doc in copies.items():
        if not isinstance(node, str) or "/" in node:
            return None
        array = plain_array(node, doc)
        if array is None:
            return None
        out[node] = array
    return out


def plain_root(doc: Any) -> dict[str, Any] | None:
    """The consolidated members of a root ``zarr.json`` document that is a Zarr v3 group
    with inline consolidated metadata (as ``zarr.consolidate_metadata`` writes it), else
    None."""
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 \
            or doc.get("node_type") != "group" or not isinstance(doc.get("attributes"), dict):
        return None
    extra = set(doc) - {"attributes", "zarr_format", "node_type", "consolidated_metadata"}
    consolidated = doc.get("consolidated_metadata")
    if extra or not isinstance(consolidated, dict) or consolidated.get("kind") != "inline" \
            or consolidated.get("must_understand") is not False:
        return None
    members = consolidated.get("metadata")
    return members if isinstance(members, dict) else None


__all__ = ["PlainArray", "plain_array", "plain_members", "plain_root"]
