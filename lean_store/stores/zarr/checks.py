"""Checks of hostile or damaged Zarr stores: keys, documents, codecs, chunk files."""

from __future__ import annotations

import json
import math
import os
import stat
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...chunking import grid_shape
from ...errors import CheckpointError, IntegrityError, UnsafeFileError
from ...hardening import (
    MAX_METADATA_BYTES,
    MAX_SHARD_BYTES,
    MAX_TREE_DEPTH,
    check_chunk_shape,
    check_json_depth,
    file_kind,
    link_inside,
    root_document_limit,
)
from . import shard_index
from .plain import PlainArray
from .root_text import RootText, parse_root


@dataclass
class LocalTree:
    """What a walk of a local Zarr directory found: every regular file, by key relative to
    ``root``. The size of a metadata document (``zarr.json``) is read in the walk, which bounds
    it; any other file's is read with one ``lstat`` when first asked (:meth:`size`), through
    the pinned root directory ``pin`` where there is one (the tree that was opened)."""

    root: Path
    files: dict[str, int | None] = field(default_factory=dict)  # key -> size, None: not read
    pin: Any = None  # a PinnedRoot (``.fd``: the root directory held open), or None
    # the most bytes the root document may have (:func:`root_document_limit` of the array
    # documents the walk found)
    root_limit: int = MAX_METADATA_BYTES
    # node -> the bytes of its own ``zarr.json`` (an array directly under the root), read in
    # the walk through ``pin`` while they fit in :data:`KEPT_DOCUMENT_BYTES`: compared with the
    # root's copies by the open (lean_store's own layout) or at the array's first read (any
    # other), instead of read again then
    documents: dict[str, bytes] = field(default_factory=dict)
    _by_node: dict[str, list[str]] | None = None

    def under(self, node: str) -> list[str]:
        """The keys of the files below ``node``, from one pass over the tree."""
        if "/" not in node:
            by_node = self._by_node
            if by_node is None:
                by_node = {}
                for key in self.files:
                    top, sep, _rest = key.partition("/")
                    if sep:
                        by_node.setdefault(top, []).append(key)
                self._by_node = by_node
            return by_node.get(node, [])
        prefix = f"{node}/"
        return [k for k in self.files if k.startswith(prefix)]

    def documented_nodes(self) -> list[str]:
        """The folders directly under the root that hold a ``zarr.json``: the arrays (and any
        group) the tree holds, whatever the root's consolidated metadata lists."""
        tail = "/zarr.json"
        return [key[:-len(tail)] for key in self.files
                if key.endswith(tail) and key.find("/") == len(key) - len(tail)]

    def size(self, key: str) -> int:
        """The size of the file ``key`` the walk found (KeyError for any other key), read with
        an ``lstat`` the first time it is asked. A file no longer there, or no longer a
        regular file: :class:`IntegrityError`."""
        size = self.files[key]
        if size is None:
            try:
                if self.pin is not None:
                    info = os.stat(key, dir_fd=self.pin.fd, follow_symlinks=False)
                else:
                    info = os.lstat(f"{os.fspath(self.root)}/{key}")
            except OSError as exc:
                raise IntegrityError(f"{key}: cannot be read ({exc.strerror}); the checkpoint "
                                     "changed while it was read") from None
            if not stat.S_ISREG(info.st_mode):
                raise IntegrityError(f"{key}: changed while the checkpoint was read")
            size = self.files[key] = info.st_size
        return size


KEPT_DOCUMENT_BYTES = 16 << 20
"""The most bytes of array documents one walk keeps (:attr:`LocalTree.documents`): ~16,000
arrays of lean_store's; the documents of larger stores are read when each array is first
read, as the walk's ``lstat`` alone gave their sizes."""


