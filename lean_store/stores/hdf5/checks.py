"""Checks of hostile or damaged HDF5 files: signatures, attributes, filters, types."""

from __future__ import annotations

import math
import os
from collections.abc import Container, Mapping
from typing import Any

import numpy as np

from ...chunking import chunk_count
from ...errors import IntegrityError, UnsafeFileError
from ...hardening import MAX_ATTR_BYTES, MAX_ATTRS, check_chunk_shape
from .crc_table import CHUNK_CRC_ATTR

_ARRAY_ATTRS = frozenset({CHUNK_CRC_ATTR, "header_digests"})  # read as arrays, not tuples
"""(``header_digests``: :data:`.header_digests.DIGESTS_ATTR`, not imported: this module loads
no more than reading a file's signature and attributes needs.)"""


def hdf5_superblock_offset(path: str | os.PathLike) -> int | None:
    """Where the HDF5 superblock of a regular file starts, as libhdf5 looks for it: at 0, or
    after a user block (``h5jam``, h5py's ``userblock_size``) at 512, 1024, 2048, ... bytes.
    None when there is no signature. At most log2(size) reads of 8 bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        offset = 0
        while offset + len(HDF5_SIGNATURE) <= size:
            f.seek(offset)
            if f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                return offset
            offset = 512 if offset == 0 else offset * 2
    return None


ROOT_ATTRS = frozenset({
    "lean_store", "format_version", "kind", "tensor_count", "layout", "writer", "manifest",
    "header_digests", "save_id", "complete", "sharded", "master_manifest", "lean_store_shard",
    "training_format_version", "training", "optimizer", "lightning_format_version",
    "lightning", "dcp", "safetensors_metadata", "torch_metadata", "torch_archive",
    "torch_container", "torchlean_adam",
})
"""Every root attribute a lean_store reader uses (docs/FORMAT.md 2.2 and section 5). Any
other is another tool's (an analyst's note), which readers ignore without reading it: its
type is not checked, so a variable-length string (what h5py writes for
``f.attrs["note"] = "..."``) is never read from HDF5's global heap (docs/SECURITY.md)."""


def read_hdf5_attrs(obj: Any, where: str, limits: Mapping[str, int] | None = None,
                    ours: Container[str] | None = None) -> dict[str, Any]:
    """Attributes of an h5py object, each checked for type and size (at most
    :data:`MAX_ATTR_BYTES`, or ``limits[name]``) *before* it is read."""
    import h5py

    try:
        names = list(obj.attrs.keys())
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise IntegrityError(f"{where}: unreadable attribute list ({exc})") from None
    if len(names) > MAX_ATTRS:
        raise UnsafeFileError(f"{where}: {len(names)} attributes (limit {MAX_ATTRS})")
    out: dict[str, Any] = {}
    for name in names:
        if ours is not None and name not in ours:
            continue  # another tool's attribute (an analyst's note): never read, ROOT_ATTRS
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
        limit = MAX_ATTR_BYTES if limits is None else limits.get(name, MAX_ATTR_BYTES)
        if count * max(1, dtype.itemsize) > limit or (is_str and count > 1):
            raise UnsafeFileError(f"{where}: attribute {name!r} claims {count} values; too large")
        try:
            raw = obj.attrs[name]  # tables of numbers stay arrays (not tuples)
            value = raw if name in _ARRAY_ATTRS and isinstance(raw, np.ndarray) else (
                from_hdf5_attr(raw)
            )
        except (OSError, RuntimeError, ValueError, TypeError, KeyError, UnicodeError) as exc:
            raise IntegrityError(f"{where}: unreadable attribute {name!r} ({exc})") from None
        if isinstance(value, str) and len(value) > limit:
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
    if not {"gzip", "lzf", "szip", "blosc"} & set(filters):
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


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def from_hdf5_attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return tuple(int(v) for v in value.reshape(-1)) if value.dtype.kind in "iu" else value
    if isinstance(value, np.generic):
        return value.item()
    return value
