"""Limits that keep a hostile or damaged file from crashing, hanging, exhausting memory or
reaching outside the checkpoint.

The rule: nothing is allocated or iterated in proportion to a size the file *claims*; every
claim is first compared with what is actually present (chunk records and bytes in an HDF5
file, chunk files in a Zarr directory). Violations raise :class:`UnsafeFileError` (the file
tries something no lean_store writer does) or :class:`IntegrityError` (it is damaged).
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .chunk_crc import CHUNK_CRC_ATTR
from .errors import IntegrityError, UnsafeFileError

MAX_CHUNK_BYTES = 1 << 30  # one chunk (HDF5) or inner chunk (Zarr), decoded
MAX_SHARD_BYTES = 8 << 30  # one Zarr shard file, decoded
MAX_ATTR_BYTES = 64 << 20  # one attribute value (the layout JSON is the largest we write)
MAX_ATTRS = 1024  # attributes per object
MAX_METADATA_BYTES = 64 << 20  # one zarr.json
MAX_RANK = 32
ZARR_CODECS = frozenset(
    {"BytesCodec", "Crc32cCodec", "ShardingCodec", "ZstdCodec", "GzipCodec", "BloscCodec"}
)
ZARR_COMPRESSORS = frozenset({"ZstdCodec", "GzipCodec", "BloscCodec"})


def check_chunk_shape(
    node: str, chunk_shape: tuple[int, ...], stored_shape: tuple[int, ...], itemsize: int,
    limit: int = MAX_CHUNK_BYTES,
) -> None:
    """A chunk shape must have the array's rank, positive sides and a bounded size."""
    if len(stored_shape) > MAX_RANK:
        raise UnsafeFileError(f"{node!r}: rank {len(stored_shape)} exceeds {MAX_RANK}")
    if len(chunk_shape) != len(stored_shape):
        raise UnsafeFileError(f"{node!r}: chunk shape {chunk_shape} does not match the rank")
    if any(not isinstance(c, (int, np.integer)) or c < 1 for c in chunk_shape):
        raise UnsafeFileError(f"{node!r}: invalid chunk shape {chunk_shape}")
    nbytes = math.prod(int(c) for c in chunk_shape) * max(1, itemsize)
    if nbytes > limit:
        raise UnsafeFileError(
            f"{node!r}: chunk shape {chunk_shape} means {nbytes} bytes per chunk "
            f"(limit {limit}); refusing to allocate it"
        )