def scan_local_zarr(root: Path, pin: Any = None) -> LocalTree:
    """Walk a Zarr directory once, without following links: reject any symlink or special
    file, and over-large metadata documents (an array's: :data:`MAX_METADATA_BYTES`; the
    root's, once the walk is done: :func:`root_document_limit` of the array documents found,
    kept as ``root_limit``). The walk is bounded by what is on disk. A
    document's nesting (the root's, an array's own) is checked by whoever parses it:
    :func:`read_json_at`, or :func:`check_zarr_document` before zarr opens it.

    Each entry's type comes from its directory entry (``d_type``: no ``stat`` where the file
    system reports it); only a ``zarr.json`` is ``lstat``'ed here, for its size. A chunk
    file's size is read when asked (:meth:`LocalTree.size`). ``pin``: the root directory held
    open (a PinnedRoot), through which those sizes are read later; with it, the ``zarr.json``
    of each array directly under the root is read whole instead of ``lstat``'ed (same bound),
    and kept in ``documents`` up to :data:`KEPT_DOCUMENT_BYTES` in all."""
    tree = LocalTree(root, pin=pin)
    room = KEPT_DOCUMENT_BYTES if pin is not None else 0
    if not (root / "zarr.json").exists():
        return tree  # the zarr open that follows reports the missing metadata
    pending = [("", 0)]  # iterative, depth-first: no recursion, bounded depth
    base = os.fspath(root)
    files = tree.files
    while pending:
        prefix, depth = pending.pop()
        try:  # entries taken as the listing goes (what is raised below is no OSError)
            with os.scandir(base + "/" + prefix if prefix else base) as listing:
                for entry in listing:
                    if entry.is_file(follow_symlinks=False):  # by the entry's type: no stat
                        name = entry.name
                        # a document's size is bounded here; any other file's is read later
                        if name != "zarr.json":
                            files[prefix + name] = None
                        elif depth == 1 and room > 0:  # an array's: read through the pin
                            raw = read_bytes_at(pin.fd, prefix + name)
                            files[prefix + name] = len(raw)
                            tree.documents[prefix[:-1]] = raw
                            room -= len(raw)
                        else:
                            files[prefix + name] = _document_size(entry, prefix)
                    elif entry.is_dir(follow_symlinks=False):  # known without following it
                        key = prefix + entry.name
                        if depth + 1 > MAX_TREE_DEPTH:
                            raise UnsafeFileError(
                                f"{key}: directories nested more than {MAX_TREE_DEPTH} deep "
                                "inside the checkpoint; no lean_store writer makes them"
                            )
                        pending.append((key + "/", depth + 1))
                    else:
                        _neither(entry, prefix, files)
        except OSError as exc:
            raise IntegrityError(f"{prefix or '.'}: unreadable directory ({exc})") from None
    _bound_root(tree)
    return tree


def _bound_root(tree: LocalTree) -> None:
    """The root document's limit from the array documents the walk found, and its size
    checked against it."""
    size = tree.files.get("zarr.json")
    if size is None:
        return
    documents = sum(n or 0 for key, n in tree.files.items()
                    if key != "zarr.json" and key.endswith("/zarr.json"))
    tree.root_limit = root_document_limit(documents)
    if size > tree.root_limit:
        raise UnsafeFileError(f"zarr.json: {size} bytes of metadata, more than the "
                              f"{tree.root_limit} its {documents} bytes of array documents "
                              "allow")


def check_root_size(root: Path, documents: dict[str, str] | None = None) -> None:
    """A save's check, before its commit, that a load will read the root ``zarr.json`` it
    wrote at ``root``: at most :func:`root_document_limit` of the array documents
    ``documents`` (node -> text as written; None: measured on disk). Else
    :class:`CheckpointError`: the root's own attributes are too large."""
    size = (root / "zarr.json").stat().st_size
    written = array_document_bytes(root) if documents is None else sum(
        len(text) for text in documents.values())
    if size > root_document_limit(written):
        raise CheckpointError(
            f"{root.name}: the root zarr.json would be {size} bytes, more than the "
            f"{root_document_limit(written)} a load reads for {written} bytes of array "
            "documents: the root attributes (the training metadata: the JSON values of extra= "
            "and data=) are too large; keep large values out of them, or pass them as arrays "
            "or tensors")


def array_document_bytes(root: Path | int) -> int:
    """The bytes of the ``zarr.json`` of every folder directly under ``root`` (a path, or a
    directory's descriptor), one ``stat`` each, no link followed."""
    total = 0
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                key = f"{entry.name}/zarr.json"
                with suppress(FileNotFoundError):
                    total += (os.stat(key, dir_fd=root, follow_symlinks=False)
                              if isinstance(root, int) else os.lstat(root / key)).st_size
    return total


def _lstat(entry: os.DirEntry[str], key: str) -> os.stat_result:
    """``entry``'s own ``lstat``; IntegrityError when it vanished since it was listed."""
    try:
        return entry.stat(follow_symlinks=False)
    except OSError as exc:
        raise IntegrityError(f"{key}: changed while the checkpoint was read "
                             f"({exc.strerror})") from None


