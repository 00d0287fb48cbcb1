"""Digests of one-chunk datasets' object headers and chunk indexes, taken by the save.

An open checks each dataset against its manifest record before anything is read. For a
dataset of one chunk that means parsing its object header and chunk index
(:mod:`.header_layout`) and comparing a dozen attribute messages (:mod:`.header_attrs`), ~35 us
of Python per tensor. The save knows those bytes once it has written them: it records, for
every one-chunk unfiltered dataset, where its header chunks and chunk index lie, where the
datatype message and the chunk are, and the CRC-32C of those bytes (:func:`digest_table`, the
root attribute :data:`DIGESTS_ATTR`, docs/FORMAT.md). An open that finds the same bytes at the
same places (:func:`matched`: one ``pread`` per range and one CRC-32C) knows the dataset is the
one the save wrote for its record, attributes included, without parsing it.

The table is bound to the manifest it was written with (the CRC-32C of the manifest's bytes)
and to itself (the CRC-32C of its rows): with a manifest or a table edited after the save it
is not used, and each dataset is then checked as before. A dataset whose bytes differ (an
attribute changed by h5py, a chunk moved, every object of a copy that h5repack made) falls
back the same way, which names the difference. Nothing in the table is trusted beyond
"these bytes are the ones the save wrote"; the chunk's CRC-32C is still checked on every read.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import google_crc32c
import numpy as np

from ...hardening import MAX_ATTR_BYTES
from .header import MAX_HEADER_CHUNK, compact_only, first_chunk
from .header_layout import chunked_layout, dataspace_dims, index_node_size, leaf_chunk

DIGESTS_ATTR = "header_digests"
VERSION = 1
MAX_CONTINUATIONS = 2  # header chunks a row covers after chunk 0
# chunk-0 layouts kept per plan: HDF5 1.14 puts the attribute info message of some
# datasets of one plan in chunk 0 and of others in a continuation chunk, and the header's
# times tick during a long save
_LAYOUTS_KEPT = 8
COLUMNS = 7 + 2 * MAX_CONTINUATIONS
"""Columns of a dataset's row: header address, chunk 0's bytes, the address and bytes of each
of its continuation chunks (0, 0: none), the chunk index's address and bytes read, the
chunk's file position, the datatype message (:func:`_datatype_word`) and the CRC-32C of those
ranges' bytes in that order. A row of zeros: no digest (checked as before). Row 0 of the table:
version, number of rows after it, CRC-32C of the manifest's bytes, CRC-32C of the rows. The
attribute holds the rows one after another (a 1-D array: what every lean_store reader accepts
as an attribute)."""

_OCHK = b"OCHK"
_MESSAGE = struct.Struct("<BHB")  # type, size of the body, flags
_NIL, _DATASPACE, _DATATYPE, _FILL_VALUE, _LAYOUT = 0x00, 0x01, 0x03, 0x05, 0x08
_ATTRIBUTE, _CONTINUATION, _MODIFIED, _ATTRIBUTE_INFO = 0x0C, 0x10, 0x12, 0x15
_SHARED = 0x02  # message flag: the body refers to a shared message elsewhere
_CONT = struct.Struct("<QQ")
_ONCE = frozenset((_DATASPACE, _DATATYPE, _LAYOUT))  # exactly one each
_AT_MOST_ONCE = frozenset((_FILL_VALUE, _MODIFIED, _ATTRIBUTE_INFO))
_REPEATED = frozenset((_NIL, _ATTRIBUTE, _CONTINUATION))

Pread = Callable[[int, int], bytes]  # (size, offset) -> bytes
Eligible = tuple[int, tuple[int, ...], tuple[int, ...], int, int]
"""A dataset the save wrote as one unfiltered chunk: its object header's address, its stored
shape, its chunk shape, its item size and its number of attributes."""


MAX_COMPACT_ATTRS = 32
"""Attributes a dataset's header holds as messages (the save's ``H5Pset_attr_phase_change``
bound): with more, libhdf5 may keep them outside the header, where no digest reaches."""
_CONTINUATION_HEAD = bytes((0x10, 16, 0))  # a continuation message's type and body size


class SingleChunkDatasets:
    """A save's datasets in manifest order, those of one unfiltered chunk with what their
    digests need: compact (two array slots and one shared plan per dataset), since a save of
    tens of thousands of tensors keeps them until its end. The object header addresses are
    asked at the end, in one pass over the root group's links."""

    def __init__(self) -> None:
        self.addresses = array("Q")  # object header addresses, in order (0: not a hard link)
        self.attributes = array("H")  # attributes written (counted when the dataset closes)
        self.plans: list[tuple[tuple[int, ...], tuple[int, ...], int] | None] = []

    def add(self, plan: tuple[tuple[int, ...], tuple[int, ...], int] | None
            ) -> tuple[SingleChunkDatasets, int] | None:
        """The next dataset, of ``plan`` (stored shape, chunks, item size: shared by the
        datasets of a plan) when it is one unfiltered chunk, else None. Its place, for its
        attribute count (None for a dataset of another kind)."""
        self.attributes.append(MAX_COMPACT_ATTRS + 1)  # unknown until it is closed
        self.plans.append(plan)
        return None if plan is None else (self, len(self.plans) - 1)

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, number: int) -> Eligible | None:
        plan = self.plans[number]
        address = self.addresses[number] if number < len(self.addresses) else 0
        if plan is None or not address:
            return None
        return (address, *plan, self.attributes[number])


