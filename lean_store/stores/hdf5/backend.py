"""The HDF5 backend record: one file per checkpoint (a directory of shard files when sharded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...formats import ScalarFormat
from ...layout import Entry
from ..backend import Backend
from ..base import StoreReader, StoreWriter
from .checks import hdf5_superblock_offset
from .crc_table import CHECKSUMS

# h5py loads when an HDF5 checkpoint is first written or read, not on import.


def _storage_name(fmt: ScalarFormat) -> str:
    from .types import storage_kind

    return storage_kind(fmt)


def _holds(path: Path) -> bool:
    if path.is_dir():  # a sharded HDF5 checkpoint directory (lean_store.distributed)
        return (path / "lean_store.h5").is_file()
    try:
        return hdf5_superblock_offset(path) is not None  # at 0, or after a user block (h5jam)
    except FileNotFoundError:  # removed since it was looked at (a step another process pruned)
        return False


def _writer(path: Any, *, chunk_bytes: int, compression: Any, checksum: str | None = None,
            storage_options: dict[str, Any] | None = None) -> StoreWriter:
    from .store import HDF5Writer

    return HDF5Writer(path, chunk_bytes=chunk_bytes, compression=compression, checksum=checksum)


def _reader(path: Any, *, storage_options: dict[str, Any] | None = None) -> StoreReader:
    from .sharded import ShardedHDF5Reader, sharded_dir_of
    from .store import HDF5Reader

    directory = sharded_dir_of(path)
    return HDF5Reader(path) if directory is None else ShardedHDF5Reader(directory)


def _sharded() -> Any:
    from .sharded import HDF5ShardedLayout

    return HDF5ShardedLayout()


def _stored_shape(entry: Entry) -> tuple[int, ...]:
    return entry.shape or (1,)


HDF5 = Backend(
    name="hdf5", title="HDF5", suffixes=(".h5", ".hdf5", ".hdf"), directory=False, urls=False,
    incremental=False, checksums=(None, *CHECKSUMS),
    storage_name=_storage_name, stored_shape=_stored_shape, holds=_holds,
    writer=_writer, reader=_reader, sharded=_sharded,
    writer_modules=(f"{__package__}.store", f"{__package__}.sharded"),
)