def _document_size(entry: os.DirEntry[str], prefix: str) -> int:
    """The size of the ``zarr.json`` at ``entry`` (one ``lstat``), at most
    ``MAX_METADATA_BYTES`` but for the root's (bounded once the walk is done)."""
    key = prefix + entry.name
    info = _lstat(entry, key)
    if not stat.S_ISREG(info.st_mode):  # replaced since it was listed
        raise IntegrityError(f"{key}: changed while the checkpoint was read")
    if info.st_size > MAX_METADATA_BYTES and prefix:
        raise UnsafeFileError(f"{key}: {info.st_size} bytes of metadata")
    return info.st_size


def _neither(entry: os.DirEntry[str], prefix: str, files: dict[str, int | None]) -> None:
    """An entry whose type is neither a regular file nor a directory: ``lstat``'ed for what
    it is. A link or a special file is refused; a regular file (replaced since it was
    listed) is taken as one."""
    key = prefix + entry.name
    info = _lstat(entry, key)
    mode = info.st_mode
    if stat.S_ISREG(mode):
        if entry.name == "zarr.json" and info.st_size > MAX_METADATA_BYTES and prefix:
            raise UnsafeFileError(f"{key}: {info.st_size} bytes of metadata")
        files[key] = info.st_size
        return
    if stat.S_ISLNK(mode):
        raise UnsafeFileError(link_inside(key, entry.path))
    if stat.S_ISDIR(mode):  # replaced by a directory since it was listed
        raise IntegrityError(f"{key}: changed while the checkpoint was read")
    raise UnsafeFileError(f"{key}: {file_kind(mode)} inside the checkpoint")


def check_zarr_document(root: Path, key: str, limit: int | None = None) -> None:
    """Bounded size (``limit`` bytes) and nesting of the metadata document ``key`` below
    ``root``, checked on the raw bytes before zarr parses them (``None``:
    :data:`MAX_METADATA_BYTES`)."""
    limit = MAX_METADATA_BYTES if limit is None else limit
    try:
        with (root / key).open("rb") as f:
            raw = f.read(limit + 1)
    except OSError:
        return  # missing or unreadable: the zarr open that follows reports it
    if len(raw) > limit:
        raise UnsafeFileError(f"{key}: more than {limit} bytes of metadata")
    check_json_depth(raw, key)


def read_json_at(dir_fd: int, key: str, limit: int | None = None) -> Any:
    """The JSON document at ``key`` below the directory ``dir_fd`` (no link followed), with
    the bounds of :func:`scan_local_zarr` (size: ``limit``, nesting) checked on the raw bytes
    before it is parsed. Missing, unreadable or malformed: :class:`IntegrityError`."""
    return parse_json(read_bytes_at(dir_fd, key, limit), key)


def parse_json(raw: bytes, key: str) -> Any:
    """The JSON document ``raw`` (the bytes of ``key``, bounded in size) parsed after its
    nesting is checked. Malformed: :class:`IntegrityError`."""
    check_json_depth(raw, key)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise IntegrityError(f"{key}: not valid JSON ({exc})") from None


def read_root_at(dir_fd: int, limit: int, key: str = "zarr.json") -> RootText:
    """The root document at ``key`` (at most ``limit`` bytes: ``LocalTree.root_limit``) as
    :func:`read_json_at` reads it, with the text of its consolidated members kept
    (:mod:`.root_text`: an array's own document is compared with its copy there as text
    first)."""
    raw = read_bytes_at(dir_fd, key, limit)
    check_json_depth(raw, key)
    try:
        return parse_root(raw)
    except ValueError as exc:
        raise IntegrityError(f"{key}: not valid JSON ({exc})") from None


# no link followed; a FIFO swapped in for a document opens without blocking (and reads empty)
_O_READ = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
           | getattr(os, "O_NONBLOCK", 0))


_FIRST_READ = 64 << 10  # one read takes a whole array document (about 1 KiB) and more


