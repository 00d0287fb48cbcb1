"""The backends: which one a path names or holds, and their writers and readers."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..chunking import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES
from ..errors import CheckpointError, IntegrityError
from ..hardening import check_checkpoint_path, without_trailing_separators
from .backend import Backend
from .base import StoreReader, StoreWriter
from .commit import check_parent_directory, is_url
from .hdf5.backend import HDF5
from .zarr.backend import ZARR

RECORDS: dict[str, Backend] = {record.name: record for record in (HDF5, ZARR)}
BACKENDS = tuple(RECORDS)
"""The backends' names, the values ``backend=`` takes."""


def backend_record(name: str) -> Backend:
    """The record of the backend named ``name`` (a CheckpointError for an unknown name)."""
    try:
        return RECORDS[name]
    except KeyError:
        raise CheckpointError(f"unknown backend {name!r}; use one of {BACKENDS}") from None


def _is_zarr_store(obj: Any) -> bool:
    zarr = sys.modules.get("zarr")  # a zarr store object exists only once zarr is imported
    return zarr is not None and isinstance(obj, zarr.abc.store.Store)


def checkpoint_path(path: Any, *, stores: bool = False) -> Any:
    """``path`` as the stores take it: a ``str`` or ``os.PathLike`` as it is, ``bytes`` (or a
    PathLike of bytes) decoded as the file system names it (``os.fsdecode``), and with
    ``stores`` (a reader's source) a zarr store object or a binary file object (an HDF5 file
    h5py reads through it). Anything else: CheckpointError naming what it is, before anything
    is read or written."""
    if isinstance(path, (str, bytes, os.PathLike)):
        text = os.fspath(path)
        if isinstance(text, bytes):
            text = path = os.fsdecode(text)
        if isinstance(path, str) and not is_url(text):
            return without_trailing_separators(text)
        return path
    if stores and _is_zarr_store(path):
        return path
    if stores and callable(getattr(path, "read", None)) and callable(getattr(path, "seek",
                                                                             None)):
        return path
    kinds = "a str or os.PathLike path, a zarr store or a file object" if stores else (
        "a str or os.PathLike path")
    raise CheckpointError(f"a checkpoint location must be {kinds}, not "
                          f"{type(path).__name__} {path!r:.60}")


def backend_for(path: str | os.PathLike, backend: str | None = None) -> str:
    """The backend named, or the one the suffix implies (.h5/.hdf5 -> hdf5, .zarr -> zarr)."""
    if backend is not None:
        return backend_record(backend).name
    suffix = Path(path).suffix.lower()
    for record in RECORDS.values():
        if suffix in record.suffixes:
            return record.name
    raise CheckpointError(
        f"cannot tell the backend from {str(path)!r}: use a .h5/.hdf5 or .zarr suffix, "
        "or pass backend='hdf5' or 'zarr'"
    )


def detect_backend(path: str | os.PathLike) -> str:
    """The backend of an existing checkpoint, from what is on disk."""
    if not isinstance(path, (str, os.PathLike)):
        if _is_zarr_store(path):
            return ZARR.name  # LocalStore, ZipStore, MemoryStore, FsspecStore
        return HDF5.name  # a binary file object (checkpoint_path): h5py reads HDF5 through it
    if is_url(path):
        return ZARR.name  # fsspec URLs (file://, s3://, ...) hold Zarr stores
    check_checkpoint_path(path)  # a FIFO or device is refused here, never opened
    p = Path(path)
    for record in RECORDS.values():
        if record.holds(p):
            return record.name
    if not os.path.lexists(p):  # removed since check_checkpoint_path looked at it
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    from ..interop.foreign import refusal_hint  # what it is instead, and the way to use it

    if p.is_dir():
        raise IntegrityError(f"{p} is a directory but not a lean_store checkpoint (no zarr.json)"
                             f"{_checkpoints_inside(p) or refusal_hint(p)}")
    raise IntegrityError(
        f"{p} is not a lean_store checkpoint (no HDF5 signature at offset 0 or after a user "
        f"block at 512, 1024, 2048, ... bytes, and not a Zarr directory){refusal_hint(p)}"
    )


_LISTED_INSIDE = 4  # checkpoints a "directory but not a checkpoint" error names
_SCANNED_INSIDE = 10_000  # entries of that directory looked at, at most


def _checkpoints_inside(directory: Path) -> str:
    """For the error about a directory that is no checkpoint: the checkpoints it holds by
    their names (a Checkpointer's directory of steps), so the user can name one; else ""."""
    try:
        with os.scandir(directory) as entries:
            names = sorted(entry.name for entry, _ in zip(entries, range(_SCANNED_INSIDE))
                           if any(entry.name.endswith(suffix) and not entry.name.startswith(".")
                                  for record in RECORDS.values()
                                  for suffix in record.suffixes))
    except OSError:
        return ""
    if not names:
        return ""
    shown = names if len(names) <= _LISTED_INSIDE else [*names[:1], "...",
                                                          *names[-(_LISTED_INSIDE - 1):]]
    return (f"; it holds {len(names)} checkpoint{'s' if len(names) > 1 else ''} "
            f"({', '.join(shown)}): name one of them, e.g. {directory / names[-1]}")


def open_writer(
    path: str | os.PathLike, backend: str, *, chunk_bytes: int | None, compression: Any,
    checksum: str | None = None, storage_options: dict[str, Any] | None = None,
) -> StoreWriter:
    """A writer for a new checkpoint at ``path`` (committed by its ``commit``)."""
    record = backend_record(backend)
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise CheckpointError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES}, got {chunk_bytes}")
    if is_url(path):
        if not record.urls or checksum not in (None, "crc32c"):
            raise CheckpointError(f"cannot save to {path}: URLs hold Zarr checkpoints only "
                                  "(use a .zarr suffix or backend='zarr')")
    else:
        if storage_options is not None:
            raise CheckpointError("storage_options apply to URLs (s3://..., file://...) only")
        check_parent_directory(path)
    record.check_checksum(checksum)
    return record.writer(str(path) if is_url(path) else path, chunk_bytes=chunk_bytes,
                         compression=compression, checksum=checksum,
                         storage_options=storage_options)


def open_reader(path: Any, backend: str | None = None,
                storage_options: dict[str, Any] | None = None) -> StoreReader:
    """A reader of the checkpoint at ``path`` (a path, a URL or a zarr store object)."""
    path = checkpoint_path(path, stores=True)
    if storage_options is not None and not is_url(path):
        raise CheckpointError("storage_options apply to URLs (s3://..., file://...) only")
    local = isinstance(path, (str, os.PathLike)) and not is_url(path)
    if backend is None:
        backend = detect_backend(path)
    elif local:
        check_checkpoint_path(path)
    try:
        return backend_record(backend).reader(path, storage_options=storage_options)
    except IntegrityError:
        # removed since it was found (a Checkpointer pruning the step a reader picked): gone,
        # not damaged (libhdf5 says "unable to open file", a walk "changed while read")
        if local and not os.path.lexists(path):
            raise CheckpointError(f"no checkpoint at {path}: the path does not exist (removed "
                                  "while it was being opened)") from None
        raise
