"""A one-chunk dataset's structure read from its object header's bytes, without libhdf5.

Opening a dataset through libhdf5 (``H5Oopen``), asking it for its layout, filters, shape and
chunk address, and closing it again costs ~0.1 ms; most tensors of a model are small, one chunk
each. The root group's listing (one pass, done anyway) gives every dataset's object header
address; :func:`single_chunk` reads that header (one ``pread`` per header chunk,
:mod:`.header`) and the chunk index it points to, and accepts exactly this shape of dataset,
which is what lean_store writes for a tensor of one chunk (``v108`` bounds):

- a version 2 header of compact attributes (as :mod:`.header` reads it) whose other messages
  are one dataspace (version 2, simple, no maximum other than its size), one datatype, one
  layout, and at most a fill value and a modification time: no filter pipeline, no external
  storage, nothing shared, nothing else;
- a layout message of version 3, chunked, whose v1 B-tree is one leaf holding one chunk, at
  offset 0, unfiltered (mask 0), of exactly the chunk's bytes, inside the file;
- or the same with one filter pipeline message holding Fletcher-32 alone (what
  ``checksum="fletcher32+crc32c"`` writes without compression: version 2, one mandatory filter,
  no values): its one chunk is the chunk's bytes and their 4-byte checksum, no filter skipped;
- or the same with one filter pipeline message holding exactly what ``compression="weights"``
  writes (:func:`blosc_pipeline`: version 2, Blosc 32001 optional with the seven parameters
  lean_store gives it, then Fletcher-32 if the checksum asks for it): its one chunk is stored
  with no filter skipped (mask 0) in at most the bytes a Blosc frame of the chunk can take.

Anything else is None and the caller opens the dataset through libhdf5 as before. The datatype
message's bytes are returned, not decoded: the caller accepts them only once libhdf5 compared
a dataset holding exactly those bytes with the type lean_store writes for the format.
Addresses are file positions: the caller checks the superblock (:func:`.header.plain_superblock`)
and reads through HDF5's own descriptor.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import NamedTuple

from ..blosc_frames import HEADER, frame_size_limit
from .blosc import BLOSC_FILTER, blosc_parameters
from .header import AttributeMessage, KnownMessages, OtherMessage, attribute_messages

_DATASPACE, _DATATYPE, _FILL_VALUE, _LAYOUT, _PIPELINE, _MODIFIED = (
    0x01, 0x03, 0x05, 0x08, 0x0B, 0x12)
_ONCE = (_DATASPACE, _DATATYPE, _LAYOUT)  # exactly one each
_AT_MOST_ONCE = (_FILL_VALUE, _MODIFIED, _PIPELINE)  # the pipeline: checked exactly
_FLETCHER32_FILTER = 3  # H5Z_FILTER_FLETCHER32
_FLETCHER32_SIZE = 4  # the checksum libhdf5 appends to each chunk
# the pipeline message (flags, body) of Fletcher-32 alone: constant, version 2, one filter,
# mandatory, no values
_FLETCHER32_ALONE = (1, bytes((2, 1)) + struct.pack("<HHH", _FLETCHER32_FILTER, 0, 0))
_UNDEFINED = 2**64 - 1
_BTREE_HEAD = struct.Struct("<4sBBHQQ")  # "TREE", node type, level, entries, left, right
_KEY_HEAD = struct.Struct("<II")  # a chunk key: stored size, filter mask (then its offsets)
_RAW_DATA_NODE = 1  # B-tree node type of a chunked dataset's index
_LEAF_HEAD = _BTREE_HEAD.pack(b"TREE", _RAW_DATA_NODE, 0, 1, _UNDEFINED, _UNDEFINED)
"""The first bytes of the only B-tree node of a dataset of one chunk: a raw data node, a leaf
(level 0) of one entry, no left or right sibling. Compared as bytes, not unpacked."""
_KNOWN_KINDS = frozenset(_ONCE + _AT_MOST_ONCE)
_MAX_RANK = 32


class SingleChunk(NamedTuple):
    """A dataset of one chunk, unfiltered, Fletcher-32 alone, or Blosc-compressed as
    ``compression="weights"`` writes it, as its object header and chunk index say."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    itemsize: int
    datatype: tuple[int, bytes]  # the datatype message's flags and body, not decoded
    offset: int  # the chunk's file position
    size: int  # its stored bytes: the chunk shape's values times the item size, unfiltered
    attributes: dict[bytes, AttributeMessage]
    blosc: bool | None = None  # None: no Blosc; else a Blosc frame, Fletcher-32 after it?
    fletcher32: bool = False  # no Blosc, the chunk's bytes then their Fletcher-32 checksum