def read_bytes_at(dir_fd: int, key: str, limit: int | None = None) -> bytes:
    """The bytes of the metadata file ``key`` below ``dir_fd`` (at most ``limit``; ``None``:
    :data:`MAX_METADATA_BYTES`): one open and, for a document of less than 64 KiB, one read
    (a read of a regular file returns fewer bytes than asked only at its end)."""
    limit = MAX_METADATA_BYTES if limit is None else limit
    try:
        fd = os.open(key, _O_READ, dir_fd=dir_fd)
    except OSError as exc:
        raise IntegrityError(f"{key}: cannot be read ({exc.strerror})") from None
    try:
        parts = []
        total, want = 0, _FIRST_READ
        while total <= limit:
            part = os.read(fd, want)
            parts.append(part)
            total += len(part)
            if len(part) < want:
                break
            want = min(max(want, total), limit + 1 - total) or 1
    except OSError as exc:
        raise IntegrityError(f"{key}: cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if total > limit:
        raise UnsafeFileError(f"{key}: more than {limit} bytes of metadata")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def check_zarr_key(key: str) -> None:
    """A store key must stay inside the store: no absolute paths, no ``..``, no backslashes."""
    if (
        not key or key.startswith("/") or "\\" in key or "\x00" in key
        or any(part in ("", ".", "..") for part in key.split("/"))
    ):
        raise UnsafeFileError(f"store key {key!r} escapes or is malformed")


def codec_names(metadata: Any) -> tuple[list[str], list[str]]:
    """(outer codec class names, inner codec class names; inner = outer without sharding)."""
    outer = [type(c).__name__ for c in getattr(metadata, "codecs", ())]
    inner = outer
    for codec in getattr(metadata, "codecs", ()):
        if type(codec).__name__ == "ShardingCodec":
            inner = [type(c).__name__ for c in codec.codecs]
            index = [type(c).__name__ for c in codec.index_codecs]
            unknown = [n for n in inner + index if n not in ZARR_CODECS or n == "ShardingCodec"]
            if unknown:
                raise UnsafeFileError(f"unsupported codecs inside a shard: {unknown}")
    return outer, inner


def array_codec_names(array: Any) -> tuple[list[str], list[str]]:
    """:func:`codec_names` of a zarr array or a :class:`.plain.PlainArray`."""
    if isinstance(array, PlainArray):
        return array.codec_names()
    return codec_names(array.metadata)


def check_zarr_array(node: str, array: Any) -> None:
    """Only the codecs lean_store writes; bounded chunk and shard shapes."""
    meta = array.metadata
    outer, _inner = codec_names(meta)
    unknown = [n for n in outer if n not in ZARR_CODECS]
    if unknown:
        raise UnsafeFileError(f"{node!r}: unsupported Zarr codecs {unknown}")
    if getattr(meta, "storage_transformers", ()):
        raise UnsafeFileError(f"{node!r}: storage transformers are not supported")
    shape = tuple(array.shape)
    itemsize = array.dtype.itemsize
    outer_chunks = zarr_grid(node, array)
    check_chunk_shape(node, tuple(array.chunks), shape, itemsize)
    check_chunk_shape(node, outer_chunks, shape, itemsize, MAX_SHARD_BYTES)


def zarr_chunk_keys(node: str, array: Any, present: int) -> list[tuple[str, tuple[int, ...]]]:
    """(key, grid coordinates) of every chunk or shard file of ``array``, keys relative to the
    store root. Raises before enumerating when the grid claims more files than ``present``."""
    from .compat import chunk_key

    outer = zarr_grid(node, array)
    grid = grid_shape(array.shape, outer)
    expected = math.prod(grid)
    if expected > present:
        raise _truncated(node, present, expected)
    return [(f"{node}/{chunk_key(array, coords)}", coords) for coords in np.ndindex(*grid)]


def zarr_expected_file_size(array: Any, coords: tuple[int, ...]) -> int | None:
    """Exact size of the chunk/shard file at ``coords`` when no compressor is used, else None.
    A shard at the edge holds only the inner chunks that overlap the array."""
    meta = array.metadata
    outer, inner = codec_names(meta)
    if any(n in ZARR_COMPRESSORS for n in inner) or "BytesCodec" not in inner:
        return None
    crc = 4 if "Crc32cCodec" in inner else 0
    inner_bytes = math.prod(array.chunks) * array.dtype.itemsize + crc
    if "ShardingCodec" not in outer:
        return inner_bytes
    shard = next(c for c in meta.codecs if type(c).__name__ == "ShardingCodec")
    shard_shape = zarr_grid("array", array)
    n_slots = math.prod(s // c for s, c in zip(shard_shape, shard.chunk_shape))
    n_inner = math.prod(
        -(-min(s, d - i * s) // c)
        for s, c, d, i in zip(shard_shape, shard.chunk_shape, array.shape, coords)
    )
    index_crc = 4 if any(type(c).__name__ == "Crc32cCodec" for c in shard.index_codecs) else 0
    return n_inner * inner_bytes + shard_index.index_bytes(n_slots, crc=False) + index_crc


def check_zarr_present(node: str, array: Any, tree: LocalTree) -> None:
    """Every chunk (shard) file is present and, uncompressed, exactly the right size. The one
    file of a one-chunk array of the direct layout (:attr:`.plain.PlainArray.
    length_checked_file`) is only looked up, without a ``stat``: its read checks its length,
    and so does :func:`check_zarr_lengths` (``check_metadata``, which a load runs on every
    tensor before it installs any)."""
    if math.prod(array.shape) == 0:
        return
    found = tree.files
    one = array.length_checked_file if isinstance(array, PlainArray) else None
    if one is not None:  # its one file: looked up, not stat'ed
        if one[0] not in found:
            raise _missing(node, one[0])
        return
    present = tree.under(node)
    if isinstance(array, PlainArray):  # keys and sizes from the document alone
        expected = math.prod(grid_shape(array.shape, array.grid))
        if expected > len(present):
            raise _truncated(node, len(present), expected)
        files: Any = array.files()
    else:
        files = ((key, coords, zarr_expected_file_size(array, coords))
                 for key, coords in zarr_chunk_keys(node, array, len(present)))
    for key, _coords, size in files:
        if key not in found:
            raise _missing(node, key)
        if size is not None:
            _check_size(node, key, tree.size(key), size)


def check_zarr_lengths(node: str, array: Any, tree: LocalTree) -> None:
    """The length of every file :func:`check_zarr_present` left to the read (the one file of
    a one-chunk array of the direct layout), checked now: one ``lstat``."""
    one = array.length_checked_file if isinstance(array, PlainArray) else None
    if one is not None:
        _check_size(node, one[0], tree.size(one[0]), one[1])


def _missing(node: str, key: str) -> IntegrityError:
    return IntegrityError(f"{node!r}: chunk file {key!r} is missing; the data is truncated")


def _check_size(node: str, key: str, got: int, size: int) -> None:
    if got != size:
        raise IntegrityError(
            f"{node!r}: chunk file {key!r} has {got} bytes, expected {size}; it is truncated "
            "or corrupt"
        )


def _truncated(node: str, present: int, expected: int) -> IntegrityError:
    return IntegrityError(
        f"{node!r}: {present} of {expected} chunk files are present; the checkpoint is "
        "truncated or was never completely written"
    )


def touched_keys(node: str, array: Any, selection: Any) -> list[str]:
    """Store keys of the chunk (shard) files a strided selection reads. The selection covers
    the tensor's axes; a trailing (re, im) axis of word pairs is read whole."""
    from ...chunking import touched_cells
    from .compat import chunk_key, store_and_prefix

    outer = zarr_grid(node, array)
    cells = touched_cells(selection.start, selection.count, selection.step, outer,
                          tuple(int(d) for d in array.shape))
    _store, prefix = store_and_prefix(array)
    base = f"{prefix}/" if prefix else ""
    return [base + chunk_key(array, coords) for coords in cells]


def check_zarr_keys_exist(node: str, array: Any, keys: list[str]) -> None:
    """For non-local stores: each key must exist (a missing chunk must never read as fill)."""
    from .compat import store_and_prefix, store_has

    store, _prefix = store_and_prefix(array)
    for key in keys:
        if not store_has(store, key):
            raise IntegrityError(f"{node!r}: chunk {key!r} is missing; the data is truncated")


def zarr_grid(node: str, array: Any) -> tuple[int, ...]:
    """The shape of one cell (shard, or chunk when unsharded) of ``array``'s regular grid."""
    from .compat import regular_grid

    outer = regular_grid(array)
    if outer is None or len(outer) != len(array.shape):
        raise UnsafeFileError(f"{node!r}: not a regular Zarr chunk grid")
    return outer


ZARR_CODECS = frozenset(
    {"BytesCodec", "Crc32cCodec", "ShardingCodec", "ZstdCodec", "GzipCodec", "BloscCodec"}
)


ZARR_COMPRESSORS = frozenset({"ZstdCodec", "GzipCodec", "BloscCodec"})
