"""Zarr v3 backend: one array per tensor, crc32c per chunk, sharding for large tensors.

Formats with a native numpy dtype that every Zarr reader knows (float16/32/64, integers, bool,
complex64/128) are stored natively, so zarr, xarray and dask users see numbers. Every other
format is stored as its raw unsigned words (complex: a trailing axis of 2) with the format in
the attributes. ``write_empty_chunks`` is on, so a chunk equal to the fill value (e.g. NaN
payloads) is still written and checksummed.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from ...chunking import Region, grow_chunks, plan_chunks
from ...errors import CheckpointError, CheckpointReplacedError, IntegrityError, UnsafeFileError
from ...formats import ScalarFormat
from ...layout import Entry
from ...naming import node_name, tensor_ref
from ...replacement import PinnedRoot, SaveIdWatch, check_unchanged
from ..base import (
    ChunkProblem,
    Selection,
    StorageDescription,
    StoredTensor,
    StoreReader,
    StoreWriter,
    TensorWriter,
)
from ..ordered_pool import OrderedPool
from .checks import (
    array_codec_names,
    check_root_size,
    check_zarr_array,
    check_zarr_document,
    check_zarr_key,
    check_zarr_keys_exist,
    check_zarr_lengths,
    check_zarr_present,
    parse_json,
    read_bytes_at,
    read_root_at,
    scan_local_zarr,
    touched_keys,
)
from .chunk_keys import CHUNK_KEY_ENCODING
from .compat import (
    EncodedDocument,
    ZarrUserWarning,
    blosc_document,
    consolidated_group_document,
    crc32c_codec,
    json_document_bytes,
    local_root,
    metadata_document,
    plain_array_document,
    write_json_document,
)
from .direct_read import DirectReader, direct_read_ok
from .direct_write import DirectWriter, direct_ok, make_dirs, write_all
from .incremental import linker_for
from .plain import PlainArray, plain_members, plain_root
from .root_text import RootText
from .verify import structure_problems

_COMPRESSOR_NAMES = {"ZstdCodec": "zstd", "GzipCodec": "gzip", "BloscCodec": "blosc"}
_NOT_COMPRESSION = ("BytesCodec", "Crc32cCodec", "TransposeCodec", "ShardingCodec")
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
SHARD_FACTOR = 8  # chunks per shard along the split axis, for tensors above SHARD_MIN_CHUNKS
SHARD_MIN_CHUNKS = 8
# a document plain_array_document builds without a compressor is the direct layout by
# construction (``bytes`` little endian + ``crc32c``, the sharding index likewise): written
# directly wherever the direct writer writes at all (a little-endian machine), without
# re-reading its codecs per tensor (tests/stores/test_zarr_fast_metadata.py pins both)
PLAIN_IS_DIRECT = direct_ok(plain_array_document((1,), np.dtype("<f4"), (1,), None, {}, ("x",))
                          or {}) and direct_ok(plain_array_document(
                              (16,), np.dtype("<f4"), (1,), (8,), {}, ("x",)) or {})


_NATIVE: dict[ScalarFormat, np.dtype | None] = {}  # formats are few, frozen and hashable


def native_dtype(fmt: ScalarFormat) -> np.dtype | None:
    """The dtype zarr stores natively for ``fmt``, or None when raw words are stored."""
    try:
        return _NATIVE[fmt]
    except KeyError:
        dtype = _NATIVE[fmt] = _native_dtype(fmt)
        return dtype
    except TypeError:  # an unhashable format: asked every time
        return _native_dtype(fmt)


def _native_dtype(fmt: ScalarFormat) -> np.dtype | None:
    dtype = fmt.numpy_dtype
    if dtype is None or dtype.kind not in "fiubc" or type(dtype).__module__ != "numpy.dtypes":
        return None
    if dtype.kind == "f" and dtype.itemsize not in (2, 4, 8):
        return None
    return dtype


def storage_name_of(fmt: ScalarFormat) -> str:
    """The ``storage`` attribute of a tensor of this format: native dtype or raw words."""
    return "native" if native_dtype(fmt) is not None else "raw"


def stored_shape(entry: Entry) -> tuple[int, ...]:
    shape = entry.shape or (1,)
    if entry.format.words_per_value == 2 and native_dtype(entry.format) is None:
        shape = shape + (2,)
    return shape


def dimension_names(entry: Entry) -> tuple[str, ...]:
    """Zarr ``dimension_names`` of the stored axes, unique per tensor and axis (xarray refuses
    one name with two lengths): ``"<tensor>.dim_<i>"`` as in ``Checkpoint.to_xarray``, then
    ``"<tensor>.scalar"`` for a scalar's length-1 axis and ``"<tensor>.word"`` for the trailing
    pair of a complex value stored as raw words."""
    dims = [f"{entry.name}.dim_{i}" for i in range(len(entry.shape))] or [f"{entry.name}.scalar"]
    if len(stored_shape(entry)) > len(dims):
        dims.append(f"{entry.name}.word")
    return tuple(dims)


def mark_complete(group: zarr.Group) -> None:
    """Consolidate every array's metadata into the root ``zarr.json`` (one read then opens the
    store; as ``zarr.consolidate_metadata`` writes it), then set ``complete``: the last write of
    a store is the root document carrying both. Every array's metadata must be final before."""
    with warnings.catch_warnings():  # "consolidated metadata is not part of the v3 spec"
        warnings.simplefilter("ignore", ZarrUserWarning)
        consolidated = zarr.consolidate_metadata(group.store, path=group.path, zarr_format=3)
    consolidated.attrs["complete"] = True