def _datatype_word(at: int, size: int, flags: int) -> int:
    """The datatype message's body (``size`` bytes at ``at`` in chunk 0) and its message
    flags, as one column."""
    return at | size << 32 | flags << 48


def _walk(block: bytes, pos: int, end: int, order: int,
          found: dict[int, tuple[int, int, int]], conts: list[tuple[int, int]]) -> bool:
    """The messages of one header chunk: the body position, size and flags of each
    structural message into ``found``, continuations into ``conts``. False for anything a
    digest must not cover: a shared message (its bytes lie elsewhere), an attribute with
    shared parts or not of version 3, dense attribute storage, a filter pipeline, a message
    of another kind, a structural message twice."""
    step = 4 + order
    unpack = _MESSAGE.unpack_from
    while end - pos >= step:  # fewer bytes left: the gap before the checksum
        kind, size, mflags = unpack(block, pos)
        body = pos + step
        pos = body + size
        if pos > end or mflags & _SHARED:
            return False
        if kind in _REPEATED:
            if kind == _ATTRIBUTE and (size < 2 or block[body] != 3 or block[body + 1] != 0):
                return False
            if kind == _CONTINUATION:
                if size < _CONT.size:
                    return False
                conts.append(_CONT.unpack_from(block, body))
            continue
        if kind not in _ONCE and kind not in _AT_MOST_ONCE or kind in found:
            return False
        if kind == _ATTRIBUTE_INFO and not compact_only(block[body:pos]):
            return False
        found[kind] = (body, size, mflags)
    return True


class _Chunk0(NamedTuple):
    """The structural messages at the start of a walked chunk 0, kept for the next datasets
    of the same plan: theirs differ only in the chunk index's address."""

    prefix: bytes  # chunk 0 up to the end of its last structural message
    index_at: int  # where the chunk index's address lies in it
    datatype: int  # :func:`_datatype_word`
    ndims: int  # dimensions of the chunk index's keys (the rank, then the item)
    index_size: int  # :func:`.header_layout.index_node_size` of them
    nbytes: tuple[int, int]  # the chunk's bytes (least and most its index may hold)

    def same(self, head: bytes) -> bool:
        """``head`` starts with this prefix but for the chunk index's address."""
        prefix, at = self.prefix, self.index_at
        return head[:at] == prefix[:at] and head[at + 8:len(prefix)] == prefix[at + 8:]


