"""Where a sharded checkpoint is written before it becomes visible, and how it is committed.

Local (or shared POSIX) paths: a hidden temporary sibling, renamed into place atomically by
rank 0 once every rank has finished; the previous checkpoint stays intact until then.
fsspec URLs (``file://``, ``s3://``, ...; Zarr only): object stores cannot rename a prefix, so
the data is written in place under a new prefix and the root ``zarr.json`` carrying
``complete`` is the commit marker, written last by rank 0. Overwriting is refused there.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, TypeGuard

from ..errors import CheckpointError, SaveIOError
from ..stores.base import fsync_tree, remove_path, replace_atomically
from ..stores.target import check_replaceable

STORAGE_OPTIONS = {"auto_mkdir": True}


def is_url(path: Any) -> TypeGuard[str]:
    return isinstance(path, str) and "://" in path


class Location:
    """The final path, and the root every rank writes to (``work``).

    Also used by single-process Zarr saves to a URL (``lean_store.stores.zarr.url``)."""

    def __init__(self, path: Any, work: str, storage_options: dict[str, Any] | None = None
                 ) -> None:
        self.path = path
        self.work = work
        self.storage_options = storage_options

    @classmethod
    def create(cls, path: Any, storage_options: dict[str, Any] | None = None) -> Location:
        """Rank 0: choose the work root (the caller shares ``work`` with the other ranks)."""
        if is_url(path):
            fs, root = _fs(path, storage_options)
            if fs.exists(root):
                raise CheckpointError(
                    f"{path} exists: a save to a URL never overwrites; use a new prefix per step"
                )
            return cls(path, path, storage_options)
        final = Path(path)
        if not final.parent.is_dir():
            raise CheckpointError(f"cannot save to {path}: directory {final.parent} does not exist")
        check_replaceable(final, directory=True)  # again when committing
        tmp = final.with_name(f".{final.name}.lean_store-tmp-{uuid.uuid4().hex}")
        try:
            tmp.mkdir()
        except OSError as exc:
            raise SaveIOError.wrapping(path, exc) from exc
        return cls(path, str(tmp))

    @property
    def local(self) -> bool:
        return not is_url(self.path)

    def commit(self) -> None:
        """Rank 0, after the commit marker was written into ``work``."""
        if self.local:
            try:
                fsync_tree(Path(self.work))
                replace_atomically(Path(self.work), Path(self.path))
            except OSError as exc:
                if isinstance(exc, CheckpointError) or exc.errno is None:
                    raise
                raise SaveIOError.wrapping(self.path, exc) from exc

    def abort(self) -> None:
        """Rank 0: remove everything written; the previous checkpoint is untouched."""
        if self.local:
            remove_path(Path(self.work))
        else:
            fs, root = _fs(self.work, self.storage_options)
            try:
                fs.rm(root, recursive=True)
            except FileNotFoundError:
                pass


def _fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    return fs, root


def storage_options_for(url: str, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """fsspec options for ``url``: ``given`` (endpoint, keys, ...) or, by default, none beyond
    creating local directories; s3fs then reads the standard AWS environment variables
    (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ...)."""
    if given is not None:
        return dict(given)
    return dict(STORAGE_OPTIONS) if url.startswith(("file:", "local:")) else {}