class _Cached:
    """``pread`` that serves a read inside the header's first read from those bytes (a
    dataset's chunk index often lies just after its header)."""

    def __init__(self, pread: Callable[[int, int], bytes]) -> None:
        self._pread = pread
        self._first: tuple[int, bytes] | None = None

    def __call__(self, size: int, offset: int) -> bytes:
        first = self._first
        if first is not None and first[0] <= offset and offset + size <= first[0] + len(
            first[1]
        ):
            return first[1][offset - first[0]:offset - first[0] + size]
        data = self._pread(size, offset)
        if first is None:
            self._first = (offset, data)
        return data


def single_chunk(pread: Callable[[int, int], bytes], address: int, file_size: int,
                 known: KnownMessages | None = None) -> SingleChunk | None:
    """The dataset whose object header is at ``address`` (``pread(size, offset)`` reads the
    file of ``file_size`` bytes), when it is one chunk, unfiltered, Fletcher-32 alone or Blosc
    as the module text says; None for anything else. ``known``: attribute messages known in
    advance (:func:`.header.attribute_messages`)."""
    cached = _Cached(pread)
    others: list[OtherMessage] = []
    attributes = attribute_messages(cached, address, file_size, others, known)
    if attributes is None:
        return None
    bodies: dict[int, tuple[int, bytes]] = {}
    for kind, flags, body in others:
        if kind not in _KNOWN_KINDS or kind in bodies:
            return None
        bodies[kind] = (flags, body)
    if _DATASPACE not in bodies or _DATATYPE not in bodies or _LAYOUT not in bodies:
        return None
    shape = dataspace_dims(bodies[_DATASPACE][1])
    datatype = bodies[_DATATYPE]
    if shape is None or len(datatype[1]) < 8:
        return None
    itemsize = int.from_bytes(datatype[1][4:8], "little")
    layout = chunked_layout(bodies[_LAYOUT][1], len(shape), itemsize)
    if layout is None or itemsize < 1:
        return None
    index, chunks = layout
    if not shape or not all(0 < d <= c for d, c in zip(shape, chunks)):
        return None  # no values, or more than one chunk
    size = math.prod(chunks) * itemsize
    sizes = (size, size)
    blosc = None
    fletcher32 = bodies.get(_PIPELINE) == _FLETCHER32_ALONE
    if fletcher32:
        sizes = (size + _FLETCHER32_SIZE, size + _FLETCHER32_SIZE)
    elif _PIPELINE in bodies:
        blosc = blosc_pipeline(bodies[_PIPELINE], itemsize, size)
        if blosc is None:
            return None
        sizes = (HEADER, frame_size_limit(size)) if not blosc else (
            HEADER + _FLETCHER32_SIZE, frame_size_limit(size) + _FLETCHER32_SIZE)
    found = only_chunk(cached, index, len(shape) + 1, sizes, file_size)
    if found is None:
        return None
    offset, stored = found
    return SingleChunk(shape, chunks, itemsize, datatype, offset, stored, attributes, blosc,
                       fletcher32)


def blosc_pipeline(message: tuple[int, bytes], itemsize: int, chunk_nbytes: int
                   ) -> bool | None:
    """Whether Fletcher-32 follows Blosc when the filter pipeline message (flags, body) is
    byte for byte what libhdf5 writes for lean_store's ``"weights"`` pipeline on a dataset of
    ``itemsize``-byte values in chunks of ``chunk_nbytes``: version 2 (flags 1: constant),
    Blosc (id 32001, no name, optional, :func:`blosc_parameters`), then Fletcher-32
    (mandatory, no values) or nothing. None for any other message."""
    flags, body = message
    blosc = struct.pack("<HHHH", BLOSC_FILTER, 0, 1, 7) + struct.pack(
        "<7I", *blosc_parameters(itemsize, chunk_nbytes))
    if flags != 1:
        return None
    if body == bytes((2, 1)) + blosc:
        return False
    if body == bytes((2, 2)) + blosc + struct.pack("<HHH", _FLETCHER32_FILTER, 0, 0):
        return True
    return None