def check_consolidated(node: str, array: zarr.Array, group: zarr.Group) -> None:
    """The consolidated copy of an array's metadata, where the root has one, must describe the
    same array as its own ``zarr.json`` (shape, data type, chunks, codecs, fill value,
    dimension names): other readers (xarray, zarr with ``use_consolidated``) see only the copy.
    Attributes are lean_store's own, read from the array's ``zarr.json`` and checked against
    the data by their digests, so they are not compared."""
    consolidated = group.metadata.consolidated_metadata
    if consolidated is None:  # stores written before lean_store consolidated, or by others
        return
    copy = consolidated.metadata.get(node)

    def described(meta: Any) -> dict[str, Any]:
        return {k: v for k, v in meta.to_dict().items() if k != "attributes"}

    if copy is None or described(copy) != described(array.metadata):
        raise IntegrityError(
            f"{node!r}: the consolidated metadata in the root zarr.json disagrees with "
            f"{node}/zarr.json; the store was altered after it was written"
        )


WEIGHTS_BLOCK_BYTES = 1 << 20
"""Blosc block of ``compression="weights"``: zstd sees 1 MiB of shuffled words at a time (its
default block at level 1 is a few KiB, which costs ~8 points of ratio on bf16)."""


def weights_codec() -> BloscCodec:
    """``compression="weights"``: Blosc (a Zarr v3 core codec, read by zarr-python, TensorStore
    and zarrs) with a byte shuffle grouped by the stored word width (its ``typesize`` is taken
    from the array's data type) and zstd level 1: exponent bytes apart from mantissa bytes."""
    return BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", blocksize=WEIGHTS_BLOCK_BYTES)


WEIGHTS_THREADS = 2  # Blosc workers of a "weights" save (numcodecs releases the GIL)


def _direct_compressor(compression: Any, itemsize: int) -> tuple[bool, dict[str, Any] | None]:
    """(whether the direct writer writes arrays saved with ``compression``, the document of
    the codec between ``bytes`` and ``crc32c``): uncompressed and ``"weights"`` only; every
    other compression goes through zarr's codec pipeline."""
    if compression in (None, False):
        return True, None
    if compression == "weights":
        doc = blosc_document(weights_codec(), itemsize)
        return doc is not None, doc
    return False, None


def compressors_for(compression: Any) -> list[Any]:
    if compression in (None, False):
        codecs: list[Any] = []
    elif compression == "weights":
        codecs = [weights_codec()]
    elif compression in ("zstd", True):
        codecs = [ZstdCodec(level=3)]
    elif compression == "gzip":
        codecs = [GzipCodec(level=4)]
    elif compression == "blosc":
        codecs = [BloscCodec()]
    elif compression == "weights-gzip":
        raise CheckpointError("compression='weights-gzip' is for HDF5 files that HDF5 tools read "
                              "without plugins; every Zarr v3 reader has Blosc: use 'weights'")
    else:
        raise CheckpointError(f"unknown zarr compression {compression!r}; "
                             "use weights, zstd, gzip or blosc")
    return codecs + [crc32c_codec()]  # stock crc32c bytes, a cheaper encoder where it can


