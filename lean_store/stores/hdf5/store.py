"""HDF5 backend (h5py): one chunked dataset per tensor, exact bits, CRC-32C per chunk.

Writes and reads go through h5py's low-level API with the memory type equal to the file type,
so HDF5 never converts a value: the bits in memory are the bits on disk.

Per-chunk checksums are a table of CRC-32C values in the dataset attribute ``chunk_crc32c``
(see :mod:`lean_store.stores.hdf5.crc_table`), verified on every chunk read, whole or partial.
``checksum="fletcher32+crc32c"`` also adds HDF5's native fletcher32 filter, so that h5py and
h5dump verify chunks on their own (at a cost: see docs/PERFORMANCE.md).
"""

from __future__ import annotations

import itertools
import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import h5py
import numpy as np
from h5py import h5, h5d, h5l, h5o, h5p, h5s, h5t, h5z
from numcodecs.fletcher32 import Fletcher32

from ...chunking import Region, chunk_count, chunk_number, grid_shape, plan_chunks, region_shape
from ...errors import CheckpointError, IntegrityError, UnsafeFileError
from ...fork_safe import ForkSafeLock
from ...formats import ScalarFormat
from ...hardening import check_chunk_shape, root_attr_limit
from ...integrity import crc32c_combine, crc32c_of, crc_workers
from ...layout import Entry
from ...naming import node_name, tensor_ref
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
from .attrs import (
    EncodedAttr,
    attrs_match,
    encode_attr,
    joined_utf8_attr,
    read_attrs,
    to_hdf5_attr,
    write_attrs,
)
from .blosc import (
    BLOSC_FILTER,
    BloscChunks,
    blosc_fletcher32,
    can_blosc,
    check_blosc_filter,
    read_blosc_at,
    read_blosc_region,
    set_blosc,
)
from .checks import ROOT_ATTRS, check_hdf5_present, read_hdf5_attrs
from .crc_table import CHECKSUMS, CHUNK_CRC_ATTR, parse_table, unchunked_message
from .deflate import DeflateChunks
from .files import close_written, open_file, open_for_writing
from .header import plain_superblock
from .header_attrs import (
    ExpectedAttr,
    HeaderAttributes,
    expected_attrs,
    header_match,
    known_messages,
    learn_header,
)
from .header_digests import DIGESTS_ATTR, MAX_COMPACT_ATTRS, SingleChunkDatasets, digest_table
from .header_digests import matched as header_matched
from .header_digests import parse_table as parse_digests
from .libhdf5 import chunk_location, chunk_lock, library
from .manifest import (
    MANIFEST_ATTR,
    ManifestBuilder,
    TensorRecord,
    attribute_differences,
    parse_manifest,
)
from .master_manifest import MASTER_MANIFEST_ATTR
from .small_writes import SmallChunkWrites, write_padded
from .types import hdf5_type, needs_nbit
from .verify import structure_problems

_FLETCHER32 = Fletcher32()  # HDF5's fletcher32, appended after the chunk as HDF5 stores it
DEFLATE_THREADS = 2  # shuffle + deflate workers of a compressed HDF5 save
ATTR_PHASE_CHANGE = (MAX_COMPACT_ATTRS, 24)
"""(max compact, min dense) attributes of a dataset: HDF5's default (8, 6) moves the dozen
attributes of every lean_store dataset to dense storage (a fractal heap and B-tree each); kept
compact in the object header they cost less to write and read (docs/FORMAT.md 2.5)."""
SPLIT_READ_BYTES = 2 << 20
"""A chunk read whole of at least this many bytes is read in two halves on two threads."""
TRACK_TIMES = False
"""Datasets' object headers hold no times (docs/FORMAT.md 2.5): a state saved again gives the
same dataset headers and header digests whatever the clock says. Files of before have them;
readers accept both."""
LIBVER = ("v108", "v108")  # readable by HDF5 1.8+ (Debian's h5dump 1.10), large attributes allowed
MAX_PLANS = 256  # distinct (format, shape) dataset plans a writer keeps (see HDF5Writer._plan)
CONFIRM_MISSES = 8  # datasets whose headers a reader confirms through libhdf5 in vain at open
# before it leaves the rest to their first read (HDF5Reader._confirm_header)
OPEN_DATASETS = 1024  # datasets a reader keeps open between calls (least recently used
# closed): ~7 KB each without a chunk cache; with fewer, a checkpoint of many tensors had each
# dataset opened twice, once by the checks at open and again by its first read
_FILTER_NAMES = {
    h5z.FILTER_DEFLATE: "gzip",
    h5z.FILTER_SHUFFLE: "shuffle",
    h5z.FILTER_FLETCHER32: "fletcher32",
    h5z.FILTER_SZIP: "szip",
    h5z.FILTER_NBIT: "nbit",
    h5z.FILTER_SCALEOFFSET: "scaleoffset",
    32000: "lzf",
    BLOSC_FILTER: "blosc",
}
_CHECKSUM_FILTERS = ("fletcher32", "crc32c")  # what ``describe`` does not call compression
ALLOWED_FILTERS = {
    h5z.FILTER_DEFLATE, h5z.FILTER_SHUFFLE, h5z.FILTER_FLETCHER32, h5z.FILTER_NBIT, 32000,
    BLOSC_FILTER,  # parameters checked (blosc.check_blosc_filter); read by lean_store
}


WEIGHTS_DEFLATE_LEVEL = 1
"""``compression="weights-gzip"``: byte shuffle by the stored word width, then deflate at
level 1 (levels 4-6 save under 1 % more at a third of the speed; docs/PERFORMANCE.md)."""


def _compression_filters(dcpl: h5p.PropDCID, compression: Any, itemsize: int = 0,
                         chunk_nbytes: int = 0, nbit: bool = False) -> None:
    """Add the compression filters after N-bit packing (if any) and before fletcher32: HDF5
    applies them in the order set, so a chunk is packed, byte-shuffled, then deflated.
    Shuffle and deflate are built into every HDF5 library, so h5py, h5dump 1.10 and any HDF5
    tool read them. ``"weights"``: the Blosc filter (byte shuffle + zstd, lean_store writes
    and reads its chunks itself; blosc.py), except where HDF5 must pack bits first (N-bit
    formats) or Blosc cannot shuffle the type: shuffle + deflate there."""
    if compression in (None, False):
        return
    if compression == "weights" and not nbit and can_blosc(itemsize):
        set_blosc(dcpl, itemsize, chunk_nbytes)
    elif compression in ("weights", "weights-gzip"):
        dcpl.set_shuffle()
        dcpl.set_deflate(WEIGHTS_DEFLATE_LEVEL)
    elif compression in ("gzip", True):
        dcpl.set_shuffle()
        dcpl.set_deflate(4)
    elif isinstance(compression, tuple) and compression[0] == "gzip":
        dcpl.set_shuffle()
        dcpl.set_deflate(int(compression[1]))
    elif compression == "lzf":
        dcpl.set_filter(32000, h5z.FLAG_OPTIONAL, ())
    else:
        raise CheckpointError(
            f"unknown HDF5 compression {compression!r}; use 'weights', 'weights-gzip', 'gzip' "
            "or 'lzf'"
        )


