"""What a save may replace: nothing but a lean_store checkpoint (or an empty directory).

Every writer that publishes at a path (the single-file and Zarr stores, sharded saves, the
``Checkpointer``) asks :func:`check_replaceable` before it starts and again just before it
commits. A checkpoint is recognised by its root metadata, the ``lean_store`` attribute that every
writer puts at the root:

- an HDF5 file whose root attribute ``lean_store`` is the fixed-length string ``"lean_store"``;
- a directory whose ``zarr.json`` is a Zarr v3 group with ``attributes.lean_store`` equal to
  ``"lean_store"`` (single-process and sharded Zarr checkpoints);
- a directory holding such an HDF5 file as ``lean_store.h5`` (a sharded HDF5 checkpoint).

Anything else (a directory with entries, a regular file, a foreign HDF5 file, a symbolic link,
a FIFO, ...) raises :class:`~lean_store.errors.ForeignPathError` and is not touched. An empty
directory holds nothing to lose and may be replaced by a directory store. The probe reads at most
one small attribute or one bounded JSON file, never follows a symbolic link, and never opens
anything but a regular file.

The interop writers (safetensors, ``.pt``, TorchLean) ask :func:`check_file_kind` instead: a
regular file of the kind they write (recognised by its first bytes, :class:`FileKind`) may be
replaced; anything else (a directory, a link, a file of another kind, an empty file) is refused.
"""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointBusyError, CheckpointError, ForeignPathError
from .json_top import last_member, leading_members, top_level_members

FORMAT_NAME = "lean_store"  # the root attribute ``lean_store`` of every checkpoint holds this
SHARDED_HDF5_MASTER = "lean_store.h5"  # the master file of a sharded HDF5 checkpoint
MAX_ZARR_JSON = 256 << 20  # a root zarr.json larger than this is not one lean_store wrote
_SHOWN_ENTRIES = 3
_ZARR_ROOT_MEMBERS = frozenset({"zarr_format", "node_type", "attributes"})
_ZARR_ROOT_HEAD = frozenset({"attributes", "zarr_format"})  # the leading members
_ROOT_HEAD_BYTES = 1 << 20  # a root zarr.json larger than this is read from both ends first
_ROOT_TAIL_BYTES = 4096


def check_replaceable(path: str | os.PathLike, *, directory: bool | None = None) -> None:
    """Raise :class:`ForeignPathError` unless ``path`` is absent, an empty directory, or a
    lean_store checkpoint. ``directory``: whether the new checkpoint is a directory (True) or
    a file (False); a checkpoint of the other kind is refused too (None: not checked)."""
    target = Path(path)
    found = occupant(target)
    if found is not None:
        raise ForeignPathError.at(path, found)
    if directory is None or not os.path.lexists(target):
        return
    if directory and not target.is_dir():
        raise CheckpointError(
            f"cannot replace {path} with a directory store: it is a checkpoint file; remove it "
            "first to overwrite it on purpose, or save to another path"
        )
    if not directory and target.is_dir():
        what = "an empty directory" if not any(target.iterdir()) else "a checkpoint directory"
        raise CheckpointError(
            f"cannot replace {path} with a single-file checkpoint: it is {what}; remove it "
            "first to overwrite it on purpose, or save to another path"
        )


@dataclass(frozen=True)
class FileKind:
    """A kind of single file an interop writer produces: its name in words, and a test of a
    file's first bytes (at most :attr:`probe` of them) that says whether a file is one."""

    name: str
    recognise: Callable[[bytes], bool]
    probe: int = 4096


def check_file_kind(path: str | os.PathLike, kind: FileKind) -> None:
    """Raise :class:`ForeignPathError` unless ``path`` is absent or a regular file (not a link)
    whose first bytes ``kind`` recognises: an interop writer replaces its own kind of file only.
    """
    target = Path(path)
    try:
        st = target.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ForeignPathError.at(path, f"unreadable ({exc.strerror})", wanted=kind.name
                                  ) from None
    mode = st.st_mode
    if stat.S_ISREG(mode):
        try:
            with open(target, "rb") as f:
                head = f.read(kind.probe)
        except OSError as exc:
            raise ForeignPathError.at(path, f"a file that cannot be read ({exc.strerror})",
                                      wanted=kind.name) from None
        if head and kind.recognise(head):
            return
        what = "an empty regular file" if not head else f"a regular file of {st.st_size} bytes"
        found = f"{what} that is not {kind.name}"
    elif stat.S_ISDIR(mode):
        found = "a directory"
    elif stat.S_ISLNK(mode):
        found = f"a symbolic link (to {os.readlink(target)!r}); lean_store does not replace links"
    else:
        found = _special_kind(mode)
    raise ForeignPathError.at(path, found, wanted=kind.name)


