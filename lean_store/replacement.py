"""Telling whether the directory store an open checkpoint reads is still the one it opened.

A save replaces a Zarr store (or a sharded HDF5 checkpoint directory) by swapping in a new
directory tree (docs/SECURITY.md), so a reader that goes back to the path later may find another
checkpoint there. Two watches:

- :class:`PinnedRoot`, for a local directory: the root directory is held open, so files opened
  relative to :attr:`PinnedRoot.fd` come from the tree that was opened even after a rename;
  :meth:`PinnedRoot.replaced` compares the directory now at the path with the held one (held
  open, its inode cannot be reused, so equal means the same tree).
- :class:`SaveIdWatch`, for any other store (fsspec URLs, zarr ``Store`` objects): the root
  attribute ``save_id`` (unique per save, docs/FORMAT.md) is read again and compared.

Readers use them seqlock style: data read through the path is handed out only if the store is
unchanged after the read. A replaced tree never comes back (each save makes a new directory,
with a new ``save_id``), so unchanged after means unchanged throughout.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

from .errors import CheckpointReplacedError

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


class PinnedRoot:
    """The root directory of a local store, held open from the moment the reader opens it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, _DIR_FLAGS)
        info = os.fstat(self.fd)
        self._identity = (info.st_dev, info.st_ino)
        self._close = weakref.finalize(self, os.close, self.fd)

    @classmethod
    def of(cls, path: Path) -> PinnedRoot | None:
        """The pinned directory at ``path``, or None where there is no directory to pin (the
        zarr open that follows reports what is wrong)."""
        try:
            return cls(path)
        except OSError:
            return None

    def replaced(self) -> bool:
        """True when the path no longer names the directory that was opened."""
        try:
            info = os.stat(self.path)
        except OSError:
            return True
        return (info.st_dev, info.st_ino) != self._identity

    def close(self) -> None:
        self._close()
        self.fd = -1  # never a descriptor number that something else may reuse


class SaveIdWatch:
    """The ``save_id`` root attribute of a store, read again on demand."""

    def __init__(self, store: Any, save_id: Any) -> None:
        self._store = store
        self._save_id = save_id if isinstance(save_id, str) else None

    def replaced(self) -> bool:
        """True when the store's root no longer carries the ``save_id`` it had when opened.
        A store written without one (before lean_store recorded it) cannot tell: False."""
        if self._save_id is None:
            return False
        import zarr

        try:
            attrs = zarr.open_group(store=self._store, mode="r", zarr_format=3).attrs
            return attrs.get("save_id") != self._save_id
        except Exception:  # noqa: BLE001 - root metadata gone or unreadable: not the one opened
            return True

    def close(self) -> None:
        pass


def check_unchanged(watch: PinnedRoot | SaveIdWatch | None, where: str) -> None:
    """Raise :class:`CheckpointReplacedError` when ``watch`` says the store was replaced."""
    if watch is not None and watch.replaced():
        raise CheckpointReplacedError(where)


__all__ = ["PinnedRoot", "SaveIdWatch", "check_unchanged"]