class DigestRows:
    """The rows of one save's datasets, read back through HDF5's descriptor (``pread``) of a
    file of ``file_size`` bytes. Chunk 0 of a header is walked message by message once per
    plan (shape, chunks, item size) and layout; the next datasets of that plan are compared
    with the layouts walked."""

    def __init__(self, pread: Pread, file_size: int) -> None:
        self._pread = pread
        self._file_size = file_size
        self._walked: dict[tuple[Any, ...], list[_Chunk0]] = {}

    def row(self, dataset: Eligible) -> list[int] | None:
        """The row of :data:`COLUMNS` of the one-chunk unfiltered dataset ``dataset`` as the
        file now holds it; None when its header or index is not exactly of that kind (its
        structural messages past chunk 0, a header of more than three chunks, attributes
        kept outside the header): it is then checked as before."""
        address, shape, chunks, itemsize, nattrs = dataset
        pread, file_size = self._pread, self._file_size
        first = first_chunk(pread, address, file_size)
        if first is None or nattrs > MAX_COMPACT_ATTRS:
            return None
        head, start, end, order, more = first
        layouts = self._walked.setdefault((start, order, shape, chunks, itemsize), [])
        conts: list[tuple[int, int]] = []  # after the prefix: attributes and continuations
        for known in layouts:
            if known.same(head) and _walk_tail(head, len(known.prefix), end, order, conts):
                break
            conts.clear()
        else:
            walked = _walk_chunk0(head, start, end, order, shape, chunks, itemsize)
            if walked is None or not _walk_tail(head, len(walked.prefix), end, order, conts):
                return None
            known = walked
            if len(layouts) == _LAYOUTS_KEPT:
                del layouts[0]
            layouts.append(known)
        index = int.from_bytes(head[known.index_at:known.index_at + 8], "little")
        blocks = [head]
        ranges = [0] * (2 * MAX_CONTINUATIONS)
        for i, (at, length) in enumerate(conts):  # grows as continuations lead to more
            if i >= MAX_CONTINUATIONS or not 8 <= length <= MAX_HEADER_CHUNK or not (
                0 <= at <= file_size - length
            ):
                return None
            block = pread(length, at)
            if len(block) != length or block[:4] != _OCHK:
                return None
            # a continuation chunk is walked only when a continuation message's first
            # bytes appear in it (most hold attributes alone). Its attributes are in the
            # header (at most MAX_COMPACT_ATTRS of them) and none is shared: the save's file
            # has no shared-message index (h5py's default file creation properties)
            if _CONTINUATION_HEAD in block and not _walk_tail(block, 4, length - 4, order,
                                                               conts, nested=True):
                return None
            blocks.append(block)
            ranges[2 * i:2 * i + 2] = at, length
        index_size = known.index_size
        if index == address + len(head) and len(more) >= index_size:
            node = more[:index_size]  # the index just after chunk 0: read with it
        elif index + index_size <= file_size:
            node = pread(index_size, index)
        else:
            return None
        chunk = leaf_chunk(node, known.ndims, known.nbytes, file_size)
        if chunk is None:
            return None
        digest = google_crc32c.value(head)
        for block in blocks[1:]:
            digest = google_crc32c.extend(digest, block)
        digest = google_crc32c.extend(digest, node)
        return [address, len(head), *ranges, index, index_size, chunk[0], known.datatype, digest]


def _walk_chunk0(head: bytes, start: int, end: int, order: int, shape: tuple[int, ...],
                 chunks: tuple[int, ...], itemsize: int) -> _Chunk0 | None:
    """Chunk 0 of a header holding the dataspace of ``shape``, a datatype of ``itemsize``
    bytes and a chunked layout of ``chunks`` (then attributes and at most one continuation:
    see :func:`_walk_tail`); None otherwise."""
    found: dict[int, tuple[int, int, int]] = {}
    if not _walk(head, start, end, order, found, []) or not _ONCE <= found.keys():
        return None

    def body(kind: int) -> bytes:
        at, size, _ = found[kind]
        return head[at:at + size]

    datatype = body(_DATATYPE)
    if dataspace_dims(body(_DATASPACE)) != shape or len(datatype) < 8 or int.from_bytes(
        datatype[4:8], "little"
    ) != itemsize or not all(0 < d <= c for d, c in zip(shape, chunks)):
        return None
    layout = chunked_layout(body(_LAYOUT), len(shape), itemsize)
    if layout is None or layout[1] != chunks:
        return None
    at, size, flags = found[_DATATYPE]
    prefix = max(at + size for at, size, _ in found.values())
    index_at = found[_LAYOUT][0] + 3  # after the version, the layout class and the rank
    nbytes = math.prod(chunks) * itemsize
    return _Chunk0(head[:prefix], index_at, _datatype_word(at, size, flags), len(shape) + 1,
                   index_node_size(len(shape) + 1), (nbytes, nbytes))