def occupant(path: Path) -> str | None:
    """None when a save may replace ``path``, else what is there, in words."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(path)!r}); lean_store does not replace links"
    if stat.S_ISREG(mode):
        return _file_occupant(path, st.st_size)
    if stat.S_ISDIR(mode):
        return _dir_occupant(path)
    return _special_kind(mode)


def is_checkpoint(path: Path) -> bool:
    """True when ``path`` (not followed if a link) holds a lean_store checkpoint."""
    try:
        st = path.lstat()
    except OSError:
        return False
    if stat.S_ISREG(st.st_mode):
        return _hdf5_is_lean_store(path)
    if stat.S_ISDIR(st.st_mode):
        return _dir_is_lean_store(path)
    return False


def _file_occupant(path: Path, size: int) -> str | None:
    if size == 0:
        return "an empty regular file"
    if not _is_hdf5(path):
        return f"a regular file of {size} bytes that is not HDF5"
    try:
        if _hdf5_is_lean_store(path, quiet=False):
            return None
    except Exception as exc:  # noqa: BLE001 - h5py raises many types for damaged files
        return f"an HDF5 file of {size} bytes that cannot be opened ({exc})"
    return f"an HDF5 file of {size} bytes without lean_store's root metadata"


def _dir_occupant(path: Path) -> str | None:
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        return f"a directory that cannot be listed ({exc.strerror})"
    if not names:
        return None
    if _dir_is_lean_store(path):
        return None
    shown = ", ".join(repr(n) for n in names[:_SHOWN_ENTRIES])
    more = ", ..." if len(names) > _SHOWN_ENTRIES else ""
    what = "entry" if len(names) == 1 else "entries"
    return f"a directory with {len(names)} {what} ({shown}{more})"


def _dir_is_lean_store(path: Path) -> bool:
    return _zarr_is_lean_store(path / "zarr.json") or _hdf5_is_lean_store(
        path / SHARDED_HDF5_MASTER
    )


def _regular(path: Path) -> int | None:
    """The size of ``path`` when it is a regular file (not a link), else None."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _zarr_is_lean_store(meta: Path) -> bool:
    size = _regular(meta)
    if size is None or size > MAX_ZARR_JSON:
        return False
    try:
        doc = _zarr_root_members(meta, size)
    except (OSError, ValueError):
        return False
    if doc is None or doc.get("zarr_format") != 3:
        return False
    if doc.get("node_type") != "group":
        return False
    attrs = doc.get("attributes")
    return isinstance(attrs, dict) and attrs.get("lean_store") == FORMAT_NAME


def _zarr_root_members(meta: Path, size: int) -> dict[str, Any] | None:
    """``zarr_format``, ``node_type`` and ``attributes`` of a root ``zarr.json`` of ``size``
    bytes. A root with consolidated metadata holds ~1.3 kB per array: a large one whose
    leading members are ``attributes`` and ``zarr_format`` and whose last is ``node_type`` (as
    zarr-python and lean_store write it) has only its first part and its end read; any other
    is parsed whole, keeping those three members only."""
    with open(meta, "rb") as f:
        if size > _ROOT_HEAD_BYTES:
            f.seek(size - _ROOT_TAIL_BYTES)
            last = last_member(f.read().decode("utf-8", "replace"))
            if last is not None and last[0] == "node_type":
                f.seek(0)
                decode = codecs.getincrementaldecoder("utf-8")().decode
                head = decode(f.read(_ROOT_HEAD_BYTES))
                while True:
                    found = leading_members(head, _ZARR_ROOT_HEAD)
                    if found is not None and found.keys() == _ZARR_ROOT_HEAD:
                        return {**found, "node_type": last[1]}
                    more = f.read(len(head))  # a cut-short head: twice as much of it
                    if not more:
                        break
                    head += decode(more)
                del head
            f.seek(0)
        return top_level_members(f.read().decode("utf-8"), _ZARR_ROOT_MEMBERS)


def _is_hdf5(path: Path) -> bool:
    """HDF5's signature at 0 or after a user block, read directly (not through libhdf5, whose
    default driver ``HDF5_DRIVER`` may change); ``path`` is a regular file."""
    from .hdf5.checks import hdf5_superblock_offset

    try:
        return hdf5_superblock_offset(path) is not None
    except OSError:
        return False


def _hdf5_is_lean_store(path: Path, *, quiet: bool = True) -> bool:
    """Read the root attribute ``lean_store`` of an HDF5 file, when it is a short fixed-length
    string (what lean_store writes; a variable-length string would be read from the global heap,
    which lean_store never touches in a file it did not vet). ``quiet``: False when a file that
    cannot be opened should raise h5py's error rather than count as not lean_store's. A file
    another process holds open for writing is read without HDF5's lock: only this attribute
    is read, to know whether a save may replace the file (by a rename: the file itself is
    never written)."""
    import h5py

    from .hdf5.files import open_file

    if _regular(path) is None or not _is_hdf5(path):
        return False
    try:
        try:
            f = open_file(path, "r")
        except CheckpointBusyError:
            f = open_file(path, "r", locking=False)
    except Exception:  # noqa: BLE001 - h5py raises many types for damaged files
        if quiet:
            return False
        raise
    try:
        with f:
            if FORMAT_NAME not in f.attrs:
                return False
            aid = f.attrs.get_id(FORMAT_NAME)
            info = h5py.check_string_dtype(aid.dtype)
            if info is None or info.length is None or info.length > 64 or aid.shape != ():
                return False
            value = f.attrs[FORMAT_NAME]
    except Exception:  # noqa: BLE001 - h5py raises many types for damaged files
        return False
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value == FORMAT_NAME


def _special_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    for test, words in kinds:
        if test(mode):
            return words
    return "a special file"


__all__ = [
    "FORMAT_NAME", "FileKind", "check_file_kind", "check_replaceable", "is_checkpoint", "occupant",
]
