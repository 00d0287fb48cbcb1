"""How every writer publishes what it wrote: one commit, for local paths and for URLs.

A writer asks for a commit, writes into :attr:`Commit.work`, then calls :meth:`Commit.commit`
(or :meth:`Commit.abort`; leaving a ``with`` block without committing aborts). Two kinds:

- :meth:`Commit.local`: ``work`` is a hidden temporary sibling ``.NAME.lean_store-tmp-<hex>``
  (a file, or a directory tree; named by :mod:`.leftovers`, so that the next committed save
  to ``NAME`` removes it if the process writing it died). The commit makes every file and
  directory of it durable (fsyncs, or for a tree one ``syncfs`` where that reports write
  errors), checks once more what the target holds (:mod:`lean_store.stores.target`), moves it
  into place atomically (files: one ``rename``; directories: one
  ``renameat2(RENAME_EXCHANGE)``, then the old tree, swapped out to the temporary name, is
  removed), and fsyncs the parent directory. A crash at any point leaves the previous content
  whole at the target (docs/SECURITY.md).
- :meth:`Commit.url` (fsspec URLs, Zarr stores only): object stores cannot rename a prefix, so
  ``work`` is the final URL, which must not exist yet; the writer's last write, the root
  ``zarr.json`` carrying ``complete``, is the commit marker. Until it is written every reader
  refuses the store; an abort removes everything under the prefix.

Used by the single-process stores (:class:`lean_store.stores.base.StoreWriter`), sharded saves
(:mod:`lean_store.distributed.sharded_save`, :mod:`lean_store.interop.dcp`) and the interop
writers (safetensors, ``.pt``, TorchLean).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import uuid
import weakref
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, TypeGuard

from ..errors import CheckpointError, SaveIOError
from . import commit_order, fs_sync, leftovers, old_files
from .target import FileKind, check_file_kind, check_replaceable

STORAGE_OPTIONS = {"auto_mkdir": True}  # fsspec options for file:// and local:// URLs


def is_url(path: Any) -> TypeGuard[str]:
    """An fsspec URL (``s3://bucket/run/step.zarr``, ``file:///...``): Zarr checkpoints only."""
    return isinstance(path, str) and "://" in path


def at_call_time(path: Any) -> Any:
    """``path`` anchored to the working directory of now, for work that finishes later (a
    background save): a relative path joined to the current directory, ``..`` and links left
    for the file system to resolve as it would now; absolute paths and URLs as they are."""
    if is_url(path):
        return path
    text = os.fspath(path)
    if os.path.isabs(text):
        return text
    try:
        return os.path.join(os.getcwd(), text)
    except OSError:  # the working directory was removed: the save reports the path it gets
        return text


def storage_options_for(url: str, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """fsspec options for ``url``: ``given`` (endpoint, keys, ...) or, by default, none beyond
    creating local directories; s3fs then reads the standard AWS environment variables
    (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ...)."""
    if given is not None:
        return dict(given)
    return dict(STORAGE_OPTIONS) if url.startswith(("file:", "local:")) else {}


def check_parent_directory(path: Any) -> None:
    """CheckpointError unless ``path``'s parent is a directory, naming what is in the way: a
    missing directory, or a file where a directory should be (``run.h5/x.h5``)."""
    parent = Path(path).parent
    if parent.is_dir():
        return
    above = parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if os.path.lexists(above) and not above.is_dir():
        raise CheckpointError(f"cannot save to {path}: {above} is a file, not a directory")
    raise CheckpointError(f"cannot save to {path}: directory {parent} does not exist")


class Commit(ABC):
    """Where a writer writes (:attr:`work`) and how that becomes visible at :attr:`target`."""

    target: str | Path  # what the caller asked for; errors name it, never the temporary
    work: str  # the path or URL to write into
    committed: bool = False

    @staticmethod
    def local(path: str | os.PathLike, *, directory: bool, kind: FileKind | None = None,
              one_writer: bool = False) -> LocalCommit:
        """A commit to a local path; ``directory``: the output is a directory tree (else one
        file). ``kind``: the interop file kind that may be replaced (else only a lean_store
        checkpoint may be, :func:`~lean_store.stores.target.check_replaceable`).
        ``one_writer``: this process alone writes the tree (then one ``syncfs`` can make it
        durable, :mod:`.fs_sync`; trees written by several processes, maybe on other hosts of
        a network file system, are fsynced file by file)."""
        return LocalCommit(Path(path), directory=directory, kind=kind, one_writer=one_writer)

    @staticmethod
    def url(url: str, storage_options: dict[str, Any] | None = None) -> URLCommit:
        """A commit to an fsspec URL prefix that must not exist yet."""
        return URLCommit(url, storage_options)

    @staticmethod
    def at(path: str | os.PathLike, *, directory: bool,
           storage_options: dict[str, Any] | None = None, one_writer: bool = False) -> Commit:
        """:meth:`url` for a URL, else :meth:`local`."""
        if is_url(path):
            return Commit.url(path, storage_options)
        return Commit.local(path, directory=directory, one_writer=one_writer)

    def make_directory(self) -> None:  # noqa: B027 - a URL prefix needs no directory
        """Create :attr:`work` as an empty directory, for writers that write files into it
        without creating it (local: the temporary sibling; a URL: nothing to create)."""

    @abstractmethod
    def commit(self) -> None:
        """Make what was written at :attr:`work` visible at :attr:`target`, durably."""

    @abstractmethod
    def abort(self) -> None:
        """Remove what was written; the target keeps what it had. Never raises for a
        removal that fails (it must not mask the error that led to the abort)."""

    def __enter__(self) -> Commit:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Abort unless committed; an operating system's refusal inside the block (a full
        disk, a read-only file system) becomes a :class:`SaveIOError` naming the target."""
        if not self.committed:
            self.abort()
        if refused_by_os(exc):
            raise SaveIOError.wrapping(self.target, exc) from exc


class LocalCommit(Commit):
    """A hidden temporary sibling, renamed (or exchanged) into place."""

    target: Path

    def __init__(self, path: Path, *, directory: bool, kind: FileKind | None = None,
                 one_writer: bool = False) -> None:
        self.target = path
        self.directory = directory
        self.kind = kind
        check_parent_directory(path)
        self._check()  # before any byte is written; again just before the rename
        # its place among the saves to this path: a later one's commit is never undone
        turn = commit_order.take(path)
        self._turn = turn
        self._turn_over = weakref.finalize(self, turn.release)
        # an old file an earlier save replaced, still being freed in the background, is
        # freed before this save writes: a save never needs more room than it did before
        old_files.wait_released()
        self.work_path = leftovers.new_temporary(path)
        # the temporary stops counting as written at the commit, the abort, or when this
        # object is dropped without either (a DCP save another rank failed): this process's
        # next save to the path then removes it
        self._finished = weakref.finalize(self, leftovers.finished, self.work_path)
        self.work = str(self.work_path)
        self._aborted = False
        # a tree this process writes: made durable by one syncfs that also reports any
        # write error since now
        self._sync = fs_sync.open_sync_point(path.parent) if directory and one_writer else None

    def _check(self) -> None:
        if self.kind is None:
            check_replaceable(self.target, directory=self.directory)
        else:
            check_file_kind(self.target, self.kind)

    def make_directory(self) -> None:
        try:
            self.work_path.mkdir()
        except OSError as exc:
            raise SaveIOError.wrapping(self.target, exc) from exc

    def commit(self) -> None:
        if self.committed or self._aborted:
            raise CheckpointError(f"the save to {self.target} was already "
                                  f"{'committed' if self.committed else 'aborted'}")
        try:
            fsync_tree(self.work_path, self._sync)
            with self._turn.publishing() as latest:
                if latest:
                    _publish(self.work_path, self.target, self._check)
            if not latest:  # a save to this path called after this one has published
                discard_temporary(self.work_path)
        except OSError as exc:
            if not refused_by_os(exc):
                raise
            raise SaveIOError.wrapping(self.target, exc) from exc
        finally:
            if self._sync is not None:
                self._sync.close()
        self.committed = True
        self._finished()
        self._turn_over()
        clear_dead_temporaries(self.target)

    def abort(self) -> None:
        if self.committed:
            return
        self._aborted = True
        if self._sync is not None:
            self._sync.close()
        discard_temporary(self.work_path)
        self._finished()
        self._turn_over()


class URLCommit(Commit):
    """A new URL prefix, written in place; the writer's last write is the commit marker."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.target = url
        self.work = url
        self.storage_options = storage_options
        fs, root = url_fs(url, storage_options)
        if fs.exists(root):
            raise CheckpointError(
                f"{url} exists: a save to a URL never overwrites; use a new prefix per step"
            )

    def commit(self) -> None:
        """Nothing to move: the marker the writer wrote last (the root ``zarr.json`` with
        ``complete``) made the store valid. Only an abort is ruled out from here on."""
        self.committed = True

    def abort(self) -> None:
        if self.committed:
            return
        try:
            fs, root = url_fs(self.work, self.storage_options)
            fs.rm(root, recursive=True)
        except (FileNotFoundError, OSError):  # best effort: never masks the first error
            pass


def url_fs(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path within it."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    return fs, root


# ----------------------------------------------------------------------- local file system


def replace_atomically(tmp: Path, target: Path) -> None:
    """Move the fsynced ``tmp`` to ``target`` as a commit does (see :class:`LocalCommit`).
    Whatever is at ``target`` must be a lean_store checkpoint or an empty directory
    (:func:`lean_store.stores.target.check_replaceable`); anything else is left untouched."""
    _publish(tmp, target, lambda: check_replaceable(target, directory=tmp.is_dir()))


def _publish(tmp: Path, target: Path, check: Any) -> None:
    """``check()`` what is at ``target``, then move ``tmp`` there atomically and make the move
    durable. Directories: one exchange, then the old tree (now at ``tmp``) is removed. Where
    the exchange is unsupported the old tree is renamed aside first
    (``.NAME.lean_store-old-*``): a crash between the two renames leaves no checkpoint at
    ``target`` (see docs/SECURITY.md)."""
    check()
    if tmp.is_dir() and target.exists():
        if _exchange(tmp, target):
            _fsync_dir(target.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = target.with_name(f".{leftovers.sibling_stem(target)}.lean_store-old-"
                               f"{uuid.uuid4().hex}")
        os.rename(target, old)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    held = old_files.hold(target)  # its blocks freed by a background thread, not here
    try:
        os.replace(tmp, target)
    except BaseException:
        old_files.release_now(held)
        raise
    old_files.release_later(held)
    _fsync_dir(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def fsync_tree(path: Path, sync: fs_sync.SyncPoint | None = None) -> None:
    """fsync a file, or every file and directory of a tree. On a file system kept in memory
    (tmpfs, e.g. /dev/shm) there is nothing to make durable, and nothing is done. ``sync``: a
    :class:`~.fs_sync.SyncPoint` opened before the tree was written; then one ``syncfs``
    makes all of it durable and reports any write error (one journal commit for the whole
    tree). Else each file is fsynced, except a file with more than one name: lean_store
    writes each file of a new tree once, under one name, so a second name is an incremental
    step's hard link to a committed checkpoint's file, whose data was made durable when that
    checkpoint was committed; and the directories' entries are made durable by one ``syncfs``
    where the platform has it (:mod:`.fs_sync`), else by an fsync of each directory."""
    if fs_sync.in_memory(path):
        return
    if not path.is_dir():
        _fsync(path)
        return
    if sync is not None:
        sync.sync()
        return
    dirs = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            if os.lstat(file).st_nlink == 1:
                _fsync(Path(file))
        dirs.append(Path(root))
    if not fs_sync.syncfs(path):
        for directory in dirs:
            _fsync_dir(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Remove a file, link or tree if it exists (a tree: as much of it as can be removed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def discard_temporary(path: Path) -> None:
    """Best-effort removal of a temporary after a failure: never masks the first error."""
    try:
        remove_path(path)
    except OSError:
        pass


def clear_dead_temporaries(target: Path) -> list[Path]:
    """Remove the temporaries beside ``target`` of saves whose writer no longer runs
    (:mod:`.leftovers`); return them. Called once a save to ``target`` is committed (the
    target then holds a newer checkpoint than any of them); never raises."""
    dead = leftovers.dead_temporaries(target)
    for path in dead:
        discard_temporary(path)
    return dead


def refused_by_os(exc: BaseException) -> TypeGuard[OSError]:
    """An OSError carrying an errno (the operating system's refusal), not already ours."""
    return (isinstance(exc, OSError) and isinstance(exc.errno, int)
            and not isinstance(exc, CheckpointError))


__all__ = [
    "Commit", "LocalCommit", "URLCommit", "clear_dead_temporaries", "discard_temporary",
    "fsync_tree", "is_url", "refused_by_os", "remove_path", "replace_atomically",
    "storage_options_for", "url_fs",
]