_UNPACKERS: dict[tuple[str, int], Callable[..., tuple[int, ...]]] = {}


def _unpacker(code: str, count: int) -> Callable[..., tuple[int, ...]]:
    """``unpack_from`` of ``count`` little-endian values of ``code``, made once per count."""
    found = _UNPACKERS.get((code, count))
    if found is None:
        found = _UNPACKERS[(code, count)] = struct.Struct(f"<{count}{code}").unpack_from
    return found


def dataspace_dims(body: bytes) -> tuple[int, ...] | None:
    """The dimensions of a version 2 simple dataspace whose maximum (if given) is its size."""
    if len(body) < 4 or body[0] != 2 or body[3] != 1 or body[2] & ~0x01:
        return None
    rank = body[1]
    count = rank * (2 if body[2] & 0x01 else 1)
    if rank > _MAX_RANK or len(body) != 4 + 8 * count:
        return None
    values = _unpacker("Q", count)(body, 4)
    dims = tuple(values[:rank])
    if body[2] & 0x01 and values[rank:] != dims:
        return None
    return dims


def chunked_layout(body: bytes, rank: int, itemsize: int
                   ) -> tuple[int, tuple[int, ...]] | None:
    """(address of the v1 B-tree, chunk shape) of a version 3 chunked layout message of a
    dataset of ``rank`` whose last chunk dimension is the item size."""
    ndims = rank + 1
    if len(body) != 11 + 4 * ndims or body[0] != 3 or body[1] != 2 or body[2] != ndims:
        return None
    index = int.from_bytes(body[3:11], "little")
    dims = _unpacker("I", ndims)(body, 11)
    if dims[-1] != itemsize or 0 in dims:
        return None
    return index, tuple(dims[:-1])


def index_node_size(ndims: int) -> int:
    """The bytes :func:`only_chunk` reads of a one-chunk v1 B-tree leaf of ``ndims`` key
    dimensions: its head, the first key (size, filter mask, offsets) and the chunk's
    address."""
    return _BTREE_HEAD.size + _KEY_HEAD.size + 8 * ndims + 8


def only_chunk(pread: Callable[[int, int], bytes], index: int, ndims: int,
                sizes: tuple[int, int], file_size: int) -> tuple[int, int] | None:
    """(file position, stored bytes) of the one chunk a v1 B-tree at ``index`` holds: a leaf
    with one entry, no siblings, keyed at offset 0, no filter skipped (mask 0), of ``sizes``
    (least, most) bytes inside the file."""
    need = index_node_size(ndims)
    if index == _UNDEFINED or index + need > file_size:
        return None
    return leaf_chunk(pread(need, index), ndims, sizes, file_size)


def leaf_chunk(node: bytes, ndims: int, sizes: tuple[int, int], file_size: int
               ) -> tuple[int, int] | None:
    """:func:`only_chunk` of the leaf's bytes ``node`` (:func:`index_node_size` of them)."""
    at = _BTREE_HEAD.size + _KEY_HEAD.size  # the key's offsets, after its size and mask
    need = at + 8 * ndims + 8
    if len(node) != need or not node.startswith(_LEAF_HEAD):
        return None
    stored = int.from_bytes(node[_BTREE_HEAD.size:_BTREE_HEAD.size + 4], "little")
    # the filter mask and the chunk's offsets: every byte 0 (counted, not copied)
    if not sizes[0] <= stored <= sizes[1] or node.count(0, at - 4, need - 8) != 4 + 8 * ndims:
        return None
    offset = int.from_bytes(node[need - 8:need], "little")
    if offset + stored > file_size:
        return None
    return offset, stored
