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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .chunk_crc import CHUNK_CRC_ATTR
from .errors import CheckpointError, IntegrityError, UnsafeFileError

MAX_CHUNK_BYTES = 1 << 30  # one chunk (HDF5) or inner chunk (Zarr), decoded
MAX_SHARD_BYTES = 8 << 30  # one Zarr shard file, decoded
MAX_ATTR_BYTES = 64 << 20  # one attribute value (the layout JSON is the largest we write)
MAX_ATTRS = 1024  # attributes per object
MAX_METADATA_BYTES = 64 << 20  # one zarr.json
MAX_RANK = 32
MAX_JSON_DEPTH = 64  # nesting of any JSON lean_store parses (its own documents nest < 10 deep)
MAX_TREE_DEPTH = MAX_RANK + 8  # directories below a Zarr root: node, "c", one per chunk axis
ZARR_CODECS = frozenset(
    {"BytesCodec", "Crc32cCodec", "ShardingCodec", "ZstdCodec", "GzipCodec", "BloscCodec"}
)
ZARR_COMPRESSORS = frozenset({"ZstdCodec", "GzipCodec", "BloscCodec"})


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
    nbytes = math.prod(int(c) for c in chunk_shape) * max(1, itemsize)
    if nbytes > limit:
        raise UnsafeFileError(
            f"{node!r}: chunk shape {chunk_shape} means {nbytes} bytes per chunk "
            f"(limit {limit}); refusing to allocate it"
        )