def _walk_tail(block: bytes, pos: int, end: int, order: int,
               conts: list[tuple[int, int]], nested: bool = False) -> bool:
    """The messages of a header chunk from ``pos``: attributes (version 3, nothing shared),
    NIL messages and continuations (into ``conts``) only; in a continuation chunk
    (``nested``) also the attribute info message of attributes kept in the header."""
    step = 4 + order
    unpack = _MESSAGE.unpack_from
    while end - pos >= step:
        kind, size, mflags = unpack(block, pos)
        body = pos + step
        pos = body + size
        if pos > end or mflags & _SHARED:
            return False
        if kind == _ATTRIBUTE:
            if size < 2 or block[body] != 3 or block[body + 1] != 0:
                return False
        elif kind == _CONTINUATION:
            if size < _CONT.size:
                return False
            conts.append(_CONT.unpack_from(block, body))
        elif kind == _ATTRIBUTE_INFO and nested:
            if not compact_only(block[body:pos]):
                return False
        elif kind != _NIL:
            return False
    return True


def digest_table(pread: Pread, file_size: int,
                 datasets: Sequence[Eligible | None] | SingleChunkDatasets,
                 manifest: np.ndarray) -> np.ndarray | None:
    """The :data:`DIGESTS_ATTR` value of a file whose datasets, in manifest order, are
    ``datasets`` (None: not one unfiltered chunk), bound to the manifest attribute's array;
    None past the size any attribute may have (:data:`~lean_store.hardening.MAX_ATTR_BYTES`)."""
    if (len(datasets) + 1) * COLUMNS * 8 > MAX_ATTR_BYTES:
        return None
    table = np.zeros((len(datasets) + 1, COLUMNS), np.uint64)
    rows = DigestRows(pread, file_size)
    for i in range(1, len(datasets) + 1):
        dataset = datasets[i - 1]
        row = None if dataset is None else rows.row(dataset)
        if row is not None:
            table[i] = row
    table[0, :4] = (VERSION, len(datasets), _bytes_crc(manifest), _bytes_crc(table[1:]))
    return table.reshape(-1)


def parse_table(value: Any, manifest: Any, count: int) -> np.ndarray | None:
    """The rows (``count`` x :data:`COLUMNS`, uint64) of a :data:`DIGESTS_ATTR` value read
    back, for a manifest of ``count`` records whose attribute read back as ``manifest``; None
    when it is not a table of this version bound to exactly that manifest (the caller then
    checks every dataset as before)."""
    if not isinstance(value, np.ndarray) or value.dtype != np.uint64 or value.shape != (
        (count + 1) * COLUMNS,
    ):
        return None
    value = value.reshape(count + 1, COLUMNS)
    text = manifest.encode("utf-8") if isinstance(manifest, str) else manifest
    if not isinstance(text, bytes):
        return None
    head = value[0].tolist()
    if head[:2] != [VERSION, count] or head[4:] != [0] * (COLUMNS - 4) or head[2] != (
        google_crc32c.value(text)
    ) or head[3] != _bytes_crc(value[1:]):
        return None
    return value[1:]


def matched(pread: Pread, file_size: int, row: list[int]
            ) -> tuple[tuple[int, bytes], int] | None:
    """(datatype message flags and body, chunk position) of the dataset of ``row`` when the
    file holds exactly the bytes the save recorded; None otherwise (or for a row of zeros)."""
    address, size = row[0], row[1]
    index, index_size, chunk, datatype, digest = row[-5:]
    if not size or address + size > file_size or index + index_size > file_size:
        return None
    if index == address + size:  # the chunk index just after chunk 0: one read
        both = pread(size + index_size, address)
        head, node = both[:size], both[size:]
    else:
        head, node = pread(size, address), pread(index_size, index)
    if len(head) != size or len(node) != index_size:
        return None
    crc = google_crc32c.value(head)
    for i in range(2, 2 + 2 * MAX_CONTINUATIONS, 2):
        at, length = row[i], row[i + 1]
        if not length:
            break
        block = pread(length, at) if at + length <= file_size else b""
        if len(block) != length:
            return None
        crc = google_crc32c.extend(crc, block)
    if google_crc32c.extend(crc, node) != digest:
        return None
    at, length = datatype & 0xFFFFFFFF, datatype >> 32 & 0xFFFF
    if at + length > size:
        return None
    return (datatype >> 48, head[at:at + length]), chunk


def _bytes_crc(array: np.ndarray) -> int:
    return google_crc32c.value(np.ascontiguousarray(array).reshape(-1).view(np.uint8).tobytes())