class ZarrTensorWriter(TensorWriter):
    def __init__(
        self, array: Any, entry: Entry, chunks: tuple[int, ...], unit: tuple[int, ...],
        direct: DirectWriter | None = None, linker: Any = None,
        written: dict[str, Any] | None = None, array_dir: Path | None = None,
        node: str | None = None,
    ) -> None:
        self._node = node  # the array's name in the store, when the caller has it
        self._array = array  # a zarr.Array, or (direct metadata) the document to write at close
        self._linker = linker  # incremental steps, compressed arrays: link equal files after
        self._direct = direct  # whole shard files written without zarr's copies
        self._written = written  # node -> final metadata document, for the consolidated root
        self._array_dir = array_dir
        self._native = native_dtype(entry.format)
        self._pairs = entry.format.words_per_value == 2 and self._native is None
        self.entry = entry
        self.chunk_shape = chunks
        rank = len(entry.shape or (1,))
        self.write_unit = unit[:rank]  # regions are over the logical stored shape
        self._unit = unit


    def write(self, region: Region, bits: np.ndarray, crc: Any = None) -> int | None:
        data = np.ascontiguousarray(bits)
        if self._native is not None:
            data = data.view(self._native).reshape(tuple(s.stop - s.start for s in region))
        elif self._pairs:
            region = region + (slice(0, 2),)
        if self._direct is not None:
            return self._direct.write(region, data, crc)
        else:
            self._array[region] = data
            if self._linker is not None:
                self._linker.link_if_same(self._array.metadata.encode_chunk_key(
                    tuple(s.start // u for s, u in zip(region, self._unit))))
            return None

    def write_later(self, region: Region, bits: np.ndarray, submit: Any) -> Any:
        """Uncompressed direct units: written on a worker (:meth:`TensorWriter.write_later`)."""
        if self._direct is None:
            return None
        data = np.ascontiguousarray(bits)
        if self._native is not None:
            data = data.view(self._native).reshape(tuple(s.stop - s.start for s in region))
        elif self._pairs:
            region = region + (slice(0, 2),)
        return self._direct.write_later(region, data, submit)

    def close(self, attrs: dict[str, Any]) -> None:
        if isinstance(self._array, dict):  # written once, with its final attributes
            doc = {**self._array, "attributes": {**self._array["attributes"], **_plain(attrs)}}
            assert self._array_dir is not None
            raw = json_document_bytes(doc)  # encoded once: this file, and the root's copy
            folder = os.fspath(self._array_dir)
            if self._direct is None or not self._direct.made_folders:
                make_dirs(folder)
            fd = os.open(f"{folder}/zarr.json", _O_CREATE, 0o666)
            try:
                write_all(fd, [raw])
            finally:
                os.close(fd)
            if self._written is not None:
                self._written[self._node or node_name(self.entry.name)] = \
                    EncodedDocument(raw.decode())
            return
        self._array.attrs.update(_plain(attrs))
        if self._written is not None:
            self._written[node_name(self.entry.name)] = metadata_document(self._array)


class _RecordedCrcs:
    """The CRC-32C of each chunk's words, by chunk number, as a direct reader recorded them
    when it read the chunk (a chunk not read yet has none: an error, never a guess)."""

    def __init__(self, node: str, crcs: dict[int, int | None]) -> None:
        self._node = node
        self._crcs = crcs

    def __getitem__(self, number: int) -> int:
        crc = self._crcs.get(int(number))
        if crc is None:
            raise IntegrityError(f"{tensor_ref(self._node)}: chunk {number} has no checked CRC")
        return crc


def _plain(attrs: dict[str, Any]) -> dict[str, Any]:
    """zarr attributes take only plain JSON values (a numpy scalar breaks the handle)."""
    out = {}
    for key, value in attrs.items():
        if isinstance(value, tuple):
            value = [int(v) for v in value]
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


class ZarrWriter(StoreWriter):
    backend = "zarr"
    makes_directory = True
    # a local store's writer (set in __init__): node -> final metadata document (or its text),
    # and whether every array's document was written by lean_store (then the root is too);
    # other writers (URLs) go through zarr for all metadata
    _written: dict[str, Any] | None = None
    _all_direct = False
    _queue: OrderedPool | None = None  # Blosc workers of a "weights" save, when used
    _group_handle: zarr.Group | None = None

    def __init__(self, path: str | os.PathLike, *, chunk_bytes: int, compression: Any = None):
        super().__init__(path, chunk_bytes=chunk_bytes, compression=compression)
        self._compressors = compressors_for(compression)
        with self._creating():  # a new, empty directory (mkdir refuses an existing one)
            self._commit.make_directory()
        self._direct_root: Path | None = self.tmp_path  # None: write through zarr only
        self._written = {}
        self._all_direct = True

    @property
    def _group(self) -> zarr.Group:
        """The temporary store as a zarr group, opened (its empty group document written)
        only when an array is created through zarr: lean_store's own layouts write every
        document, the root's last, without zarr's objects (~10 ms a save in ``open_group``)."""
        if self._group_handle is None:
            self._group_handle = zarr.open_group(store=str(self.tmp_path), mode="a",
                                                 zarr_format=3)
        return self._group_handle

    @_group.setter
    def _group(self, group: zarr.Group) -> None:
        self._group_handle = group

    def add_tensor(self, entry: Entry, attrs: dict[str, Any]) -> TensorWriter:
        fmt = entry.format
        shape = stored_shape(entry)
        dtype = native_dtype(fmt) or fmt.storage_dtype
        chunks = plan_chunks(shape, dtype.itemsize, self.chunk_bytes)
        n_chunks = math.prod(math.ceil(d / c) for d, c in zip(shape, chunks) if d)
        shards = grow_chunks(shape, chunks, SHARD_FACTOR) if n_chunks >= SHARD_MIN_CHUNKS else None
        node = node_name(entry.name)
        direct, compressor = _direct_compressor(self.compression, dtype.itemsize)
        if self._direct_root is not None and direct:
            # lean_store's uncompressed and "weights" layouts: the metadata document is
            # written at close, once, as create_array would write it; the chunk files by the
            # direct writer (Blosc chunks compressed on the writer's pool)
            doc = plain_array_document(shape, dtype, chunks, shards, _plain(attrs),
                                       dimension_names(entry), compressor)
            if doc is not None and (PLAIN_IS_DIRECT if compressor is None
                                    else direct_ok(doc, compressed=True)):
                array_dir = self._direct_root / node
                linker = linker_for(array_dir, node, doc)  # incremental steps only
                writer = DirectWriter(array_dir, doc, chunks, shards, dtype.itemsize, linker,
                                      self._blosc_queue() if compressor is not None else None,
                                      plain=compressor is None)
                return ZarrTensorWriter(doc, entry, chunks, shards or chunks, writer,
                                        written=self._written, array_dir=array_dir, node=node)
        array = self._group.create_array(
            node,
            shape=shape,
            dtype=dtype,
            chunks=chunks,
            shards=shards,
            compressors=self._compressors,
            filters=None,
            fill_value=0,
            attributes=_plain(attrs),
            dimension_names=dimension_names(entry),
            chunk_key_encoding=CHUNK_KEY_ENCODING,  # c.0.0, as the direct writer's
            config={"write_empty_chunks": True},
        )
        self._all_direct = False
        chunk_writer: DirectWriter | None = None
        if self._direct_root is not None:
            array_dir = self._direct_root / node
            linker = linker_for(array_dir, node)  # incremental steps only
            if self.compression in (None, False) and direct_ok(array):
                chunk_writer = DirectWriter(array_dir, array, chunks, shards, dtype.itemsize,
                                            linker)
        else:
            linker = None
        return ZarrTensorWriter(array, entry, chunks, shards or chunks, chunk_writer,
                                None if chunk_writer is not None else linker,
                                written=self._written)

    def _blosc_queue(self) -> OrderedPool:
        if self._queue is None:
            self._queue = OrderedPool(ThreadPoolExecutor(
                WEIGHTS_THREADS, thread_name_prefix="lean_store-blosc"))
        return self._queue

    def _stop_pool(self, *, flush: bool) -> None:
        queue, self._queue = self._queue, None
        if queue is None:
            return
        queue.finish(flush=flush)  # every chunk written before the root document

    def _close_quietly(self) -> None:
        self._stop_pool(flush=False)

    def _finish(self, root_attrs: dict[str, Any]) -> None:
        self._stop_pool(flush=True)  # every tensor is closed: its last chunk files written
        if self._direct_root is not None and self._all_direct and self._written is not None:
            # every array's final document is known: the root carrying the consolidated
            # metadata and ``complete`` is written once, last, without rereading the arrays
            attrs = {**_plain(root_attrs), "complete": True}  # a new group has none
            doc = consolidated_group_document(attrs, self._written)
            write_json_document(doc, self._direct_root / "zarr.json")
            check_root_size(self._direct_root, self._written)
            return
        self._group.attrs.update(_plain(root_attrs))
        mark_complete(self._group)  # written last: a store without it is incomplete
        if self._direct_root is not None:  # a local store, written through zarr
            check_root_size(self._direct_root)


class ZarrReader(StoreReader):
    backend = "zarr"

    def stored_shape_of(self, entry: Entry) -> tuple[int, ...]:
        return stored_shape(entry)

    def __init__(self, source: Any, where: str | None = None) -> None:
        """``where``: how errors name the store (default: ``str(source)``)."""
        self._root: Path | None = local_root(source)  # a directory, or None: any other store
        self._where = str(source) if where is None else where
        # a local store's root directory is held open first: direct reads open files relative
        # to it (the tree opened, even once replaced), and any other read is checked against it
        self._watch: PinnedRoot | SaveIdWatch | None = (
            PinnedRoot.of(self._root) if self._root is not None else None
        )
        self._consistent: set[str] = set()  # own document compared with the root's copy
        try:
            self._open(source)
        except BaseException as exc:
            replaced = isinstance(exc, Exception) and self._replaced()
            self._close_watch()
            if replaced:  # what was read may mix two checkpoints: say so, not "corrupt"
                raise CheckpointReplacedError(self._where, "while it was being opened") from None
            raise
        self._arrays: dict[str, zarr.Array | PlainArray] = {}
        self._direct: dict[str, DirectReader | None] = {}
        self._frames = threading.local()  # compressed chunks' scratch, shared by the arrays
        self._lengths_checked: set[str] = set()  # check_metadata's length checks done
        # per thread: inside checks_deferred() (depth), and a read not yet checked there
        self._deferral = threading.local()
        self._closed = False

    def _open(self, source: Any) -> None:
        # one walk of a local store, before zarr reads anything: no symlinks, bounded metadata
        pin = self._watch if isinstance(self._watch, PinnedRoot) else None
        self._tree = scan_local_zarr(self._root, pin) if self._root is not None else None
        self._source = source
        self._copies: dict[str, Any] | None = None
        self._members: dict[str, zarr.Array] | None = None
        self._plain: dict[str, PlainArray] | None = None
        self._group_handle: zarr.Group | None = None
        self._root_text: RootText | None = None  # the root read, its members' text kept
        root_doc: Any = None
        pinned = isinstance(self._watch, PinnedRoot) and self._tree is not None
        if pinned and "zarr.json" in self._tree.files:  # type: ignore[union-attr]
            assert isinstance(self._watch, PinnedRoot)
            assert self._tree is not None
            try:
                self._root_text = read_root_at(self._watch.fd, self._tree.root_limit)
                root_doc = self._root_text.doc
            except IntegrityError:
                root_doc = None  # zarr's open below reports it
            # lean_store's own layout, consolidated: every array described from the root
            # document read once through the pinned directory, without zarr's objects
            self._plain = plain_members(plain_root(root_doc))
            if self._plain is not None:
                self.root_attrs = dict(root_doc["attributes"])
                self._copies = root_doc["consolidated_metadata"]["metadata"]
                self._documents_read()
                return
        if self._tree is not None and root_doc is None and "zarr.json" in self._tree.files:
            # before zarr parses it
            check_zarr_document(self._tree.root, "zarr.json", self._tree.root_limit)
        try:
            self._group_handle = zarr.open_group(store=source, mode="r", zarr_format=3)
            self.root_attrs = dict(self._group_handle.attrs)
        except Exception as exc:  # zarr raises many types for malformed stores
            raise IntegrityError(f"{source}: not a readable Zarr v3 group ({exc})") from None
        if self._root is None:
            self._watch = SaveIdWatch(self._group.store, self.root_attrs.get("save_id"))
        # a local store with consolidated metadata: every array is described from the root
        # document read once (no zarr.json per array read when the store opens); each array's
        # own zarr.json is compared with its copy there when that tensor is first read
        if self._tree is not None and self._group.metadata.consolidated_metadata is None:
            for key in self._tree.files:  # zarr parses every array's own document: bound them
                if key.endswith("/zarr.json"):
                    check_zarr_document(self._tree.root, key)
        elif pinned:
            if root_doc is None:
                assert isinstance(self._watch, PinnedRoot) and self._tree is not None
                self._root_text = read_root_at(self._watch.fd, self._tree.root_limit)
                root_doc = self._root_text.doc
            attrs = root_doc.get("attributes") if isinstance(root_doc, dict) else None
            if not isinstance(attrs, dict) or attrs.get("save_id") != self.root_attrs.get(
                    "save_id"):  # the path now names another save than the directory pinned
                raise IntegrityError("zarr.json: the root metadata changed while it was read")
            copies = (root_doc.get("consolidated_metadata") or {}).get("metadata")
            self._copies = copies if isinstance(copies, dict) else None
            if self._copies is not None:  # built from the copies, no reads; once, before threads
                try:
                    self._members = dict(self._group.arrays())
                except Exception as exc:
                    raise IntegrityError(f"unreadable consolidated metadata ({exc})") from None

    def _documents_read(self) -> None:
        """The arrays' own documents the walk read (``LocalTree.documents``) compared with
        their copies in the root now, as :meth:`_check_own_document` compares them: one that
        is the same text is consistent, so its first read reads no document; any other is left
        to that check, which reads it again and names the difference."""
        # described from the root's text: its consolidated members are the plain arrays
        assert self._tree is not None and self._plain is not None
        assert self._root_text is not None
        documents, self._tree.documents = self._tree.documents, {}
        plain, same_text = self._plain, self._root_text.same_text
        self._consistent.update(node for node, raw in documents.items()
                                if node in plain and same_text(node, raw))

    @property
    def _group(self) -> zarr.Group:
        """The store as a zarr group; a store described from its root document alone
        (:mod:`.plain`) opens it only when an array outside that description is asked for."""
        if self._group_handle is None:
            try:
                self._group_handle = zarr.open_group(store=self._source, mode="r", zarr_format=3)
            except Exception as exc:
                raise IntegrityError(
                    f"{self._source}: not a readable Zarr v3 group ({exc})") from None
        return self._group_handle

    def _replaced(self) -> bool:
        return self._watch is not None and self._watch.replaced()

    def check_current(self) -> None:
        """CheckpointReplacedError when the store at the path is no longer the one opened."""
        check_unchanged(self._watch, self._where)

    @contextmanager
    def checks_deferred(self) -> Iterator[None]:
        """Reads inside are checked for replacement once, when the block ends without error
        (for a remote store, one reread of the root instead of one per chunk)."""
        state = self._deferral
        depth = getattr(state, "depth", 0)
        if depth == 0:
            state.unchecked = False
        state.depth = depth + 1
        try:
            yield
        finally:
            state.depth = depth
        if depth == 0 and state.unchecked:
            self.check_current()

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()

    def nodes(self) -> list[str]:
        """The arrays the root lists (its consolidated metadata, else zarr's listing), and in
        a local store every other node directly under the root that holds a ``zarr.json``
        (an array added by another tool, which left the consolidated metadata as it was):
        reported as not in the layout, as an HDF5 dataset outside the manifest is."""
        if self._plain is not None:
            names = set(self._plain)
        else:
            try:
                names = {name for name, _ in self._group.arrays()}
            except Exception as exc:
                raise IntegrityError(f"unreadable Zarr group listing ({exc})") from None
        if self._tree is not None:
            names.update(self._tree.documented_nodes())
        return sorted(names)

    def _array(self, node: str) -> zarr.Array | PlainArray:
        array = self._arrays.get(node)
        if array is None:
            check_zarr_key(node)
            array = self._member(node)  # the walk of the tree refused every link in it
            if array is None and self._root is not None:
                path = self._root / node
                if path.is_symlink() or not path.resolve().is_relative_to(self._root.resolve()):
                    raise UnsafeFileError(f"{node!r} points outside the checkpoint")
                check_zarr_document(self._root, f"{node}/zarr.json")  # before zarr parses it
            if array is None:
                try:  # the array's own zarr.json, whatever the consolidated metadata says
                    array = zarr.open_array(store=self._group.store, path=node, mode="r",
                                            zarr_format=3)
                except IntegrityError:
                    raise
                except Exception as exc:
                    raise IntegrityError(
                        f"array {node!r} is missing or unreadable ({exc})") from None
            if not isinstance(array, PlainArray):  # plain ones were bounded when described
                if not isinstance(array, zarr.Array):
                    raise IntegrityError(f"{node!r} is not an array")
                check_zarr_array(node, array)
            if self._tree is not None:
                check_zarr_present(node, array, self._tree)
            self._arrays[node] = array
        return array

    def _member(self, node: str) -> zarr.Array | PlainArray | None:
        """``node`` as described by the consolidated metadata (no read), when the store is
        local and its root has a copy of ``node``'s metadata; else None."""
        if self._plain is not None:
            return self._plain.get(node)
        if self._copies is None or self._members is None or node not in self._copies:
            return None
        return self._members.get(node)

    def _check_own_document(self, node: str, array: zarr.Array | PlainArray) -> None:
        """The array's own ``zarr.json`` (what zarr-python, TensorStore and h5-style tools read
        without consolidated metadata) must equal its copy in the root, attributes included:
        lean_store described the array from the copy."""
        described = isinstance(array, PlainArray) or (
            self._copies is not None and self._members is not None
            and self._members.get(node) is array)
        if described and self._copies is not None and node in self._copies:
            assert isinstance(self._watch, PinnedRoot)
            key = f"{node}/zarr.json"
            kept = self._tree.documents.pop(node, None) if self._tree is not None else None
            raw = kept if kept is not None else read_bytes_at(self._watch.fd, key)
            # the text written for both (lean_store's saves, zarr's consolidation): equal
            # without a parse; any other text is parsed and compared as values
            if (self._root_text is None or not self._root_text.same_text(node, raw)) \
                    and parse_json(raw, key) != self._copies[node]:
                raise IntegrityError(
                    f"{tensor_ref(node)}: {node}/zarr.json disagrees with its copy in the "
                    "consolidated metadata of the root zarr.json; the store was altered after it "
                    "was written"
                )
        elif isinstance(array, PlainArray):  # pragma: no cover - described from a copy
            raise IntegrityError(f"{node!r}: no consolidated copy of its metadata")
        else:
            check_consolidated(node, array, self._group)

    def check_metadata(self, node: str) -> None:
        """Check ``node``'s own metadata against the root's copy now (``verify``; reads do it
        before their first data), and the length of each chunk file whose length the open
        left to the read (:func:`.checks.check_zarr_lengths`: a one-chunk array's file): what
        a load without ``verify`` checks of every tensor before it installs any."""
        if node not in self._consistent or node not in self._lengths_checked:
            try:
                array = self._array(node)
                if node not in self._consistent:
                    self._check_own_document(node, array)
                    self._consistent.add(node)
                if self._tree is not None:
                    check_zarr_lengths(node, array, self._tree)
                self._lengths_checked.add(node)
            except IntegrityError:
                self.check_current()  # a file of the opened tree deleted by a save: not damage
                raise

    def metadata_checked_elsewhere(self, node: str) -> None:
        """Another process ran :meth:`check_metadata` on ``node`` (a sharded load's verify
        stage) and every process agreed: not again here."""
        self._consistent.add(node)
        self._lengths_checked.add(node)

    def stored(self, node: str) -> StoredTensor:
        array = self._array(node)
        outer, _inner = array_codec_names(array)
        return StoredTensor(
            node=node,
            attrs=dict(array.attrs),
            stored_shape=tuple(array.shape),
            chunk_shape=tuple(array.chunks),
            storage="zarr",
            itemsize=array.dtype.itemsize,
            nbytes_on_disk=None,
            filters=outer,
        )

    def type_mismatch(self, node: str, fmt: ScalarFormat) -> str | None:
        """None when the array's dtype is the one lean_store writes for ``fmt``."""
        want = native_dtype(fmt) or fmt.storage_dtype
        got = np.dtype(self._array(node).dtype)
        return None if got == want else f"zarr dtype {got} does not encode {fmt.tag}"

    def describe(self, node: str) -> StorageDescription:
        array = self._array(node)
        outer, inner = array_codec_names(array)
        codecs = outer if inner is outer else [*outer, *inner]
        tree = self._tree  # the files' sizes: an lstat each, when first asked
        stored = None if tree is None else sum(tree.size(key) for key in tree.under(node))
        return StorageDescription(
            chunk_shape=tuple(array.chunks), codecs=tuple(codecs),
            compression=tuple(_COMPRESSOR_NAMES.get(c, c) for c in inner
                              if c not in _NOT_COMPRESSION),
            stored_bytes=stored,
        )

    def structure_problems(self, node: str) -> list[ChunkProblem]:
        return structure_problems(node, self._array(node), self._tree)

    def read(
        self, node: str, selection: Selection, fmt: ScalarFormat, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Raw words of ``selection``, from the store that was opened: direct reads open files
        relative to the pinned root directory; any other read is handed out only if the store
        is unchanged after it. A store replaced meanwhile: CheckpointReplacedError."""
        if self._closed:
            raise CheckpointError(f"{self._where}: the checkpoint was closed")
        try:
            words, pinned = self._read(node, selection, fmt, out)
        except IntegrityError:
            self.check_current()  # a file of the opened tree deleted by the save: not damage
            raise
        if not pinned:
            if getattr(self._deferral, "depth", 0):
                self._deferral.unchecked = True
            else:
                self.check_current()
        return words

    def _read(
        self, node: str, selection: Selection, fmt: ScalarFormat, out: np.ndarray | None
    ) -> tuple[np.ndarray, bool]:
        """(words, read from the pinned root directory)."""
        array = self._array(node)
        if node not in self._consistent:  # before any data: what other readers see agrees
            self._check_own_document(node, array)
            self._consistent.add(node)
        per_value = fmt.words_per_value
        raw_pairs = per_value == 2 and native_dtype(fmt) is None
        key = selection.slices() + ((slice(None),) if raw_pairs else ())
        out_shape = selection.count + ((2,) if per_value == 2 else ())
        if math.prod(out_shape) == 0:
            return np.empty(out_shape, dtype=fmt.storage_dtype), True
        direct = self._direct_reader(node, array)
        if direct is not None:  # lean_store's own uncompressed layout: straight from the files
            into = out if out is not None and out.flags.c_contiguous else np.empty(
                out_shape, dtype=fmt.storage_dtype)
            pair = (0, 2, 1) if raw_pairs else None
            start, count, step = selection.start, selection.count, selection.step
            if pair is not None:
                start, count, step = start + pair[:1], count + pair[1:2], step + pair[2:]
            direct.read(start, count, step, into)
            if out is not None and into is not out:
                out[...] = into
                return out, True
            return into, True
        if isinstance(array, PlainArray):  # pragma: no cover - always read directly
            raise IntegrityError(f"{tensor_ref(node)}: not readable from its files")
        if self._tree is None:  # other stores: the chunks this read touches must exist
            check_zarr_keys_exist(node, array, touched_keys(node, array, selection))
        try:
            data = np.asarray(array[key])
        except Exception as exc:
            raise IntegrityError(f"{tensor_ref(node)}: Zarr read failed ({exc})") from None
        words = np.ascontiguousarray(data).view(fmt.storage_dtype).reshape(out_shape)
        if out is not None:
            out[...] = words
            return out, False
        return words, False

    def chunk_crcs(self, node: str) -> Any:
        """For an array of the direct layout read whole chunk by chunk: the CRC-32C of each
        chunk's words, recorded as the direct reader checks (or, read unchecked, will check)
        that chunk against the CRC stored with it, looked up after the chunk is read (so a
        whole-tensor digest follows from the chunks' CRCs instead of a second pass over the
        data). None for every other array."""
        array = self._array(node)
        if not isinstance(array, PlainArray):
            return None
        direct = self._direct_reader(node, array)
        if direct is None or not direct.words_crc_ok():
            return None
        return _RecordedCrcs(node, direct.word_crcs)

    def read_unchecked(
        self, node: str, selection: Selection, fmt: ScalarFormat, out: np.ndarray
    ) -> np.ndarray:
        """A whole full chunk of an array of the direct layout read without its CRC-32C check
        (:meth:`check_chunk` does it, meanwhile the next chunk is read); any other read is
        checked here, as :meth:`read`."""
        array = self._array(node)
        direct = self._direct_reader(node, array) if isinstance(array, PlainArray) else None
        if direct is not None and not self._closed and out.flags.c_contiguous \
                and all(s == 1 for s in selection.step):
            if node not in self._consistent:  # before any data, as a read
                self.check_metadata(node)
            if direct.read_unchecked(selection.start, out):
                return out
        return self.read(node, selection, fmt, out)

    def check_chunk(self, node: str, number: int, words: np.ndarray) -> None:
        if self._closed:  # its reader (and what it was to check against) is gone
            raise CheckpointError(f"{self._where}: the checkpoint was closed")
        direct = self._direct.get(node)
        if direct is not None:
            try:
                direct.check_chunk(number, words)
            except IntegrityError:
                self.check_current()  # a file of the opened tree deleted by a save: not damage
                raise

    def _direct_reader(self, node: str, array: zarr.Array | PlainArray
                       ) -> DirectReader | None:
        if node not in self._direct:
            root = self._watch if isinstance(self._watch, PinnedRoot) else None
            # described from the root's copy of its document (equal to its own zarr.json,
            # checked before any data): no re-encoding of zarr's metadata objects
            if isinstance(array, PlainArray):
                doc: dict[str, Any] | None = array.document
            else:
                doc = self._copies.get(node) if self._copies is not None and \
                    self._members is not None and self._members.get(node) is array else None
            ok = root is not None and self._tree is not None and direct_read_ok(array, doc)
            self._direct[node] = (DirectReader(root.fd, node, array, doc, self._frames)
                                  if ok and root is not None else None)
        return self._direct[node]

    def close(self) -> None:
        self._closed = True
        self._arrays.clear()
        self._direct.clear()
        self._close_watch()