def chunk_count(shape: tuple[int, ...], chunks: tuple[int, ...]) -> int:
    """Chunks in the grid of ``shape``; 0 for an empty array."""
    return math.prod(-(-int(d) // int(c)) for d, c in zip(shape, chunks))


# ----------------------------------------------------------------------------------- HDF5


def read_hdf5_attrs(obj: Any, where: str) -> dict[str, Any]:
    """Attributes of an h5py object, each checked for type and size *before* it is read."""
    import h5py

    from .stores.hdf5 import from_hdf5_attr

    try:
        names = list(obj.attrs.keys())
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise IntegrityError(f"{where}: unreadable attribute list ({exc})") from None
    if len(names) > MAX_ATTRS:
        raise UnsafeFileError(f"{where}: {len(names)} attributes (limit {MAX_ATTRS})")
    out: dict[str, Any] = {}
    for name in names:
        try:
            aid = obj.attrs.get_id(name)
            shape, dtype = aid.shape, aid.dtype
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise IntegrityError(f"{where}: unreadable attribute {name!r} ({exc})") from None
        if shape is None or len(shape) > 1:
            raise IntegrityError(f"{where}: attribute {name!r} has an unsupported shape {shape}")
        count = math.prod(shape)
        string_info = h5py.check_string_dtype(dtype)
        is_str = string_info is not None
        if is_str and string_info.length is None:
            # Variable-length strings live in HDF5's global heap; libhdf5 can loop forever on a
            # corrupted one. lean_store writes fixed-length strings only, so refuse to read these.
            raise UnsafeFileError(
                f"{where}: attribute {name!r} is a variable-length string; lean_store files hold "
                "fixed-length strings only"
            )
        if dtype.kind not in "iufb" and not is_str:
            raise IntegrityError(f"{where}: attribute {name!r} has an unsupported type {dtype}")
        if count * max(1, dtype.itemsize) > MAX_ATTR_BYTES or (is_str and count > 1):
            raise UnsafeFileError(f"{where}: attribute {name!r} claims {count} values; too large")
        try:
            raw = obj.attrs[name]  # the per-chunk crc table stays an array (not a tuple)
            value = raw if name == CHUNK_CRC_ATTR and isinstance(raw, np.ndarray) else (
                from_hdf5_attr(raw)
            )
        except (OSError, RuntimeError, ValueError, TypeError, KeyError, UnicodeError) as exc:
            raise IntegrityError(f"{where}: unreadable attribute {name!r} ({exc})") from None
        if isinstance(value, str) and len(value) > MAX_ATTR_BYTES:
            raise UnsafeFileError(f"{where}: attribute {name!r} is absurdly long")
        out[name] = value
    return out


def check_hdf5_present(ds: Any, node: str, filters: list[str]) -> None:
    """Every chunk of ``ds`` must be allocated, inside the file, and (uncompressed) as large as
    its values need: so reading allocates only in proportion to bytes actually in the file."""
    shape = tuple(ds.shape)
    if not shape or math.prod(shape) == 0:
        return
    chunks = tuple(ds.chunks or ())
    if not chunks:
        raise IntegrityError(f"{node!r} is not chunked; lean_store writes chunked datasets only")
    check_chunk_shape(node, chunks, shape, ds.id.get_type().get_size())
    expected = chunk_count(shape, chunks)
    try:
        present = ds.id.get_num_chunks()
        stored = ds.id.get_storage_size()
        file_size = ds.file.id.get_filesize()
    except (OSError, RuntimeError, ValueError) as exc:
        raise IntegrityError(f"{node!r}: unreadable chunk index ({exc})") from None
    if present != expected:
        raise IntegrityError(
            f"{node!r}: {present} of {expected} chunks are present; the file is truncated or "
            "was never completely written"
        )
    if stored > file_size:
        raise UnsafeFileError(
            f"{node!r}: chunks claim {stored} bytes but the file holds only {file_size}"
        )
    if not {"gzip", "lzf", "szip"} & set(filters):
        least = math.prod(shape) * _hdf5_precision(ds.id.get_type()) // 8
        if stored < least:
            raise IntegrityError(
                f"{node!r}: {stored} bytes stored but {least} are needed; the file is truncated"
            )


def _hdf5_precision(ftype: Any) -> int:
    """Significant bits per element of an HDF5 type (what the N-bit filter keeps at least)."""
    from h5py import h5t

    if ftype.get_class() == h5t.COMPOUND:
        return sum(_hdf5_precision(ftype.get_member_type(i)) for i in range(ftype.get_nmembers()))
    try:
        return max(1, int(ftype.get_precision()))
    except (AttributeError, ValueError, RuntimeError):
        return 1


# ----------------------------------------------------------------------------------- Zarr


@dataclass
class LocalTree:
    """What a walk of a local Zarr directory found: every regular file and its size."""

    root: Path
    files: dict[str, int] = field(default_factory=dict)  # key relative to root -> size


def scan_local_zarr(root: Path) -> LocalTree:
    """Walk a Zarr directory once, without following links: reject any symlink or special
    file, and over-large metadata documents. The walk is bounded by what is on disk."""
    tree = LocalTree(root)
    if not (root / "zarr.json").exists():
        return tree  # the zarr open that follows reports the missing metadata
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        rel = base.relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        for name in dirnames:
            if (base / name).is_symlink():
                raise UnsafeFileError(f"{prefix}{name}: a symlink inside the checkpoint")
        for name in filenames:
            info = os.lstat(base / name)
            if stat.S_ISLNK(info.st_mode):
                raise UnsafeFileError(f"{prefix}{name}: a symlink inside the checkpoint")
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeFileError(f"{prefix}{name}: not a regular file")
            if name == "zarr.json" and info.st_size > MAX_METADATA_BYTES:
                raise UnsafeFileError(f"{prefix}{name}: {info.st_size} bytes of metadata")
            tree.files[prefix + name] = info.st_size
    return tree


def check_zarr_key(key: str) -> None:
    """A store key must stay inside the store: no absolute paths, no ``..``, no backslashes."""
    if (
        not key or key.startswith("/") or "\\" in key or "\x00" in key
        or any(part in ("", ".", "..") for part in key.split("/"))
    ):
        raise UnsafeFileError(f"store key {key!r} escapes or is malformed")


def codec_names(metadata: Any) -> tuple[list[str], list[str]]:
    """(outer codec class names, inner codec class names; inner = outer without sharding)."""
    outer = [type(c).__name__ for c in getattr(metadata, "codecs", ())]
    inner = outer
    for codec in getattr(metadata, "codecs", ()):
        if type(codec).__name__ == "ShardingCodec":
            inner = [type(c).__name__ for c in codec.codecs]
            index = [type(c).__name__ for c in codec.index_codecs]
            unknown = [n for n in inner + index if n not in ZARR_CODECS or n == "ShardingCodec"]
            if unknown:
                raise UnsafeFileError(f"unsupported codecs inside a shard: {unknown}")
    return outer, inner


def check_zarr_array(node: str, array: Any) -> None:
    """Only the codecs lean_store writes; bounded chunk and shard shapes."""
    meta = array.metadata
    outer, _inner = codec_names(meta)
    unknown = [n for n in outer if n not in ZARR_CODECS]
    if unknown:
        raise UnsafeFileError(f"{node!r}: unsupported Zarr codecs {unknown}")
    if getattr(meta, "storage_transformers", ()):
        raise UnsafeFileError(f"{node!r}: storage transformers are not supported")
    shape = tuple(array.shape)
    itemsize = array.dtype.itemsize
    outer_chunks = zarr_grid(node, array)
    check_chunk_shape(node, tuple(array.chunks), shape, itemsize)
    check_chunk_shape(node, outer_chunks, shape, itemsize, MAX_SHARD_BYTES)


def zarr_chunk_keys(node: str, array: Any, present: int) -> list[tuple[str, tuple[int, ...]]]:
    """(key, grid coordinates) of every chunk or shard file of ``array``, keys relative to the
    store root. Raises before enumerating when the grid claims more files than ``present``."""
    from .zarr_compat import chunk_key

    outer = zarr_grid(node, array)
    grid = tuple(-(-int(d) // int(c)) for d, c in zip(array.shape, outer))
    expected = math.prod(grid)
    if expected > present:
        raise IntegrityError(
            f"{node!r}: {present} of {expected} chunk files are present; the checkpoint is "
            "truncated or was never completely written"
        )
    return [(f"{node}/{chunk_key(array, coords)}", coords) for coords in np.ndindex(*grid)]


def zarr_expected_file_size(array: Any, coords: tuple[int, ...]) -> int | None:
    """Exact size of the chunk/shard file at ``coords`` when no compressor is used, else None.
    A shard at the edge holds only the inner chunks that overlap the array."""
    meta = array.metadata
    outer, inner = codec_names(meta)
    if any(n in ZARR_COMPRESSORS for n in inner) or "BytesCodec" not in inner:
        return None
    crc = 4 if "Crc32cCodec" in inner else 0
    inner_bytes = math.prod(array.chunks) * array.dtype.itemsize + crc
    if "ShardingCodec" not in outer:
        return inner_bytes
    shard = next(c for c in meta.codecs if type(c).__name__ == "ShardingCodec")
    shard_shape = zarr_grid("array", array)
    n_slots = math.prod(s // c for s, c in zip(shard_shape, shard.chunk_shape))
    n_inner = math.prod(
        -(-min(s, d - i * s) // c)
        for s, c, d, i in zip(shard_shape, shard.chunk_shape, array.shape, coords)
    )
    index_crc = 4 if any(type(c).__name__ == "Crc32cCodec" for c in shard.index_codecs) else 0
    return n_inner * inner_bytes + 16 * n_slots + index_crc


def check_zarr_present(node: str, array: Any, tree: LocalTree) -> None:
    """Every chunk (shard) file is present and, uncompressed, exactly the right size."""
    if math.prod(array.shape) == 0:
        return
    prefix = f"{node}/"
    present = {k: v for k, v in tree.files.items() if k.startswith(prefix)}
    for key, coords in zarr_chunk_keys(node, array, len(present)):
        got = present.get(key)
        if got is None:
            raise IntegrityError(f"{node!r}: chunk file {key!r} is missing; the data is truncated")
        size = zarr_expected_file_size(array, coords)
        if size is not None and got != size:
            raise IntegrityError(
                f"{node!r}: chunk file {key!r} has {got} bytes, expected {size}; it is truncated "
                "or corrupt"
            )


def touched_keys(node: str, array: Any, selection: Any) -> list[str]:
    """Store keys of the chunk (shard) files a strided selection reads. The selection covers
    the tensor's axes; a trailing (re, im) axis of word pairs is read whole."""
    from .chunking import touched_cells
    from .zarr_compat import chunk_key, store_and_prefix

    outer = zarr_grid(node, array)
    cells = touched_cells(selection.start, selection.count, selection.step, outer,
                          tuple(int(d) for d in array.shape))
    _store, prefix = store_and_prefix(array)
    base = f"{prefix}/" if prefix else ""
    return [base + chunk_key(array, coords) for coords in cells]


def check_zarr_keys_exist(node: str, array: Any, keys: list[str]) -> None:
    """For non-local stores: each key must exist (a missing chunk must never read as fill)."""
    from .zarr_compat import store_and_prefix, store_has

    store, _prefix = store_and_prefix(array)
    for key in keys:
        if not store_has(store, key):
            raise IntegrityError(f"{node!r}: chunk {key!r} is missing; the data is truncated")


def zarr_grid(node: str, array: Any) -> tuple[int, ...]:
    """The shape of one cell (shard, or chunk when unsharded) of ``array``'s regular grid."""
    from .zarr_compat import regular_grid

    outer = regular_grid(array)
    if outer is None or len(outer) != len(array.shape):
        raise UnsafeFileError(f"{node!r}: not a regular Zarr chunk grid")
    return outer


__all__ = [
    "MAX_ATTR_BYTES", "MAX_CHUNK_BYTES", "MAX_METADATA_BYTES", "check_chunk_shape",
    "check_hdf5_present", "check_zarr_array", "check_zarr_key", "check_zarr_present",
    "read_hdf5_attrs", "scan_local_zarr",
]
