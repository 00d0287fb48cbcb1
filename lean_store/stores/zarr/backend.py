"""The Zarr backend record: a directory tree per checkpoint, local or behind an fsspec URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...formats import ScalarFormat
from ...layout import Entry
from ..backend import Backend
from ..base import StoreReader, StoreWriter

# zarr and its codecs load when a Zarr checkpoint is first written or read, not on import.


def _storage_name(fmt: ScalarFormat) -> str:
    from .store import storage_name_of

    return storage_name_of(fmt)


def _stored_shape(entry: Entry) -> tuple[int, ...]:
    from .store import stored_shape

    return stored_shape(entry)


def _sharded() -> Any:
    from .sharded import ZarrShardedLayout

    return ZarrShardedLayout()


def _holds(path: Path) -> bool:
    return path.is_dir() and (path / "zarr.json").is_file()


def _writer(path: Any, *, chunk_bytes: int, compression: Any, checksum: str | None = None,
            storage_options: dict[str, Any] | None = None) -> StoreWriter:
    if isinstance(path, str) and "://" in path:
        from .url import ZarrURLWriter

        return ZarrURLWriter(path, chunk_bytes=chunk_bytes, compression=compression,
                             storage_options=storage_options)
    from .store import ZarrWriter

    return ZarrWriter(path, chunk_bytes=chunk_bytes, compression=compression)


def _reader(path: Any, *, storage_options: dict[str, Any] | None = None) -> StoreReader:
    from .store import ZarrReader

    if isinstance(path, str) and "://" in path:
        from .url import open_url_store

        return ZarrReader(open_url_store(path, storage_options, read_only=True), where=path)
    return ZarrReader(path)


ZARR = Backend(
    name="zarr", title="Zarr", suffixes=(".zarr",), directory=True, urls=True, incremental=True,
    checksums=(None, "crc32c"), storage_name=_storage_name, stored_shape=_stored_shape,
    holds=_holds, writer=_writer, reader=_reader, sharded=_sharded,
    writer_modules=(f"{__package__}.store", f"{__package__}.sharded"),
)