def chunk_count(shape: tuple[int, ...], chunks: tuple[int, ...]) -> int:
    """Chunks in the grid of ``shape``; 0 for an empty array."""
    return math.prod(-(-int(d) // int(c)) for d, c in zip(shape, chunks))


# ----------------------------------------------------------------------------------- paths


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind_of(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def check_checkpoint_path(path: str | os.PathLike, *, what: str = "checkpoint") -> None:
    """A local checkpoint path must be a regular file or a directory (or a symlink to one).

    Checked with ``stat`` before anything opens the path: opening a FIFO blocks forever and a
    device reads without end, so they are refused with what they are, never opened."""
    p = os.fspath(path)
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
        raise CheckpointError(f"{p} is {_kind_of(link.st_mode)}; {must}")
    try:
        target = os.stat(p)
    except OSError:
        raise CheckpointError(
            f"{p} is a dangling symlink (to {os.readlink(p)!r}); no {what} is there"
        ) from None
    if not (stat.S_ISREG(target.st_mode) or stat.S_ISDIR(target.st_mode)):
        raise CheckpointError(
            f"{p} is a symlink to {os.path.realpath(p)}, which is {_kind_of(target.st_mode)}; "
            f"{must}"
        )


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def hdf5_superblock_offset(path: str | os.PathLike) -> int | None:
    """Where the HDF5 superblock of a regular file starts, as libhdf5 looks for it: at 0, or
    after a user block (``h5jam``, h5py's ``userblock_size``) at 512, 1024, 2048, ... bytes.
    None when there is no signature. At most log2(size) reads of 8 bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        offset = 0
        while offset + len(HDF5_SIGNATURE) <= size:
            f.seek(offset)
            if f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                return offset
            offset = 512 if offset == 0 else offset * 2
    return None


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
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = data.translate(None, _NOT_STRUCTURE)  # only quotes and brackets matter
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


def check_json_depth(raw: str | bytes, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """:class:`UnsafeFileError` when JSON text nests deeper than ``limit`` (checked before any
    parser recurses into it)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= limit:
        return  # cannot nest deeper than it has brackets
    depth = json_depth(data)
    if depth > limit:
        raise UnsafeFileError(
            f"{where}: JSON nested {depth} levels deep (limit {limit}); refusing to parse it"
        )


# ----------------------------------------------------------------------------------- HDF5


def read_hdf5_attrs(obj: Any, where: str) -> dict[str, Any]:
    """Attributes of an h5py object, each checked for type and size *before* it is read."""
    import h5py

    from .stores.hdf5 import from_hdf5_attr

    try:
        names = list(obj.attrs.keys())
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise IntegrityError(f"{where}: unreadable attribute list ({exc})") from None
    if len(names) > MAX_ATTRS:
        raise UnsafeFileError(f"{where}: {len(names)} attributes (limit {MAX_ATTRS})")
    out: dict[str, Any] = {}
    for name in names:
        try:
            aid = obj.attrs.get_id(name)
            shape, dtype = aid.shape, aid.dtype
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise IntegrityError(f"{where}: unreadable attribute {name!r} ({exc})") from None
        if shape is None or len(shape) > 1:
            raise IntegrityError(f"{where}: attribute {name!r} has an unsupported shape {shape}")
        count = math.prod(shape)
        string_info = h5py.check_string_dtype(dtype)
        is_str = string_info is not None
        if is_str and string_info.length is None:
            # Variable-length strings live in HDF5's global heap; libhdf5 can loop forever on a
            # corrupted one. lean_store writes fixed-length strings only, so refuse to read these.
            raise UnsafeFileError(
                f"{where}: attribute {name!r} is a variable-length string; lean_store files hold "
                "fixed-length strings only"
            )
        if dtype.kind not in "iufb" and not is_str:
            raise IntegrityError(f"{where}: attribute {name!r} has an unsupported type {dtype}")
        if count * max(1, dtype.itemsize) > MAX_ATTR_BYTES or (is_str and count > 1):
            raise UnsafeFileError(f"{where}: attribute {name!r} claims {count} values; too large")
        try:
            raw = obj.attrs[name]  # the per-chunk crc table stays an array (not a tuple)
            value = raw if name == CHUNK_CRC_ATTR and isinstance(raw, np.ndarray) else (
                from_hdf5_attr(raw)
            )
        except (OSError, RuntimeError, ValueError, TypeError, KeyError, UnicodeError) as exc:
            raise IntegrityError(f"{where}: unreadable attribute {name!r} ({exc})") from None
        if isinstance(value, str) and len(value) > MAX_ATTR_BYTES:
            raise UnsafeFileError(f"{where}: attribute {name!r} is absurdly long")
        out[name] = value
    return out


def check_hdf5_present(ds: Any, node: str, filters: list[str]) -> None:
    """Every chunk of ``ds`` must be allocated, inside the file, and (uncompressed) as large as
    its values need: so reading allocates only in proportion to bytes actually in the file."""
    shape = tuple(ds.shape)
    if not shape or math.prod(shape) == 0:
        return
    chunks = tuple(ds.chunks or ())
    if not chunks:
        raise IntegrityError(f"{node!r} is not chunked; lean_store writes chunked datasets only")
    check_chunk_shape(node, chunks, shape, ds.id.get_type().get_size())
    expected = chunk_count(shape, chunks)
    try:
        present = ds.id.get_num_chunks()
        stored = ds.id.get_storage_size()
        file_size = ds.file.id.get_filesize()
    except (OSError, RuntimeError, ValueError) as exc:
        raise IntegrityError(f"{node!r}: unreadable chunk index ({exc})") from None
    if present != expected:
        raise IntegrityError(
            f"{node!r}: {present} of {expected} chunks are present; the file is truncated or "
            "was never completely written"
        )
    if stored > file_size:
        raise UnsafeFileError(
            f"{node!r}: chunks claim {stored} bytes but the file holds only {file_size}"
        )
    if not {"gzip", "lzf", "szip", "blosc"} & set(filters):
        least = math.prod(shape) * _hdf5_precision(ds.id.get_type()) // 8
        if stored < least:
            raise IntegrityError(
                f"{node!r}: {stored} bytes stored but {least} are needed; the file is truncated"
            )


def _hdf5_precision(ftype: Any) -> int:
    """Significant bits per element of an HDF5 type (what the N-bit filter keeps at least)."""
    from h5py import h5t

    if ftype.get_class() == h5t.COMPOUND:
        return sum(_hdf5_precision(ftype.get_member_type(i)) for i in range(ftype.get_nmembers()))
    try:
        return max(1, int(ftype.get_precision()))
    except (AttributeError, ValueError, RuntimeError):
        return 1


# ----------------------------------------------------------------------------------- Zarr


@dataclass
class LocalTree:
    """What a walk of a local Zarr directory found: every regular file and its size."""

    root: Path
    files: dict[str, int] = field(default_factory=dict)  # key relative to root -> size
    _by_node: dict[str, dict[str, int]] | None = None

    def under(self, node: str) -> dict[str, int]:
        """The files below ``node`` (key -> size), from one pass over the tree."""
        if self._by_node is None:
            self._by_node = {}
            for key, size in self.files.items():
                top, sep, _rest = key.partition("/")
                if sep:
                    self._by_node.setdefault(top, {})[key] = size
        if "/" not in node:
            return self._by_node.get(node, {})
        prefix = f"{node}/"
        return {k: v for k, v in self.files.items() if k.startswith(prefix)}


def scan_local_zarr(root: Path) -> LocalTree:
    """Walk a Zarr directory once, without following links: reject any symlink or special
    file, and over-large metadata documents. The walk is bounded by what is on disk. The root
    ``zarr.json``'s nesting is checked here; an array's own ``zarr.json`` is checked (size and
    nesting) by whoever parses it: :func:`read_json_at`, or :func:`check_zarr_document` before
    zarr opens the array."""
    tree = LocalTree(root)
    if not (root / "zarr.json").exists():
        return tree  # the zarr open that follows reports the missing metadata
    pending = [("", 0)]  # iterative, depth-first: no recursion, bounded depth
    while pending:
        prefix, depth = pending.pop()
        try:
            entries = list(os.scandir(root / prefix if prefix else root))
        except OSError as exc:
            raise IntegrityError(f"{prefix or '.'}: unreadable directory ({exc})") from None
        for entry in entries:
            key = prefix + entry.name
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                raise UnsafeFileError(f"{key}: a symlink inside the checkpoint")
            if stat.S_ISDIR(info.st_mode):
                if depth + 1 > MAX_TREE_DEPTH:
                    raise UnsafeFileError(
                        f"{key}: directories nested more than {MAX_TREE_DEPTH} deep inside the "
                        "checkpoint; no lean_store writer makes them"
                    )
                pending.append((key + "/", depth + 1))
                continue
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeFileError(f"{key}: {_kind_of(info.st_mode)} inside the checkpoint")
            if entry.name == "zarr.json":
                if info.st_size > MAX_METADATA_BYTES:
                    raise UnsafeFileError(f"{key}: {info.st_size} bytes of metadata")
                if not prefix:
                    check_zarr_document(root, key)
            tree.files[key] = info.st_size
    return tree


def check_zarr_document(root: Path, key: str) -> None:
    """Bounded size and nesting of the metadata document ``key`` below ``root``, checked on
    the raw bytes before zarr parses them."""
    try:
        with (root / key).open("rb") as f:
            raw = f.read(MAX_METADATA_BYTES + 1)
    except OSError:
        return  # missing or unreadable: the zarr open that follows reports it
    if len(raw) > MAX_METADATA_BYTES:
        raise UnsafeFileError(f"{key}: more than {MAX_METADATA_BYTES} bytes of metadata")
    check_json_depth(raw, key)


def read_json_at(dir_fd: int, key: str) -> Any:
    """The JSON document at ``key`` below the directory ``dir_fd`` (no link followed), with
    the bounds of :func:`scan_local_zarr` (size, nesting) checked on the raw bytes before it is
    parsed. Missing, unreadable or malformed: :class:`IntegrityError`."""
    import json

    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(key, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise IntegrityError(f"{key}: cannot be read ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_METADATA_BYTES + 1)
    except OSError as exc:
        raise IntegrityError(f"{key}: cannot be read ({exc.strerror})") from None
    if len(raw) > MAX_METADATA_BYTES:
        raise UnsafeFileError(f"{key}: more than {MAX_METADATA_BYTES} bytes of metadata")
    check_json_depth(raw, key)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise IntegrityError(f"{key}: not valid JSON ({exc})") from None


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
    from .zarr_compat import chunk_key

    outer = zarr_grid(node, array)
    grid = tuple(-(-int(d) // int(c)) for d, c in zip(array.shape, outer))
    expected = math.prod(grid)
    if expected > present:
        raise IntegrityError(
            f"{node!r}: {present} of {expected} chunk files are present; the checkpoint is "
            "truncated or was never completely written"
        )
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
    return n_inner * inner_bytes + 16 * n_slots + index_crc


def check_zarr_present(node: str, array: Any, tree: LocalTree) -> None:
    """Every chunk (shard) file is present and, uncompressed, exactly the right size."""
    if math.prod(array.shape) == 0:
        return
    present = tree.under(node)
    for key, coords in zarr_chunk_keys(node, array, len(present)):
        got = present.get(key)
        if got is None:
            raise IntegrityError(f"{node!r}: chunk file {key!r} is missing; the data is truncated")
        size = zarr_expected_file_size(array, coords)
        if size is not None and got != size:
            raise IntegrityError(
                f"{node!r}: chunk file {key!r} has {got} bytes, expected {size}; it is truncated "
                "or corrupt"
            )


def touched_keys(node: str, array: Any, selection: Any) -> list[str]:
    """Store keys of the chunk (shard) files a strided selection reads. The selection covers
    the tensor's axes; a trailing (re, im) axis of word pairs is read whole."""
    from .chunking import touched_cells
    from .zarr_compat import chunk_key, store_and_prefix

    outer = zarr_grid(node, array)
    cells = touched_cells(selection.start, selection.count, selection.step, outer,
                          tuple(int(d) for d in array.shape))
    _store, prefix = store_and_prefix(array)
    base = f"{prefix}/" if prefix else ""
    return [base + chunk_key(array, coords) for coords in cells]


def check_zarr_keys_exist(node: str, array: Any, keys: list[str]) -> None:
    """For non-local stores: each key must exist (a missing chunk must never read as fill)."""
    from .zarr_compat import store_and_prefix, store_has

    store, _prefix = store_and_prefix(array)
    for key in keys:
        if not store_has(store, key):
            raise IntegrityError(f"{node!r}: chunk {key!r} is missing; the data is truncated")


def zarr_grid(node: str, array: Any) -> tuple[int, ...]:
    """The shape of one cell (shard, or chunk when unsharded) of ``array``'s regular grid."""
    from .zarr_compat import regular_grid

    outer = regular_grid(array)
    if outer is None or len(outer) != len(array.shape):
        raise UnsafeFileError(f"{node!r}: not a regular Zarr chunk grid")
    return outer


__all__ = [
    "MAX_ATTR_BYTES", "MAX_CHUNK_BYTES", "MAX_JSON_DEPTH", "MAX_METADATA_BYTES",
    "check_checkpoint_path", "check_chunk_shape", "check_json_depth", "json_depth",
    "check_hdf5_present", "check_zarr_array", "check_zarr_document", "check_zarr_key",
    "check_zarr_present",
    "read_hdf5_attrs", "read_json_at", "scan_local_zarr",
]
