"""Limits that keep a hostile or damaged file from crashing, hanging, exhausting memory or
reaching outside the checkpoint.

The rule: nothing is allocated or iterated in proportion to a size the file *claims*; every
claim is first compared with what is actually present (chunk records and bytes in an HDF5
file, chunk files in a Zarr directory). Violations raise :class:`UnsafeFileError` (the file
tries something no lean_store writer does) or :class:`IntegrityError` (it is damaged).
"""

from __future__ import annotations

import math
import os
import stat

import numpy as np

from .errors import CheckpointError, UnsafeFileError

MAX_CHUNK_BYTES = 1 << 30  # one chunk (HDF5) or inner chunk (Zarr), decoded
MAX_SHARD_BYTES = 8 << 30  # one Zarr shard file, decoded
MAX_ATTR_BYTES = 64 << 20  # one attribute value (the layout JSON is the largest we write)
MAX_ATTRS = 1024  # attributes per object
MAX_METADATA_BYTES = 64 << 20  # one zarr.json (a root: see root_document_limit)
MAX_RANK = 32
MAX_JSON_DEPTH = 64  # nesting of any JSON lean_store parses (its own documents nest < 10 deep)
MAX_TREE_DEPTH = MAX_RANK + 8  # directories below a Zarr root: node, "c", one per chunk axis


def check_chunk_shape(
    node: str, chunk_shape: tuple[int, ...], stored_shape: tuple[int, ...], itemsize: int,
    limit: int = MAX_CHUNK_BYTES,
) -> None:
    """A chunk shape must have the array's rank, positive sides and a bounded size."""
    if len(stored_shape) > MAX_RANK:
        raise UnsafeFileError(f"{node!r}: rank {len(stored_shape)} exceeds {MAX_RANK}")
    if len(chunk_shape) != len(stored_shape):
        raise UnsafeFileError(f"{node!r}: chunk shape {chunk_shape} does not match the rank")
    if any(not isinstance(c, (int, np.integer)) or c < 1 for c in chunk_shape):
        raise UnsafeFileError(f"{node!r}: invalid chunk shape {chunk_shape}")
    nbytes = math.prod(map(int, chunk_shape)) * max(1, itemsize)
    if nbytes > limit:
        raise UnsafeFileError(
            f"{node!r}: chunk shape {chunk_shape} means {nbytes} bytes per chunk "
            f"(limit {limit}); refusing to allocate it"
        )



# ----------------------------------------------------------------------------------- paths


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def without_trailing_separators(path: str) -> str:
    """``path`` without trailing ``/`` ("run.h5/" names run.h5, as pathlib and so every save
    takes it: the same string then opens what it saved); "/" stays."""
    return (path.rstrip("/") or "/") if path.endswith("/") else path


def check_checkpoint_path(path: str | os.PathLike, *, what: str = "checkpoint") -> None:
    """A local checkpoint path must be a regular file or a directory (or a symlink to one).

    Checked with ``stat`` before anything opens the path: opening a FIFO blocks forever and a
    device reads without end, so they are refused with what they are, never opened."""
    p = os.fspath(path)
    if isinstance(p, str):
        p = without_trailing_separators(p)
    must = f"{'an' if what[:1] in 'aeiou' else 'a'} {what} must be a regular file or a directory"
    try:
        link = os.lstat(p)
    except FileNotFoundError:
        raise CheckpointError(f"no {what} at {p}: the path does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot inspect {p}: {exc.strerror or exc}") from None
    if stat.S_ISREG(link.st_mode) or stat.S_ISDIR(link.st_mode):
        return
    if not stat.S_ISLNK(link.st_mode):
        raise CheckpointError(f"{p} is {file_kind(link.st_mode)}; {must}")
    try:
        target = os.stat(p)
    except OSError:
        raise CheckpointError(
            f"{p} is a dangling symlink (to {os.readlink(p)!r}); no {what} is there"
        ) from None
    if not (stat.S_ISREG(target.st_mode) or stat.S_ISDIR(target.st_mode)):
        raise CheckpointError(
            f"{p} is a symlink to {os.path.realpath(p)}, which is {file_kind(target.st_mode)}; "
            f"{must}"
        )


