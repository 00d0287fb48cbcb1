"""The backends: which one a path names or holds, and their writers and readers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..chunking import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES
from ..errors import CheckpointError, IntegrityError
from .base import StoreReader, StoreWriter

BACKENDS = ("hdf5", "zarr")


_SUFFIXES = {".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".zarr": "zarr"}


def backend_for(path: str | os.PathLike, backend: str | None = None) -> str:
    """The backend named, or the one the suffix implies (.h5/.hdf5 -> hdf5, .zarr -> zarr)."""
    if backend is not None:
        if backend not in BACKENDS:
            raise CheckpointError(f"unknown backend {backend!r}; use one of {BACKENDS}")
        return backend
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise CheckpointError(
            f"cannot tell the backend from {str(path)!r}: use a .h5/.hdf5 or .zarr suffix, "
            "or pass backend='hdf5' or 'zarr'"
        )
    return _SUFFIXES[suffix]


def detect_backend(path: str | os.PathLike) -> str:
    """The backend of an existing checkpoint, from what is on disk."""
    if not isinstance(path, (str, os.PathLike)):
        return "zarr"  # a zarr store object (LocalStore, ZipStore, MemoryStore, FsspecStore)
    if isinstance(path, str) and "://" in path:
        return "zarr"  # fsspec URLs (file://, s3://, ...) hold Zarr stores
    from ..hardening import check_checkpoint_path
    from .hdf5.checks import hdf5_superblock_offset

    check_checkpoint_path(path)  # a FIFO or device is refused here, never opened
    p = Path(path)
    if p.is_dir():
        if (p / "zarr.json").is_file():
            return "zarr"
        if (p / "lean_store.h5").is_file():
            return "hdf5"  # a sharded HDF5 checkpoint directory (lean_store.distributed)
        raise IntegrityError(f"{p} is a directory but not a lean_store checkpoint (no zarr.json)")
    if hdf5_superblock_offset(p) is not None:  # at 0, or after a user block (h5jam)
        return "hdf5"
    raise IntegrityError(
        f"{p} is not a lean_store checkpoint (no HDF5 signature at offset 0 or after a user "
        "block at 512, 1024, 2048, ... bytes, and not a Zarr directory)"
    )


def is_url(path: Any) -> bool:
    """An fsspec URL (``s3://bucket/run/step.zarr``, ``file:///...``): Zarr checkpoints only."""
    return isinstance(path, str) and "://" in path


def open_writer(
    path: str | os.PathLike, backend: str, *, chunk_bytes: int | None, compression: Any,
    checksum: str | None = None, storage_options: dict[str, Any] | None = None,
) -> StoreWriter:
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise CheckpointError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES}, got {chunk_bytes}")
    if is_url(path):
        if backend != "zarr" or checksum not in (None, "crc32c"):
            raise CheckpointError(f"cannot save to {path}: URLs hold Zarr checkpoints only "
                                  "(use a .zarr suffix or backend='zarr')")
        from .zarr.url import ZarrURLWriter

        return ZarrURLWriter(str(path), chunk_bytes=chunk_bytes, compression=compression,
                             storage_options=storage_options)
    if storage_options is not None:
        raise CheckpointError("storage_options apply to URLs (s3://..., file://...) only")
    parent = Path(path).parent
    if not parent.is_dir():
        raise CheckpointError(f"cannot save to {path}: directory {parent} does not exist")
    if backend == "hdf5":
        from .hdf5.store import HDF5Writer

        return HDF5Writer(path, chunk_bytes=chunk_bytes, compression=compression,
                          checksum=checksum)
    if checksum not in (None, "crc32c"):
        raise CheckpointError(f"Zarr checksums are crc32c (its native codec), not {checksum!r}")
    from .zarr.store import ZarrWriter

    return ZarrWriter(path, chunk_bytes=chunk_bytes, compression=compression)


def open_reader(path: Any, backend: str | None = None,
                storage_options: dict[str, Any] | None = None) -> StoreReader:
    if storage_options is not None and not is_url(path):
        raise CheckpointError("storage_options apply to URLs (s3://..., file://...) only")
    if backend is None:
        backend = detect_backend(path)
    elif isinstance(path, (str, os.PathLike)) and "://" not in str(path):
        from ..hardening import check_checkpoint_path

        check_checkpoint_path(path)
    if backend == "hdf5":
        from .hdf5.sharded import ShardedHDF5Reader, sharded_dir_of
        from .hdf5.store import HDF5Reader

        directory = sharded_dir_of(path)
        return HDF5Reader(path) if directory is None else ShardedHDF5Reader(directory)
    from .zarr.store import ZarrReader

    if is_url(path):
        from .zarr.url import open_url_store

        return ZarrReader(open_url_store(path, storage_options, read_only=True), where=path)
    return ZarrReader(path)