class HDF5TensorWriter(TensorWriter):
    def __init__(
        self, dset: h5d.DatasetID, entry: Entry, ftype: Any, chunks: tuple[int, ...],
        direct: bool = False, fletcher32: bool = True, deflate: Any = None,
        record: dict[str, Any] | None = None, attrs: dict[str, Any] | None = None,
        stored: tuple[int, ...] | None = None, fd: int | None = None,
        sizes: tuple[int, int, tuple[int, ...]] | None = None,
        small: SmallChunkWrites | None = None,
        single: tuple[SingleChunkDatasets, int] | None = None,
    ):
        self._dset = dset
        self._single = single  # its place in HDF5Writer._single_chunk: attributes counted
        # where small chunks are queued when this dataset's chunks are written at their
        # offsets (``fd``): the save's workers write them in batches
        self._small = small if fd is not None else None
        # the file's descriptor when every chunk of this dataset was allocated at its creation
        # and is unfiltered: chunks may then be written there by the save's workers
        self._fd = fd
        self._record = record  # this dataset's manifest record, completed by close()
        self._attrs = attrs  # written with the final ones by close(): one batch per dataset
        self._deflate = deflate  # shuffle + deflate done by lean_store on a thread pool
        self._ftype = ftype
        self.entry = entry
        self.chunk_shape = chunks
        self.write_unit = chunks
        self._stored_shape = dset.shape if stored is None else stored
        # (item size, chunk bytes, chunk grid): given by the writer's plan, else worked out
        self._itemsize, self._chunk_nbytes, self._grid = sizes or _sizes(
            ftype, chunks, self._stored_shape)
        # With no filter, or fletcher32 as the only one, whole chunks go in through
        # H5Dwrite_chunk: the bytes as they are (no pass through HDF5's chunk cache, which costs
        # a copy), or with the checksum computed by numcodecs (HDF5's own, byte by byte, is 2-3x
        # slower); HDF5 verifies it on every read like any chunk it filtered itself.
        self._direct = direct
        self._fletcher32 = fletcher32
        self._crcs = np.zeros(math.prod(self._grid), np.uint32)  # the chunk_crc32c table

    @property
    def small_later(self) -> bool:  # type: ignore[override]
        return self._small is not None

    def _write_chunk(self, region: Region, bits: np.ndarray) -> None:
        data = np.ascontiguousarray(bits).view(np.uint8).reshape(-1)
        if data.size < self._chunk_nbytes:
            # an edge chunk: row-block chunks hold its bytes as a prefix of the full chunk
            full = np.zeros(self._chunk_nbytes, np.uint8)
            full[: data.size] = data
            data = full
        if self._deflate is not None:
            self._deflate.submit(tuple(s.start for s in region), data)
            return
        payload = _FLETCHER32.encode(data) if self._fletcher32 else data
        with chunk_lock():
            self._dset.write_direct_chunk(tuple([s.start for s in region]), payload, 0)

    def write(self, region: Region, bits: np.ndarray, crc: int | None = None) -> None:
        """Write one chunk (``region`` is a whole chunk clipped to the dataset) and record
        its CRC-32C in the table."""
        if self._direct or self._deflate is not None:
            self._write_chunk(region, bits)
        else:
            shape = region_shape(region)
            buf = np.ascontiguousarray(bits).view(np.uint8).view(f"V{self._itemsize}")
            fspace = self._dset.get_space()
            fspace.select_hyperslab(tuple(s.start for s in region), shape)
            self._dset.write(h5s.create_simple(shape), fspace, buf.reshape(shape),
                             mtype=self._ftype)
        if crc is None:
            crc = crc32c_of(bits)
        elif callable(crc):  # computed while the chunk was written
            crc = crc()
        if self._crcs.size == 1:  # one chunk (most small tensors): its number is 0
            self._crcs[0] = crc
            return
        coords = tuple([s.start // c for s, c in zip(region, self.chunk_shape)])
        self._crcs[chunk_number(coords, self._grid)] = crc

    def write_later(self, region: Region, bits: np.ndarray, submit: Any) -> Any:
        """An unfiltered chunk of a dataset allocated at creation: written with ``pwritev``
        at its file offset (HDF5's ``H5Dget_chunk_info``) by a worker, which also computes
        its CRC-32C, while the caller goes on with the next datasets in HDF5 (the file's
        bytes are those ``H5Dwrite_chunk`` writes). A whole chunk of a compressed dataset
        is queued for compression without a copy (:meth:`_compress_later`). None: use
        :meth:`write`."""
        if self._deflate is not None:
            return self._compress_later(region, bits, submit)
        placed = self._placed(region, bits) if self._fd is not None else None
        if placed is None:
            return None
        return submit(self._write_at, *placed)

    def write_small_later(self, region: Region, bits: np.ndarray, crc: int, submit: Any
                          ) -> bool:
        """A small unfiltered chunk of a dataset allocated at creation, its CRC-32C ``crc``
        known: recorded, and its bytes queued for a worker to write at its offset with the
        next ones (``small_writes``). False: not queued, use :meth:`write`."""
        small = self._small
        placed = self._placed(region, bits) if small is not None else None
        if small is None or placed is None:
            return False
        number, offset, data = placed
        self._crcs[number] = crc
        small.add(offset, data, self._chunk_nbytes - data.size, submit)
        return True

    def _placed(self, region: Region, bits: np.ndarray) -> tuple[int, int, np.ndarray] | None:
        """(chunk number, file offset, bytes) of the chunk ``region`` when it can be written
        at its offset (allocated, unfiltered, full size, ``bits`` no larger); else None."""
        start = tuple(s.start for s in region)
        offset = self._chunk_at(start)
        if offset is None:
            return None
        data = np.ascontiguousarray(bits).view(np.uint8).reshape(-1)
        if data.size > self._chunk_nbytes:
            return None
        coords = tuple(a // c for a, c in zip(start, self.chunk_shape))
        return chunk_number(coords, self._grid), offset, data

    def _chunk_at(self, start: tuple[int, ...]) -> int | None:
        """The file offset of the allocated, unfiltered, full-size chunk at ``start``; None
        where it has none (the chunk is then written through HDF5)."""
        found = chunk_location(self._dset, start)
        if found is None:
            return None
        mask, offset, size = found
        if offset is None or size != self._chunk_nbytes or mask:
            return None
        return int(offset)

    def _compress_later(self, region: Region, bits: np.ndarray, submit: Any) -> Any:
        """A whole chunk of a compressed dataset from a stable source (its memory unchanged
        for the whole save): queued for compression as it is, without the copy :meth:`write`
        makes, its CRC-32C computed and recorded on a worker. None (an edge chunk, padded by
        :meth:`write`): use :meth:`write`."""
        data = np.ascontiguousarray(bits).view(np.uint8).reshape(-1)
        if data.size != self._chunk_nbytes:
            return None
        start = tuple(s.start for s in region)
        coords = tuple(a // c for a, c in zip(start, self.chunk_shape))
        assert self._deflate is not None
        self._deflate.submit(start, data, copy=False)
        return submit(self._record_crc, chunk_number(coords, self._grid), data)

    def _record_crc(self, number: int, data: np.ndarray) -> int:
        """The CRC-32C of chunk ``number`` (its bytes ``data``), recorded in the table."""
        crc = crc32c_of(data)
        self._crcs[number] = crc
        return crc

    def _write_at(self, number: int, offset: int, data: np.ndarray) -> int:
        """Chunk ``number`` (its bytes ``data``; an edge chunk padded with zeros as
        :meth:`_write_chunk` pads it) written at ``offset``; its CRC-32C, recorded in the
        table. The CRC is computed first: the bytes are then written from the cache."""
        crc = crc32c_of(data)
        assert self._fd is not None
        write_padded(self._fd, offset, data, self._chunk_nbytes - data.size)
        self._crcs[number] = crc
        return crc

    def close(self, attrs: dict[str, Any]) -> None:
        # chunks still compressing on the writer's queue are written later (by the next
        # tensors' writes, at the latest when the file is finished); their CRCs are known
        written = {**(self._attrs or {}), **attrs, CHUNK_CRC_ATTR: self._crcs}
        write_attrs(self._dset, written, replace=self._attrs is None)
        if self._single is not None and self._attrs is not None:
            datasets, number = self._single  # (attributes replaced: not counted, no digest)
            datasets.attributes[number] = min(len(written), MAX_COMPACT_ATTRS + 1)
        if self._record is not None:
            self._record["attrs"].update(attrs)
            self._record["table"] = self._crcs


def _sizes(ftype: Any, chunks: tuple[int, ...], stored: tuple[int, ...]
           ) -> tuple[int, int, tuple[int, ...]]:
    """(item size, bytes of a chunk, chunk grid) of a dataset of ``ftype`` and ``stored``
    shape cut into ``chunks``."""
    itemsize = ftype.get_size()
    return itemsize, math.prod(chunks) * itemsize, grid_shape(stored, chunks)


_ONE_SAVE_AT_A_TIME = ForkSafeLock()
"""HDF5 saves in one process run one after another. The HDF5 1.14 that h5py 3.12-3.15 bundles
corrupts its state when threads write different files at once (seen with three background
saves: "ring type mismatch occurred for cache entry", a failed H5DOwrite_chunk); h5py
serialises single calls, not whole saves. HDF5 runs one call at a time anyway."""


class HDF5Writer(StoreWriter):
    backend = "hdf5"

    def __init__(
        self, path: str | os.PathLike, *, chunk_bytes: int, compression: Any = None,
        checksum: str | None = None,
    ):
        checksum = CHECKSUMS[0] if checksum is None else checksum
        if checksum not in CHECKSUMS:
            raise CheckpointError(f"unknown HDF5 checksum {checksum!r}; use one of {CHECKSUMS}")
        super().__init__(path, chunk_bytes=chunk_bytes, compression=compression)
        self._fletcher32 = checksum == "fletcher32+crc32c"
        # shuffle + deflate or Blosc workers, when used: one queue for the whole file
        self._queue: OrderedPool | None = None
        self._records = ManifestBuilder()  # the manifest, one record per dataset
        # per record, in order, for the save's header digests (:mod:`.header_digests`): the
        # plan (stored shape, chunks, item size) of a dataset of one unfiltered chunk (None:
        # any other), its attributes (counted when closed), its header's address (at the end)
        self._single_chunk = SingleChunkDatasets()
        self._plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # see _plan
        _ONE_SAVE_AT_A_TIME.acquire()  # released when the file is closed (finish or abort)
        self._holds_lock = True
        self._writing: int | None = None  # open_for_writing's token while the file is open
        try:
            with self._creating():
                self._file, self._writing = open_for_writing(self.tmp_path, libver=LIBVER,
                                                             track_order=True)
        except BaseException:
            self._release()
            raise
        # HDF5's own descriptor, for chunks written by the save's workers (None: another
        # driver; every chunk then goes through H5Dwrite_chunk)
        self._fd = _write_descriptor(self._file)
        self._small = SmallChunkWrites(self._fd) if self._fd is not None else None

    def add_tensor(self, entry: Entry, attrs: dict[str, Any]) -> TensorWriter:
        stored = entry.shape or (1,)
        ftype, chunks, dcpl, space, direct, fletcher32, behind, sizes, plan_key = self._plan(
            entry.format, stored)
        node = node_name(entry.name)
        dset = h5d.create(self._file.id, node.encode(), ftype, space, dcpl=dcpl)
        # direct: no filter but (maybe) fletcher32, so no shuffle + deflate or Blosc either
        deflate = None if direct else self._deflate_chunks(dcpl, dset, ftype.get_size())
        record = {"node": node, "attrs": dict(attrs), "stored_shape": stored, "chunks": chunks}
        self._records.add(record)
        single = self._single_chunk.add(
            plan_key if behind and math.prod(sizes[2]) == 1 and math.prod(stored) > 0 else None)
        return HDF5TensorWriter(dset, entry, ftype, chunks, direct, fletcher32, deflate, record,
                                attrs, stored, self._fd if behind else None, sizes,
                                self._small, single)

    def _plan(self, fmt: ScalarFormat, stored: tuple[int, ...]) -> tuple[Any, ...]:
        """(file type, chunk shape, creation property list, dataspace, direct chunk writes,
        fletcher32 alone, written behind, :func:`_sizes`, (stored shape, chunk shape, item
        size) shared by its datasets' digest records) of a dataset of ``fmt`` and ``stored``
        shape: built once per distinct pair and reused (HDF5 copies what
        ``h5d.create`` is given), so that a state of many like-shaped tensors pays for them
        once."""
        key = (fmt, stored)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        ftype = hdf5_type(fmt)
        chunks = plan_chunks(stored, ftype.get_size(), self.chunk_bytes)
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk(chunks)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_INCR)
        dcpl.set_attr_phase_change(*ATTR_PHASE_CHANGE)  # attributes in the object header
        dcpl.set_obj_track_times(TRACK_TIMES)
        nbit = needs_nbit(fmt)
        if nbit:
            dcpl.set_filter(h5z.FILTER_NBIT, 0, ())
        _compression_filters(dcpl, self.compression, ftype.get_size(),
                             math.prod(chunks) * ftype.get_size(), nbit)
        if self._fletcher32:
            dcpl.set_fletcher32()
        nfilters = dcpl.get_nfilters()
        fletcher32 = nfilters == 1 and dcpl.get_filter(0)[0] == h5z.FILTER_FLETCHER32
        behind = self._fd is not None and nfilters == 0
        # chunk space allocated by H5Dcreate: the save's workers write the chunks there (see
        # HDF5TensorWriter.write_later; small ones in batches, write_small_later)
        if behind:
            dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        plan = self._plans[key] = (ftype, chunks, dcpl, h5s.create_simple(stored),
                                   nfilters == 0 or fletcher32, fletcher32, behind,
                                   _sizes(ftype, chunks, stored),
                                   (stored, chunks, ftype.get_size()))
        return plan

    def _deflate_chunks(self, dcpl: h5p.PropDCID, dset: h5d.DatasetID, itemsize: int
                        ) -> DeflateChunks | BloscChunks | None:
        """Threaded shuffle + deflate when the filters are exactly those (+ fletcher32);
        threaded Blosc when the filter is Blosc (HDF5 has no Blosc of its own)."""
        codes = [dcpl.get_filter(i) for i in range(dcpl.get_nfilters())]

        def put(offset: tuple[int, ...], payload: Any) -> None:
            with chunk_lock():
                dset.write_direct_chunk(offset, payload, 0)

        if blosc_fletcher32(dcpl) is not None:
            return BloscChunks(self._chunk_queue(), itemsize, self._fletcher32, put)
        if [c[0] for c in codes] not in (
            [h5z.FILTER_SHUFFLE, h5z.FILTER_DEFLATE],
            [h5z.FILTER_SHUFFLE, h5z.FILTER_DEFLATE, h5z.FILTER_FLETCHER32],
        ):
            return None
        level = int(codes[1][2][0])
        return DeflateChunks(self._chunk_queue(), itemsize, level, self._fletcher32, put)

    def _chunk_queue(self) -> OrderedPool:
        if self._queue is None:
            self._queue = OrderedPool(ThreadPoolExecutor(
                DEFLATE_THREADS, thread_name_prefix="lean_store-compress"))
        return self._queue

    def _finish(self, root_attrs: dict[str, Any]) -> None:
        self._stop_pool(flush=True)  # every tensor is closed: its last chunks written
        if self._small is not None:
            self._small.finish()  # the small chunks queued on the workers, written
        attrs = self._file.attrs
        for key, value in root_attrs.items():
            attrs[key] = to_hdf5_attr(value)
        if self._records.complete():  # every tensor closed: the manifest
            manifest = joined_utf8_attr(self._records.take_pieces())
            digests = self._header_digests(manifest)
            if digests is not None:
                attrs[DIGESTS_ATTR] = digests
            attrs[MANIFEST_ATTR] = manifest
        attrs["complete"] = np.int8(1)  # written last: a file without it is incomplete
        self._file.flush()
        close_written(self._file, self._writing)
        self._release()

    def _header_digests(self, manifest: np.ndarray) -> np.ndarray | None:
        """The digest table of the file's one-chunk datasets (:mod:`.header_digests`), read
        back through HDF5's descriptor once libhdf5 has written every header; None when no
        dataset is of that kind or addresses are not file positions."""
        fd = self._fd
        datasets, self._single_chunk = self._single_chunk, SingleChunkDatasets()
        if fd is None or not any(plan is not None for plan in datasets.plans):
            return None
        self._file.flush()  # every object header and chunk index written to the file

        def pread(size: int, offset: int) -> bytes:
            return os.pread(fd, size, offset)

        if not plain_superblock(pread(48, 0)):
            return None
        addresses = datasets.addresses

        def visit(_name: bytes, info: Any) -> None:  # in creation order: the manifest's
            addresses.append(info.u if info.type == h5l.TYPE_HARD else 0)

        self._file.id.links.iterate(visit, info=True, idx_type=h5.INDEX_CRT_ORDER)
        if len(addresses) != len(datasets):  # (only the datasets are linked from the root)
            return None
        return digest_table(pread, os.fstat(fd).st_size, datasets, manifest)

    def _stop_pool(self, *, flush: bool) -> None:
        queue, self._queue = self._queue, None
        if queue is None:
            return
        queue.finish(flush=flush)  # every chunk written before the root document

    def _close_quietly(self) -> None:
        self._stop_pool(flush=False)
        if self._small is not None:
            self._small.abandon()
        try:
            close_written(self._file, self._writing)
        except Exception:  # noqa: BLE001 - closing a broken file must not mask the first error
            pass
        finally:
            self._release()

    def _release(self) -> None:
        if self._holds_lock:
            self._holds_lock = False
            _ONE_SAVE_AT_A_TIME.release()


def _checked_filters(node: str, dcpl: Any, layout: int) -> list[str]:
    """The names of a dataset's filters, after refusing what reaches outside the file
    (virtual datasets, external raw storage) and filters lean_store does not know."""
    if layout == h5d.VIRTUAL:
        raise UnsafeFileError(f"{node!r} is a virtual dataset; lean_store reads its own data only")
    if dcpl.get_external_count() > 0:
        raise UnsafeFileError(f"{node!r} uses external raw storage outside the file")
    filters = []
    for i in range(dcpl.get_nfilters()):
        code = dcpl.get_filter(i)[0]
        if code not in ALLOWED_FILTERS:
            raise UnsafeFileError(f"{node!r} uses an unknown HDF5 filter (id {code})")
        filters.append(_FILTER_NAMES.get(code, str(code)))
    if "blosc" in filters:
        check_blosc_filter(node, dcpl, layout)
    return filters


class HDF5Reader(StoreReader):
    backend = "hdf5"

    def __init__(self, source: Any) -> None:
        try:
            # no chunk cache: datasets stay open between reads (OPEN_DATASETS), and a cache
            # would hold up to 1 MiB each while serving chunks lean_store reads whole anyway
            self._file = open_file(source, "r", rdcc_nbytes=0)
        except (OSError, ValueError) as exc:
            raise IntegrityError(f"{source}: not a readable HDF5 file ({exc})") from None
        try:
            # root attributes that grow with the tensors (the manifest, the layout) may be as
            # large as the file that holds them
            self._root_limit = root_attr_limit(_file_size(self._file))
            self.root_attrs = read_hdf5_attrs(
                self._file, str(source), dict.fromkeys(GROWING_ROOT_ATTRS, self._root_limit),
                ours=ROOT_ATTRS)
            # parsed on first use, after the header checks (parse_root) passed
            self._manifest_text = self.root_attrs.pop(MANIFEST_ATTR, None)
            self._digest_table = self.root_attrs.pop(DIGESTS_ATTR, None)
            self._where = str(source)
        except BaseException:
            self._file.close()
            raise
        self._manifest_records: dict[str, TensorRecord] | None = None
        # the save's header digests (:mod:`.header_digests`), when the table is bound to this
        # manifest: its rows, and node -> its row's number
        self._digests: dict[str, int] = {}
        self._digest_rows: np.ndarray | None = None
        self._datasets: dict[str, h5d.DatasetID] = {}
        self._listed: list[str] | None = None  # see nodes()
        self._hard_links: frozenset[str] = frozenset()  # every link nodes() listed: hard ones
        self._addresses: dict[str, int] = {}  # node -> its object header's address (nodes())
        # node -> (file offset, stored size) of the one chunk of a dataset read from its
        # object header, never opened through libhdf5 (see _stored_from_header)
        self._single: dict[str, tuple[int, int]] = {}
        self._single_blosc: dict[str, bool] = {}  # node of _single -> a Blosc frame (+ F32?)
        self._single_fletcher: set[str] = set()  # nodes of _single: the bytes, then Fletcher-32
        self._header_types: dict[str, tuple[int, bytes]] = {}  # node -> datatype message
        self._header_differs: set[str] = set()  # header_match said no at open: not asked again
        self._confirm_misses: set[str] = set()  # datasets libhdf5 did not confirm at open
        self._filesize: int | None = None
        self._attrs_checked: set[str] = set()  # datasets whose attributes match the manifest
        self._types: dict[str, Any] = {}
        self._direct_chunks: dict[str, tuple] = {}  # (chunks, shape, blosc, itemsize)/()
        self._tables: dict[str, np.ndarray | None] = {}  # node -> chunk_crc32c table
        # unfiltered chunks are read with one pread from their file offset (HDF5's H5Dread
        # costs ~30 % more per chunk), through HDF5's own descriptor: the file is opened once,
        # so a save replacing the path meanwhile can never pair this file's index with another
        # file's bytes (see docs/SECURITY.md)
        self._fd, self._file_size = _h5_descriptor(self._file)
        self._plain: dict[str, bool] = {}  # node -> chunked, no filter
        # node -> (stored shape, chunk shape, item size) of a chunked dataset, known from
        # stored(): the read path asks libhdf5 for none of them again
        self._geometry: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
        self._format_types: dict[ScalarFormat, Any] = {}  # see type_mismatch
        self._headers = HeaderAttributes(self._fd, self._file_size)  # see check_attributes

    @property
    def _manifest(self) -> dict[str, TensorRecord] | None:
        """node -> record from the root ``manifest`` attribute; None in files without one."""
        if self._manifest_records is None and self._manifest_text is not None:
            records = self._manifest_records = parse_manifest(self._manifest_text, self._where,
                                                              self._root_limit)
            if self._digest_table is not None:
                rows = parse_digests(self._digest_table, self._manifest_text, len(records))
                if rows is not None:  # kept as the array (a list of rows: ~0.5 kB each)
                    self._digest_rows = rows
                    self._digests = dict(zip(records, range(len(records))))
            self._manifest_text = self._digest_table = None
        return self._manifest_records

    def nodes(self) -> list[str]:
        """The root group's links, sorted; UnsafeFileError for any that is not a hard link.
        Listed once (the file is open read-only): later calls, and the opening of a dataset
        listed here, need no lookup of their own."""
        if self._listed is None:
            try:
                self._listed = self._nodes()
            except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise IntegrityError(f"unreadable HDF5 group listing ({exc})") from None
            self._hard_links = frozenset(self._listed)
        return list(self._listed)

    def _nodes(self) -> list[str]:
        links: list[tuple[bytes, int, Any]] = []  # one pass over the root group's links

        def visit(name: bytes, info: Any) -> None:
            # (raising in here would upset h5py's lock); ``u``: a hard link's object address
            links.append((name, info.type, info.u))

        self._file.id.links.iterate(visit, info=True)
        names = []
        for raw, kind, address in links:
            name = raw.decode("utf-8")
            if kind != h5l.TYPE_HARD:
                what = {h5l.TYPE_SOFT: "SoftLink", h5l.TYPE_EXTERNAL: "ExternalLink"}.get(
                    kind, "link of an unknown type")
                raise UnsafeFileError(f"{name!r} is a {what}, not a dataset")
            names.append(name)
            if isinstance(address, int) and not isinstance(address, bool):
                self._addresses[name] = address
        return sorted(names)

    def _dataset(self, node: str) -> h5py.Dataset:
        """``node`` as an h5py dataset (for the paths that need h5py's high-level API)."""
        return h5py.Dataset(self._dsid(node))

    def _dsid(self, node: str) -> h5d.DatasetID:
        """``node``'s low-level dataset id, kept open between calls (OPEN_DATASETS)."""
        dsid = self._datasets.pop(node, None)
        if dsid is None:
            dsid = self._open_dataset(node)
            if len(self._datasets) >= OPEN_DATASETS:
                del self._datasets[next(iter(self._datasets))]
        self._datasets[node] = dsid  # most recently used last
        return dsid

    def _open_dataset(self, node: str) -> h5d.DatasetID:
        """The dataset linked as ``node`` by a hard link (checked before it is opened),
        through the low-level API (h5py's ``group.get`` costs several times more)."""
        name = node.encode("utf-8")
        links = self._file.id.links
        try:
            try:  # a node nodes() listed is a hard link: no lookup needed
                kind = h5l.TYPE_HARD if node in self._hard_links else links.get_info(name).type
            except KeyError:  # the common case needs one lookup, a missing link two
                if not links.exists(name):
                    raise IntegrityError(f"dataset {node!r} is missing") from None
                raise
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"dataset {node!r} is unreadable ({exc})") from None
        if kind != h5l.TYPE_HARD:
            what = {h5l.TYPE_SOFT: "SoftLink", h5l.TYPE_EXTERNAL: "ExternalLink"}.get(
                kind, "link of an unknown type")
            raise UnsafeFileError(f"{node!r} is a {what}, not a dataset")
        try:
            oid = h5o.open(self._file.id, name)
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"dataset {node!r} is unreadable ({exc})") from None
        if not isinstance(oid, h5d.DatasetID):
            raise IntegrityError(f"{node!r} is not a dataset")
        return oid

    def stored(self, node: str) -> StoredTensor:
        try:
            return self._stored(node)
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"dataset {node!r}: unreadable metadata ({exc})") from None

    def _stored(self, node: str) -> StoredTensor:
        record = None if self._manifest is None else self._manifest.get(node)
        if record is not None:
            found = self._stored_from_digest(node, record) or self._stored_from_header(
                node, record)
            if found is None:
                found = self._stored_from_manifest(node, record)
            if found is not None:
                return found
        ds = self._dataset(node)
        dcpl = ds.id.get_create_plist()
        layout = dcpl.get_layout()
        filters = _checked_filters(node, dcpl, layout)
        attrs = read_hdf5_attrs(ds, repr(node))
        table = attrs.get(CHUNK_CRC_ATTR)
        if not ds.chunks and math.prod(ds.shape or (0,)):
            raise IntegrityError(unchunked_message(repr(node), tuple(ds.shape), getattr(
                table, "size", None)))
        check_hdf5_present(ds, node, filters)
        if table is not None:
            chunks = tuple(ds.chunks or ds.shape)
            self._tables[node] = parse_table(table, chunk_count(ds.shape, chunks), repr(node),
                                             shape=tuple(ds.shape), chunks=chunks)
            filters.append("crc32c")
        ftype = ds.id.get_type()
        self._types[node] = ftype
        return StoredTensor(
            node=node,
            attrs=attrs,
            stored_shape=tuple(ds.shape),
            chunk_shape=tuple(ds.chunks) if ds.chunks else tuple(ds.shape),
            storage="hdf5",
            itemsize=ftype.get_size(),
            nbytes_on_disk=ds.id.get_storage_size(),
            filters=filters,
        )

    def _stored_from_digest(self, node: str, record: TensorRecord) -> StoredTensor | None:
        """A dataset of one unfiltered chunk whose object header and chunk index hold exactly
        the bytes the save recorded for its record (:mod:`.header_digests`): it is the
        dataset written for that record, attributes included, without parsing its header.
        None: checked from its header or through libhdf5 as before."""
        number = self._digests.get(node)
        fd = self._fd
        if number is None or self._digest_rows is None or fd is None or (
            node in self._datasets or record.table.size != 1
        ) or not self._headers.addresses_are_positions():
            return None
        row: list[int] = self._digest_rows[number].tolist()
        if self._addresses.get(node) != row[0]:
            return None
        try:
            hit = header_matched(lambda n, at: os.pread(fd, n, at), self._file_size, row)
        except OSError:
            return None
        if hit is None or len(hit[0][1]) < 8:
            return None
        datatype, offset = hit
        itemsize = int.from_bytes(datatype[1][4:8], "little")
        size = math.prod(record.chunks) * itemsize
        if offset + size > self._file_size:
            return None
        found = self._one_chunk(node, record, record.stored_shape, record.chunks, itemsize,
                                (offset, size), datatype, ["crc32c"])
        self._attrs_checked.add(node)
        return found

    def _one_chunk(self, node: str, record: TensorRecord, shape: tuple[int, ...],
                   chunks: tuple[int, ...], itemsize: int, chunk: tuple[int, int],
                   datatype: tuple[int, bytes], filters: list[str]) -> StoredTensor:
        """A dataset of one chunk (its file position and stored bytes ``chunk``) known from
        its header's bytes, never opened through libhdf5: what the reads and the datatype
        check need of it recorded, and its description. ``filters``: its filters, then
        ``crc32c``; none but that: it is read as plain bytes."""
        check_chunk_shape(node, chunks, shape, itemsize)
        self._single[node] = chunk
        self._header_types[node] = datatype
        self._tables[node] = record.table
        self._geometry[node] = (shape, chunks, itemsize)
        self._plain[node] = filters == ["crc32c"]
        return StoredTensor(
            node=node, attrs=dict(record.attrs), stored_shape=shape, chunk_shape=chunks,
            storage="hdf5", itemsize=itemsize, nbytes_on_disk=chunk[1], filters=filters,
        )

    def _stored_from_header(self, node: str, record: TensorRecord) -> StoredTensor | None:
        """A dataset of one unfiltered chunk whose structure (dataspace, datatype size, layout,
        no filter or external storage, its one chunk present, inside the file and of full
        size) is read from its object header and chunk index at the address the root group's
        hard link gives (:mod:`.header_layout`), without opening it through libhdf5. Its
        attributes are compared with the record now when the header holds exactly the bytes
        libhdf5 confirmed (:func:`header_match`), else at its first read as always; its
        datatype by :meth:`type_mismatch`. None: the dataset is opened as before."""
        address = self._addresses.get(node)
        if address is None or node in self._datasets:
            return None
        expected = _expected_attrs(record)
        found = self._headers.single_chunk(
            address, None if expected is None else known_messages(expected))
        if found is None or found.shape != record.stored_shape or (
            found.chunks != record.chunks
        ) or record.table.size != 1:
            return None
        filters = ["crc32c"]
        if found.blosc is not None:  # the pipeline "weights" writes, checked byte for byte
            filters[:0] = ["blosc", "fletcher32"] if found.blosc else ["blosc"]
        elif found.fletcher32:  # checksum="fletcher32+crc32c", no compression
            filters[:0] = ["fletcher32"]
        stored = self._one_chunk(node, record, found.shape, found.chunks, found.itemsize,
                                 (found.offset, found.size), found.datatype, filters)
        if found.blosc is not None:
            self._single_blosc[node] = found.blosc
        elif found.fletcher32:
            self._single_fletcher.add(node)
        if header_match(found.attributes, expected) or self._confirm_header(
            node, found.attributes, expected, record
        ):
            self._attrs_checked.add(node)
        else:  # compared through libhdf5 at the first read (check_attributes)
            self._header_differs.add(node)
        return stored

    def _confirm_header(self, node: str, messages: dict[bytes, Any] | None,
                        expected: list[ExpectedAttr] | None, record: TensorRecord) -> bool:
        """The attributes of a header no confirmed encoding matched (in a new process none is
        confirmed yet) compared through libhdf5 now (:func:`attrs_match`) and, when they are
        the record's, the header's encodings learned (:func:`learn_header`): the datasets
        after it then match from their headers, so a process's first open confirms a few
        datasets instead of opening every one at its first read. After
        :data:`CONFIRM_MISSES` datasets that libhdf5 does not confirm either (attributes
        changed or rewritten by another tool) it stops trying in this file: those are
        compared at their first read, which names the difference."""
        if messages is None or expected is None or len(self._confirm_misses) >= CONFIRM_MISSES:
            return False
        encoded = _written_attrs(record)
        if attrs_match(self._dsid(node), encoded):
            learn_header(messages, expected, encoded)
            return True
        self._confirm_misses.add(node)  # its first read names the difference (not asked again)
        return False

    def _stored_from_manifest(self, node: str, record: TensorRecord) -> StoredTensor | None:
        """The dataset's structure checked (link, layout, filters, chunks present) through the
        low-level API; attributes and the chunk_crc32c table from the record. None when the
        dataset's shape or chunking is not the record's (re-chunked by a tool): the dataset's
        own attributes are read and checked then, as in a file without a manifest."""
        dsid = self._dsid(node)
        lib = library()
        facts = None if lib is None else lib.dataset_layout(dsid.id)
        if facts is not None and facts.external == 0 and facts.layout in (
            h5d.CHUNKED, h5d.CONTIGUOUS, h5d.COMPACT
        ) and all(f in ALLOWED_FILTERS and f != BLOSC_FILTER for f in facts.filters):
            # what _checked_filters checks, Blosc's parameters apart (h5py's path below)
            filters: list[str] = [_FILTER_NAMES.get(f, str(f)) for f in facts.filters]
            shape, chunks = facts.shape, facts.chunks
            counts: tuple[int, int] | None = (facts.num_chunks, facts.storage_size)
        else:
            dcpl = dsid.get_create_plist()
            layout = dcpl.get_layout()
            filters = _checked_filters(node, dcpl, layout)
            shape = dsid.shape
            chunks = dcpl.get_chunk() if layout == h5d.CHUNKED else None
            counts = None
        if shape != record.stored_shape or chunks != record.chunks:
            return None
        ftype = dsid.get_type()
        itemsize = ftype.get_size()
        stored = self._check_present(node, dsid, shape, chunks, ftype, filters, counts)
        self._types[node] = ftype
        self._tables[node] = record.table
        self._geometry[node] = (shape, chunks, itemsize)
        self._plain[node] = not filters  # chunked (checked above), no filter, nothing external
        if filters == ["fletcher32"]:  # what _read_chunk asks h5py otherwise
            self._direct_chunks[node] = (chunks, shape, None, itemsize)
        return StoredTensor(
            node=node, attrs=dict(record.attrs), stored_shape=shape, chunk_shape=chunks,
            storage="hdf5", itemsize=itemsize,
            nbytes_on_disk=dsid.get_storage_size() if stored is None else stored,
            filters=[*filters, "crc32c"],
        )

    def _check_present(self, node: str, dsid: Any, shape: tuple[int, ...],
                       chunks: tuple[int, ...], ftype: Any, filters: list[str],
                       counts: tuple[int, int] | None = None) -> int | None:
        """:func:`lean_store.stores.hdf5.checks.check_hdf5_present` on low-level ids: every chunk
        allocated, inside the file, and (uncompressed) as large as its values need. The bytes
        its chunks take in the file (None for a dataset without values: nothing checked).
        ``counts``: (chunks allocated, bytes they take), when already asked."""
        if math.prod(shape) == 0:
            return None
        check_chunk_shape(node, chunks, shape, ftype.get_size())
        expected = chunk_count(shape, chunks)
        try:
            present, stored = counts or (dsid.get_num_chunks(), dsid.get_storage_size())
            if self._filesize is None:
                self._filesize = self._file.id.get_filesize()
        except (OSError, RuntimeError, ValueError) as exc:
            raise IntegrityError(f"{node!r}: unreadable chunk index ({exc})") from None
        if present != expected:
            raise IntegrityError(
                f"{node!r}: {present} of {expected} chunks are present; the file is truncated "
                "or was never completely written"
            )
        if stored > self._filesize:
            raise UnsafeFileError(
                f"{node!r}: chunks claim {stored} bytes but the file holds only {self._filesize}"
            )
        if not {"gzip", "lzf", "szip", "blosc"} & set(filters):
            least = math.prod(shape) * _precision(ftype) // 8
            if stored < least:
                raise IntegrityError(
                    f"{node!r}: {stored} bytes stored but {least} are needed; the file is "
                    "truncated"
                )
        return stored

    def check_attributes(self, node: str) -> None:
        """IntegrityError unless the attributes on dataset ``node`` are those its manifest
        record holds (nothing to compare in a file without a manifest). Once per dataset."""
        if self._manifest is None or node in self._attrs_checked:
            return
        record = self._manifest.get(node)
        if record is None:
            return
        dsid = self._dsid(node)
        if self._as_written(dsid, _expected_attrs(record), lambda: _written_attrs(record),
                            header=node not in self._header_differs,
                            libhdf5=node not in self._confirm_misses):
            self._attrs_checked.add(node)
            return
        names = [*record.attrs, CHUNK_CRC_ATTR]  # read and compared, to name the difference
        try:
            attrs = read_attrs(dsid, repr(node), names)
        except IntegrityError:  # not the attributes written: read whatever is there
            attrs = read_attrs(dsid, repr(node))
        table = attrs.get(CHUNK_CRC_ATTR)
        if table is not None:  # a malformed table is named as such
            parse_table(table, record.table.size, repr(node), shape=record.stored_shape,
                        chunks=record.chunks)
        problems = attribute_differences(record, attrs)
        if problems:
            name = record.attrs.get("name", node)
            raise IntegrityError(
                f"tensor {name!r} (dataset {node!r}): its attributes were changed after the "
                f"save: {'; '.join(problems)}"
            )
        self._attrs_checked.add(node)

    def _as_written(self, dsid: h5d.DatasetID, expected: list[ExpectedAttr] | None,
                    written: Callable[[], list[EncodedAttr]], *, header: bool = True,
                    libhdf5: bool = True) -> bool:
        """True when dataset ``dsid`` holds exactly the attributes written (``expected``, as
        bytes; None: a value no attribute can hold): from its object header's bytes
        (:func:`header_match`, unless ``header`` is False) or, failing that, through libhdf5
        (:func:`attrs_match` of ``written()``, unless ``libhdf5`` is False), whose
        confirmation is learned (:func:`learn_header`). False: the caller reads the attributes
        value by value, which names the difference."""
        if expected is None:
            return False
        messages = self._headers.attribute_messages(dsid, len(expected))
        if header and header_match(messages, expected):  # the bytes libhdf5 confirmed
            return True
        if not libhdf5:
            return False
        encoded = written()
        if attrs_match(dsid, encoded):  # exactly as written: no decoding
            learn_header(messages, expected, encoded)
            return True
        return False

    def trust_attributes(self, node: str) -> None:
        """Skip :meth:`check_attributes` for ``node``: another process compared them with the
        manifest and every process agreed (the verify stage of a sharded load)."""
        self._attrs_checked.add(node)

    def type_mismatch(self, node: str, fmt: ScalarFormat) -> str | None:
        """None when the dataset's HDF5 type is exactly the one lean_store writes for ``fmt``."""
        datatype = self._header_types.get(node)
        if datatype is not None and (fmt, datatype) in _CONFIRMED_TYPES:
            return None  # the very bytes of a datatype libhdf5 found equal to fmt's
        ftype = self._types.get(node) or self._dsid(node).get_type()
        expected = self._format_types.get(fmt)
        if expected is None:
            expected = self._format_types[fmt] = hdf5_type(fmt)
        if ftype != expected:
            return f"HDF5 datatype does not encode {fmt.tag}"
        if datatype is not None:
            if len(_CONFIRMED_TYPES) >= MAX_CONFIRMED_TYPES:
                _CONFIRMED_TYPES.clear()
            _CONFIRMED_TYPES.add((fmt, datatype))
        return None

    def describe(self, node: str) -> StorageDescription:
        info = self.stored(node)
        return StorageDescription(
            chunk_shape=info.chunk_shape, codecs=tuple(info.filters),
            compression=tuple(f for f in info.filters if f not in _CHECKSUM_FILTERS),
            stored_bytes=info.nbytes_on_disk,
        )

    def structure_problems(self, node: str) -> list[ChunkProblem]:
        return structure_problems(self._dataset(node), self.stored(node))

    def read(
        self, node: str, selection: Selection, fmt: ScalarFormat, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Raw words of ``selection``, into ``out`` when given (a C-contiguous array of the
        selection's shape and the format's storage dtype). With a ``chunk_crc32c`` table, every
        chunk the selection touches is read whole and checked against it first."""
        self.check_attributes(node)
        if node in self._single:
            words = self._read_single(node, selection, fmt, out)
            if words is not None:
                return words
        ds = self._dsid(node)
        ftype = self._types.get(node) or ds.get_type()
        shape = selection.count + ((2,) if fmt.words_per_value == 2 else ())
        into = out
        if out is None or not out.flags.c_contiguous:
            out = np.empty(shape, dtype=fmt.storage_dtype)
        if out.size == 0:
            return out
        table = self._table(node, ds)
        if table is not None:
            self._read_checked(node, ds, ftype, selection, out, table)
        elif not self._read_chunk(node, ds, selection, out):
            _h5read(node, ds, ftype, selection, out)
        if into is not None and into is not out:
            into[...] = out
            return into
        return out

    def _read_single(self, node: str, selection: Selection, fmt: ScalarFormat,
                     out: np.ndarray | None) -> np.ndarray | None:
        """The whole of a dataset found by :meth:`_stored_from_header` (one chunk at a known
        offset) read into ``out`` (or a new array) with ``pread`` and checked against its
        CRC-32C; None for any other selection or ``out``: read as before."""
        shape, chunks, _ = self._geometry[node]
        if selection.start != (0,) * len(shape) or selection.count != shape or any(
            step != 1 for step in selection.step
        ):
            return None
        if out is None:
            out = np.empty(shape + ((2,) if fmt.words_per_value == 2 else ()),
                           dtype=fmt.storage_dtype)
        coords = (0,) * len(shape)
        filtered = node in self._single_blosc or node in self._single_fletcher
        crc = None if filtered else self._pread_halves(node, None, coords, out)
        if crc is None and self._read_single_filtered(node, out):
            crc = crc32c_of(out)
        elif crc is None:
            if not self._pread_chunk(node, None, coords, out):
                return None
            crc = crc32c_of(out)
        table = self._tables[node]
        assert table is not None  # the record's, set with _single
        expected = int(table[0])
        if crc != expected:
            raise _crc_mismatch(node, coords, coords, crc, expected)
        return out

    def _read_single_filtered(self, node: str, out: np.ndarray) -> bool:
        """The one filtered chunk of a dataset found by :meth:`_stored_from_header` read into
        ``out`` (at the chunk's origin, C-contiguous, a prefix of the chunk's bytes) with one
        ``pread`` at the offset its chunk record gives: a Blosc frame decompressed (its
        Fletcher-32 checked when stored), or the bytes of Fletcher-32 alone checked against
        it; NOT its CRC-32C (the caller's). False: not such a dataset or ``out``."""
        fletcher32 = self._single_blosc.get(node)
        alone = node in self._single_fletcher
        _, chunks, itemsize = self._geometry[node]
        if (fletcher32 is None and not alone) or self._fd is None or (
            not out.flags.c_contiguous
        ) or not _prefix_of_chunk(out.shape, chunks):
            return False
        offset, size = self._single[node]
        if alone:
            origin = (0,) * len(chunks)
            try:
                raw = os.pread(self._fd, size, offset)
            except OSError as exc:
                raise IntegrityError(f"{tensor_ref(node)}: chunk {origin} unreadable ({exc})"
                                     ) from None
            if len(raw) != size:
                raise IntegrityError(f"{tensor_ref(node)}: chunk {origin} is truncated")
            _fletcher32_into(node, origin, raw, out)
            return True
        assert fletcher32 is not None
        read_blosc_at(node, self._fd, offset, size, math.prod(chunks) * itemsize, fletcher32,
                      out.reshape(-1).view(np.uint8), (0,) * len(chunks))
        return True

    def chunk_crcs(self, node: str) -> np.ndarray | None:
        if node in self._tables:
            return self._tables[node]
        return self._table(node, self._dsid(node))

    def _table(self, node: str, dsid: h5d.DatasetID) -> np.ndarray | None:
        """The chunk_crc32c table: the manifest's, or (files without one) the dataset's."""
        if node not in self._tables:
            attrs = read_hdf5_attrs(h5py.Dataset(dsid), repr(node))
            value = attrs.get(CHUNK_CRC_ATTR)
            self._tables[node] = None if value is None else parse_table(
                value, chunk_count(*self._shape_and_chunks(node, dsid)), repr(node)
            )
        return self._tables[node]

    def _read_checked(
        self, node: str, ds: h5d.DatasetID, ftype: Any, selection: Selection, out: np.ndarray,
        table: np.ndarray,
    ) -> None:
        """Read each touched chunk whole (HDF5 reads whole chunks anyway), check its CRC-32C,
        then cut the selection out of it. A selection that is one whole chunk goes straight
        into ``out``."""
        shape, chunks = self._shape_and_chunks(node, ds)
        grid = grid_shape(shape, chunks)
        pair = out.shape[len(shape):]
        for coords in _touched_chunks(selection, chunks):
            start = tuple(i * c for i, c in zip(coords, chunks))
            count = tuple(min(c, d - a) for a, c, d in zip(start, chunks, shape))
            whole = Selection(start, count, (1,) * len(shape))
            target = out if whole == selection else np.empty(count + pair, out.dtype)
            crc = self._pread_halves(node, ds, coords, target)
            if crc is None:
                if not self._pread_chunk(node, ds, coords, target) and not self._read_chunk(
                    node, ds, whole, target
                ):
                    _h5read(node, ds, ftype, whole, target)
                crc = crc32c_of(target)
            expected = int(table[chunk_number(coords, grid)])
            if crc != expected:
                raise _crc_mismatch(node, coords, start, crc, expected)
            if target is out:
                continue
            dst, src = [], []
            for a, n, st, ca, cn in zip(selection.start, selection.count, selection.step,
                                        start, count):
                k0 = max(0, -(-(ca - a) // st))
                k1 = min(n, (ca + cn - 1 - a) // st + 1)
                dst.append(slice(k0, k1))
                src.append(slice(a + k0 * st - ca, a + (k1 - 1) * st - ca + 1, st))
            out[tuple(dst)] = target[tuple(src)]

    def read_unchecked(
        self, node: str, selection: Selection, fmt: ScalarFormat, out: np.ndarray
    ) -> np.ndarray:
        """One whole chunk (``selection``) read straight into the C-contiguous ``out``, NOT
        checked against the table: the caller runs :meth:`check_chunk` before using it (so
        that the check can overlap the read of the next chunk)."""
        self.check_attributes(node)
        origin = (0,) * len(selection.start)
        if node in self._single and out.size and selection.start == origin and (
            self._read_single_filtered(node, out) or self._pread_chunk(node, None, origin, out)
        ):
            return out
        ds = self._dsid(node)
        ftype = self._types.get(node) or ds.get_type()
        coords = tuple(a // c for a, c in zip(selection.start, self._shape_and_chunks(node, ds)[1]))
        if out.size and not self._pread_chunk(node, ds, coords, out) and not self._read_chunk(
            node, ds, selection, out
        ):
            _h5read(node, ds, ftype, selection, out)
        return out

    def check_chunk(self, node: str, number: int, words: np.ndarray) -> None:
        """IntegrityError unless ``words`` (chunk ``number`` in C order, whole) match the
        ``chunk_crc32c`` table."""
        ds = None if node in self._tables else self._dsid(node)
        table = self._tables[node] if ds is None else self._table(node, ds)
        if table is None:
            return
        crc, expected = crc32c_of(words), int(table[number])
        if crc != expected:
            shape, chunks = self._shape_and_chunks(node, ds)
            coords = tuple(int(c) for c in np.unravel_index(number, grid_shape(shape, chunks)))
            start = tuple(i * c for i, c in zip(coords, chunks))
            raise _crc_mismatch(node, coords, start, crc, expected)

    def _shape_and_chunks(self, node: str, dsid: h5d.DatasetID | None
                          ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(stored shape, chunk shape; the shape where not chunked) of ``node``."""
        geometry = self._geometry.get(node)
        if geometry is not None:
            return geometry[0], geometry[1]
        if dsid is None:
            dsid = self._dsid(node)
        shape = tuple(dsid.shape)
        return shape, _chunks_of(dsid) or shape

    def _pread_chunk(self, node: str, ds: h5d.DatasetID | None, coords: tuple[int, ...],
                     out: np.ndarray) -> bool:
        """Chunk ``coords`` of an unfiltered dataset read straight into ``out`` (the chunk
        clipped to the dataset, a prefix of its bytes) from the chunk's file offset. Every
        offset and size is checked against the file; False: use HDF5's read instead."""
        offset = self._chunk_offset(node, ds, coords, out)
        if offset is None:
            return False
        self._pread_into(node, coords, out.view(np.uint8).reshape(-1), offset)
        return True

    def _pread_halves(self, node: str, ds: h5d.DatasetID | None, coords: tuple[int, ...],
                      out: np.ndarray) -> int | None:
        """:meth:`_pread_chunk` of a chunk of :data:`SPLIT_READ_BYTES` or more in two halves,
        the second read (and its CRC-32C computed) by a worker while this thread reads the
        first (reads of one file run side by side, as do the page faults of a new ``out``).
        Returns the CRC-32C of ``out``'s bytes; None where the chunk is not read this way."""
        if out.nbytes < SPLIT_READ_BYTES:
            return None
        offset = self._chunk_offset(node, ds, coords, out)
        if offset is None:
            return None
        flat = out.view(np.uint8).reshape(-1)
        half = flat.size // 2 // 4096 * 4096  # whole pages each
        first, second = flat[:half], flat[half:]

        def read_second() -> int:
            self._pread_into(node, coords, second, offset + half)
            return crc32c_of(second)

        try:
            pending = crc_workers().submit(read_second)
        except RuntimeError:  # pools refuse work once interpreter shutdown has begun
            return None
        try:
            self._pread_into(node, coords, first, offset)
            crc = crc32c_of(first)
        except BaseException:
            if not pending.cancel():  # the worker writes into ``out``: done before it is
                wait([pending])  # handed back
            raise
        # workers busy with other work (a save's units) have not started it: read it here
        second_crc = read_second() if pending.cancel() else pending.result()
        return crc32c_combine(crc, second_crc, second.size)

    def _pread_into(self, node: str, coords: tuple[int, ...], flat: np.ndarray,
                    offset: int) -> None:
        try:
            got = os.preadv(self._fd, [flat], offset)  # type: ignore[arg-type,list-item]  # numpy stubs: __buffer__ 3.12+
        except OSError as exc:
            raise IntegrityError(f"{tensor_ref(node)}: chunk {coords} unreadable ({exc})") from None
        if got != flat.nbytes:
            raise IntegrityError(f"{tensor_ref(node)}: chunk {coords} is truncated")

    def _chunk_offset(self, node: str, ds: h5d.DatasetID | None, coords: tuple[int, ...],
                      out: np.ndarray) -> int | None:
        """The file offset of chunk ``coords`` of an unfiltered dataset, whose bytes start
        with those of ``out`` (the chunk clipped to the dataset): offset and size checked
        against the file. None: read with HDF5 instead (``ds``: None for a dataset found by
        :meth:`_stored_from_header`, never opened)."""
        if self._fd is None:
            return None
        single = None if node in self._single_blosc or node in self._single_fletcher else (
            self._single.get(node))
        if single is not None:
            if not any(coords) and out.flags.c_contiguous and _prefix_of_chunk(
                out.shape, self._geometry[node][1]
            ) and out.nbytes <= single[1]:
                return single[0]
        if ds is None:
            return None
        plain = self._plain.get(node)
        if plain is None:
            dcpl = ds.get_create_plist()
            plain = self._plain[node] = (
                dcpl.get_layout() == h5d.CHUNKED and dcpl.get_nfilters() == 0
                and dcpl.get_external_count() == 0
            )
        geometry = self._geometry.get(node)
        chunks = _chunks_of(ds) if geometry is None else geometry[1]
        if not plain or chunks is None or not out.flags.c_contiguous or not _prefix_of_chunk(
            out.shape, chunks
        ):
            return None
        start = tuple(i * c for i, c in zip(coords, chunks))
        found = chunk_location(ds, start)
        if found is None:
            return None
        mask, offset, size = found
        full = math.prod(chunks) * (ds.get_type().get_size() if geometry is None
                                    else geometry[2])
        if offset is None or mask != 0 or size != full or out.nbytes > size:
            return None
        if offset + size > self._file_size:
            raise IntegrityError(f"{tensor_ref(node)}: chunk {coords} lies past the end of the "
                                 "file")
        return int(offset)

    def _read_chunk(self, node: str, ds: h5d.DatasetID, selection: Selection, out: Any
                    ) -> bool:
        """Fast path for a whole row-block chunk stored with fletcher32 alone: H5Dread_chunk,
        checksum verified by numcodecs (2-3x faster than HDF5's). False: use H5Dread."""
        direct = self._direct_chunks
        info = direct.get(node)
        if info is None:
            dcpl = ds.get_create_plist()
            chunks = _chunks_of(ds)
            blosc = blosc_fletcher32(dcpl) if chunks is not None else None
            ok = chunks is not None and (blosc is not None or (
                dcpl.get_nfilters() == 1 and dcpl.get_filter(0)[0] == h5z.FILTER_FLETCHER32
            ))
            info = direct[node] = (chunks, tuple(ds.shape), blosc,
                                   ds.get_type().get_size()) if ok else ()
        if not info:
            return False
        chunks, shape, blosc, itemsize = info
        start, count = selection.start, selection.count
        if blosc is not None:  # Blosc chunks: decompressed by lean_store (HDF5 cannot)
            if any(step != 1 for step in selection.step) or any(
                a % c or a + n > min(a + c, d) for a, n, c, d in zip(start, count, chunks, shape)
            ):
                return False
            return read_blosc_region(node, ds, start, count, chunks, itemsize, blosc, out,
                                     self._fd, self._file_size)
        split = next((i for i, (c, d) in enumerate(zip(chunks, shape)) if c < d), len(shape))
        row_block = all(c == 1 for c in chunks[:split]) and chunks[split + 1 :] == shape[
            split + 1 :
        ]
        whole = all(
            a % c == 0 and (n == c or (row_block and i == split and a + n == d and n < c))
            for i, (a, n, c, d) in enumerate(zip(start, count, chunks, shape))
        )
        if not whole or any(step != 1 for step in selection.step):
            return False
        raw = self._pread_stored_chunk(node, ds, start, math.prod(chunks) * itemsize + 4)
        if raw is None:
            try:
                with chunk_lock():
                    mask, raw = ds.read_direct_chunk(start)
            except (OSError, RuntimeError, ValueError, KeyError):
                return False  # e.g. a chunk never written: H5Dread knows the fill value
            if mask != 0:
                return False
        _fletcher32_into(node, start, raw, out)
        return True

    def _pread_stored_chunk(self, node: str, ds: h5d.DatasetID, start: tuple[int, ...],
                            size: int) -> bytes | None:
        """The stored bytes of the chunk at ``start`` (what ``H5Dread_chunk`` returns) read
        with one ``pread`` from its file offset, when every filter was applied and it takes
        ``size`` bytes (offset and size checked against the file); None: ask HDF5."""
        lib, fd = library(), self._fd
        found = None if lib is None or fd is None else lib.chunk_info(ds.id, start)
        if fd is None or found is None or found[0] != 0 or found[2] != size:
            return None
        offset = found[1]
        if offset + size > self._file_size:
            raise IntegrityError(f"{tensor_ref(node)}: chunk at {start} lies past the end of the "
                                 "file")
        try:
            raw = os.pread(fd, size, offset)
        except OSError as exc:
            raise IntegrityError(f"{tensor_ref(node)}: chunk at {start} unreadable ({exc})"
                                 ) from None
        if len(raw) != size:
            raise IntegrityError(f"{tensor_ref(node)}: chunk at {start} is truncated")
        return raw

    def close(self) -> None:
        self._fd = None  # HDF5's own descriptor: closed with the file
        self._file.close()


_CONFIRMED_TYPES: set[tuple[ScalarFormat, tuple[int, bytes]]] = set()
"""(format, a datatype message's flags and body) pairs where libhdf5 found the datatype of a
dataset whose object header holds exactly that message equal to the type written for the
format (:meth:`HDF5Reader.type_mismatch`): the same bytes decode to the same type in any file.
"""
MAX_CONFIRMED_TYPES = 1024  # then forgotten all at once


def _fletcher32_into(node: str, start: tuple[int, ...], raw: bytes, out: np.ndarray) -> None:
    """The stored chunk ``raw`` (its bytes, then HDF5's Fletcher-32) checked and its first
    ``out.nbytes`` bytes copied into ``out``; IntegrityError naming the chunk on a mismatch."""
    try:
        data = _FLETCHER32.decode(raw)
    except RuntimeError as exc:
        raise IntegrityError(f"{tensor_ref(node)}: HDF5 chunk at {start}: {exc}") from None
    flat = out.view(np.uint8).reshape(-1)
    flat[...] = np.frombuffer(data, np.uint8, count=flat.size)


def _written_attrs(record: TensorRecord) -> list[EncodedAttr]:
    """The attributes the writer put on the dataset of ``record``, encoded as it wrote them."""
    return [*(encode_attr(k, v) for k, v in record.attrs.items()),
            encode_attr(CHUNK_CRC_ATTR, record.table)]


def _expected_attrs(record: TensorRecord) -> list[ExpectedAttr] | None:
    """The attributes of :func:`_written_attrs` as bytes (:func:`.header_attrs.expected_attr`),
    in the same order; None when a value in the record cannot be an attribute (an int past
    int64 in a hostile manifest, ...): the dataset's attributes are then read and compared
    value by value, which names the difference."""
    try:
        return expected_attrs(record.attrs, record.table)
    except (OverflowError, ValueError, TypeError):
        return None


def _precision(ftype: Any) -> int:
    """Significant bits per element of an HDF5 type (what the N-bit filter keeps at least)."""
    if ftype.get_class() == h5t.COMPOUND:
        return sum(_precision(ftype.get_member_type(i)) for i in range(ftype.get_nmembers()))
    try:
        return max(1, int(ftype.get_precision()))
    except (AttributeError, ValueError, RuntimeError):
        return 1


def _h5_descriptor(file: h5py.File) -> tuple[int | None, int]:
    """(descriptor, size) of the file HDF5 has open, for reads at chunk offsets, or
    (None, 0) where that is not possible: a driver other than sec2 (file objects, ...), a user
    block (offsets are not file positions), or a descriptor whose fstat disagrees with the
    size HDF5 reports for its file. The descriptor belongs to HDF5: never closed here."""
    if file.driver != "sec2" or file.userblock_size != 0:
        return None, 0
    try:
        fd = file.id.get_vfd_handle()
        info = os.fstat(fd)
        size = file.id.get_filesize()
    except (OSError, RuntimeError, ValueError, TypeError):
        return None, 0
    if not isinstance(fd, int) or not stat.S_ISREG(info.st_mode) or info.st_size != size:
        return None, 0
    return fd, info.st_size


GROWING_ROOT_ATTRS = ("layout", MANIFEST_ATTR, DIGESTS_ATTR, MASTER_MANIFEST_ATTR)
"""Root attributes whose size grows with the number of tensors: read up to
:func:`~lean_store.hardening.root_attr_limit` (any other: ``MAX_ATTR_BYTES``)."""


def _file_size(file: h5py.File) -> int:
    """The size of the file HDF5 has open (0 where it cannot tell)."""
    try:
        return int(file.id.get_filesize())
    except (OSError, RuntimeError, ValueError, TypeError):
        return 0


def _write_descriptor(file: h5py.File) -> int | None:
    """HDF5's descriptor of a file it is writing, for chunk writes at file offsets; None for
    other drivers or a user block (offsets are not file positions). Belongs to HDF5."""
    if file.driver != "sec2" or file.userblock_size != 0:
        return None
    try:
        fd = file.id.get_vfd_handle()
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except (OSError, RuntimeError, ValueError, TypeError):
        return None
    return fd if isinstance(fd, int) and regular else None


def _h5read(node: str, ds: h5d.DatasetID, ftype: Any, selection: Selection, out: np.ndarray
            ) -> None:
    """H5Dread of ``selection`` into the C-contiguous ``out``, the memory type equal to the
    file type (no conversion; HDF5 reads unfiltered chunks straight into ``out``). Never for
    a dataset with the Blosc filter: HDF5 would look for it as a plugin (lean_store loads none
    for its files and decodes Blosc chunks itself, whole chunks through ``H5Dread_chunk``)."""
    if BLOSC_FILTER in _filter_ids(ds):
        raise UnsafeFileError(
            f"{tensor_ref(node)}: a Blosc dataset is read by whole chunks with its chunk_crc32c "
            "table; this read would need HDF5's filter plugin, which lean_store never loads")
    count = selection.count
    fspace = ds.get_space()
    fspace.select_hyperslab(selection.start, count, selection.step)
    buf = out.view(np.uint8).reshape(-1).view(f"V{ftype.get_size()}").reshape(count)
    try:
        ds.read(h5s.create_simple(count), fspace, buf, mtype=ftype)
    except (OSError, RuntimeError, ValueError) as exc:
        raise IntegrityError(f"{tensor_ref(node)}: HDF5 read failed ({exc})") from None


def _chunks_of(dsid: h5d.DatasetID) -> tuple[int, ...] | None:
    """The chunk shape of a chunked dataset, else None (what ``h5py.Dataset.chunks`` says)."""
    dcpl = dsid.get_create_plist()
    return tuple(dcpl.get_chunk()) if dcpl.get_layout() == h5d.CHUNKED else None


def _filter_ids(ds: h5d.DatasetID) -> list[int]:
    dcpl = ds.get_create_plist()
    return [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]


def _prefix_of_chunk(shape: tuple[int, ...], chunks: tuple[int, ...]) -> bool:
    """A region of ``shape`` at a chunk's origin is a prefix of the chunk's bytes in C order."""
    shape = shape[: len(chunks)]
    clipped = [i for i, (n, c) in enumerate(zip(shape, chunks)) if n < c]
    return not clipped or (len(clipped) == 1 and all(c == 1 for c in chunks[: clipped[0]]))


def _crc_mismatch(node: str, coords: tuple[int, ...], start: tuple[int, ...], crc: int,
                  expected: int) -> IntegrityError:
    return IntegrityError(
        f"{tensor_ref(node)}: chunk {coords} (elements from {start}) has crc32c {crc:#010x}, the "
        f"chunk_crc32c table says {expected:#010x}; the chunk is corrupt or misplaced"
    )


def _touched_chunks(selection: Selection, chunks: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Grid coordinates of the chunks a strided selection reads, in C order."""
    axes: list[Iterable[int]] = []
    for a, n, st, c in zip(selection.start, selection.count, selection.step, chunks):
        last = a + (n - 1) * st
        if st <= c:
            axes.append(range(a // c, last // c + 1))
        else:
            axes.append(sorted({(a + k * st) // c for k in range(n)}))
    return itertools.product(*axes)