def link_inside(where: str, link: str | os.PathLike[str]) -> str:
    """Why a symlink inside a checkpoint directory (``where``: what it is, e.g. its key; ``link``:
    its path) is refused, where it points, and the way to a copy that reads: tools that
    share files by links (the Hugging Face Hub cache, git-annex, DVC's symlink cache) make
    such trees."""
    try:
        target = f" (to {os.readlink(link)!r})"
    except OSError:
        target = ""
    return (
        f"{where}: a symlink inside the checkpoint{target}; lean_store reads only the regular "
        "files of a checkpoint directory, never a link in it (docs/SECURITY.md). A copy with "
        "the links resolved reads: cp -rL CHECKPOINT COPY (for a Hugging Face Hub download, "
        "snapshot_download(..., local_dir=DIR) writes regular files)"
    )


# ------------------------------------------------------------------------------------ JSON


_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')  # deleted before counting
_BRACKETS = np.zeros(256, np.int8)
_BRACKETS[[ord("["), ord("{")]] = 1
_BRACKETS[[ord("]"), ord("}")]] = -1


def json_depth(raw: str | bytes, block: int = 1 << 22) -> int:
    """Deepest nesting of arrays and objects in JSON text, found without parsing it: linear
    time, bounded memory, no recursion. Escape pairs are cut out first (a backslash pair, then
    an escaped quote, left to right as a JSON lexer pairs them), so the quotes left delimit
    strings, and brackets count only outside them. For malformed text the figure is an
    estimate; the parser that follows reports the error."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    first = data.find(b"\\")
    if first >= 0:  # the escapes lie between the first backslash and the byte after the last
        end = data.rfind(b"\\") + 2
        data = data[:first] + data[first:end].replace(b"\\\\", b"").replace(b'\\"', b"") \
            + data[end:]
    data = data.translate(None, _NOT_STRUCTURE)  # only quotes and brackets matter
    # two adjacent quotes go (an empty string, or the end of one and the start of the
    # next): the quotes before any bracket change in number by two, so which brackets lie
    # inside strings does not change
    data = data.replace(b'""', b"")
    depth, deepest, quoted = 0, 0, 0
    for at in range(0, len(data), block):
        codes = np.frombuffer(data, np.uint8, min(block, len(data) - at), at)
        # parity of the quotes so far (a uint8 sum wraps, its parity does not)
        inside = (np.cumsum(codes == ord('"'), dtype=np.uint8) + quoted) & 1
        quoted = int(inside[-1])
        step = _BRACKETS[codes]
        step[inside.view(bool)] = 0
        levels = np.cumsum(step, dtype=np.int64)
        deepest = max(deepest, depth + int(levels.max()))
        depth += int(levels[-1])
    return deepest


_COUNTED_BELOW = 1 << 16  # a short text's brackets are counted first; a long one has many


def check_json_depth(raw: str | bytes, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """:class:`UnsafeFileError` when JSON text nests deeper than ``limit`` (checked before any
    parser recurses into it)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if len(data) < _COUNTED_BELOW and data.count(b"[") + data.count(b"{") <= limit:
        return  # cannot nest deeper than it has brackets
    depth = json_depth(data)
    if depth > limit:
        raise UnsafeFileError(
            f"{where}: JSON nested {depth} levels deep (limit {limit}); refusing to parse it"
        )


# ------------------------------------------------------ metadata that grows with the tensors


def root_document_limit(array_documents: int) -> int:
    """The most bytes the root ``zarr.json`` of a Zarr store may have when the store's own
    array documents hold ``array_documents`` bytes: :data:`MAX_METADATA_BYTES`, plus twice
    those bytes. The root's consolidated metadata repeats every array's document (nested
    deeper, so indented more) and the layout adds ~130 bytes per tensor, so a store of many
    tensors (~1.5 KiB of root per tensor: 44,000 tensors pass 64 MiB) is read, while the root
    stays bounded by what the store holds."""
    return MAX_METADATA_BYTES + 2 * array_documents


def root_attr_limit(file_size: int) -> int:
    """The most bytes one root attribute of an HDF5 file of ``file_size`` bytes may have:
    :data:`MAX_ATTR_BYTES`, or the file's size where larger. The manifest grows with the
    tensors (~350 bytes each: 190,000 tensors pass 64 MiB), and no attribute holds more bytes
    than the file it is in."""
    return max(MAX_ATTR_BYTES, file_size)


__all__ = [
    "MAX_ATTR_BYTES", "MAX_CHUNK_BYTES", "MAX_JSON_DEPTH", "MAX_METADATA_BYTES",
    "check_checkpoint_path", "check_chunk_shape", "check_json_depth", "file_kind", "json_depth",
    "link_inside", "root_attr_limit", "root_document_limit",
]
