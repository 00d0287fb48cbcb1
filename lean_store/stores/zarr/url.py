"""Zarr checkpoints at fsspec URLs (``s3://``, ``gs://``, ``file://``, ...) from one process.

Object stores cannot rename a prefix, so the store is written in place under a new prefix and
committed by its last write: the root ``zarr.json`` with consolidated metadata and
``complete: true``. Until then the root says incomplete and every reader refuses it; an
interrupted upload stays refused. The prefix must not exist (a save never overwrites); on an
error the prefix is removed. The commit is :meth:`lean_store.stores.commit.Commit.url`, as for
sharded saves.
"""

from __future__ import annotations

from typing import Any

import zarr
from zarr.storage import FsspecStore

from ..base import StoreWriter
from ..commit import storage_options_for
from .store import ZarrWriter, compressors_for


def open_url_store(url: str, storage_options: dict[str, Any] | None = None, *,
                   read_only: bool) -> FsspecStore:
    """An fsspec-backed zarr store at ``url``; credentials and endpoint from
    ``storage_options`` or the standard environment (``AWS_ENDPOINT_URL``, ...)."""
    return FsspecStore.from_url(url, storage_options=storage_options_for(url, storage_options),
                                read_only=read_only)


class ZarrURLWriter(ZarrWriter):
    """Writes a Zarr checkpoint under a new URL prefix; the root ``zarr.json`` is the commit."""

    def __init__(self, url: str, *, chunk_bytes: int, compression: Any = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        # a URL commit: refuses an existing prefix; an abort removes everything under it
        StoreWriter.__init__(self, url, chunk_bytes=chunk_bytes, compression=compression,
                             storage_options=storage_options)
        self.url = url
        self._compressors = compressors_for(compression)
        # no cleanup if this fails: a failure here may mean another writer took the prefix
        store = open_url_store(url, storage_options, read_only=False)
        self._group = zarr.open_group(store=store, mode="w-", zarr_format=3)
        self._direct_root = None  # no local files: every chunk goes through zarr


__all__ = ["ZarrURLWriter", "open_url_store"]
