"""``Backend``: what the layers above a store need to know about one storage format.

Each backend package (``stores/hdf5``, ``stores/zarr``) defines one record; the registry
(:mod:`lean_store.stores.registry`) picks a record for a path. Code outside ``stores/`` asks the
record, and never branches on the backend's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats import ScalarFormat
from ..layout import Entry
from .base import StoreReader, StoreWriter


@dataclass(frozen=True)
class Backend:
    name: str
    """``"hdf5"`` or ``"zarr"``: the value of ``backend=`` and of ``Checkpoint.backend``."""
    title: str
    """How messages name it: ``"HDF5"``, ``"Zarr"``."""
    suffixes: tuple[str, ...]
    """Path suffixes that name this backend (lower case, with the dot)."""
    directory: bool
    """A single-process checkpoint is a directory tree (else one file)."""
    urls: bool
    """Can save to and read from fsspec URLs (``s3://``, ``file://``, ...)."""
    incremental: bool
    """``Checkpointer(incremental=True)`` can share unchanged chunks between steps."""
    checksums: tuple[str | None, ...]
    """Accepted values of the ``checksum`` save option."""
    storage_name: Callable[[ScalarFormat], str]
    """The ``storage`` attribute written for a tensor of this format."""
    stored_shape: Callable[[Entry], tuple[int, ...]]
    """The shape of the dataset that stores ``entry``."""
    holds: Callable[[Path], bool]
    """Whether an existing local path holds a checkpoint of this backend."""
    writer: Callable[..., StoreWriter]
    """``writer(path, chunk_bytes=, compression=, checksum=, storage_options=)``."""
    reader: Callable[..., StoreReader]
    """``reader(path, storage_options=)``: path, URL or (Zarr) a store object."""
    sharded: Callable[[], Any]
    """The :class:`~lean_store.stores.sharded_layout.ShardedLayout` of sharded saves."""
    writer_modules: tuple[str, ...] = ()
    """Modules :attr:`writer` imports on first use. A background save imports them on the
    caller's thread first: a child forked while the save's thread held a module's import lock
    would hang at its own first import of that module."""

    def import_writer(self) -> None:
        """Import :attr:`writer_modules` (at once when they are imported already)."""
        for name in self.writer_modules:
            importlib.import_module(name)

    def check_checksum(self, checksum: Any) -> None:
        from ..errors import CheckpointError

        if checksum not in self.checksums:
            allowed = ", ".join(repr(c) for c in self.checksums if c is not None)
            raise CheckpointError(
                f"{self.title} checksums are {allowed}, not {checksum!r}")
