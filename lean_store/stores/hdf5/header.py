"""A dataset's attribute messages read straight from its HDF5 object header (version 2).

A lean_store dataset keeps its dozen attributes compact, as messages in its object header
(docs/FORMAT.md 2.5). Comparing them with a manifest record through libhdf5 costs a dozen
``H5Aopen``/``H5Aread`` round trips; reading the header's bytes once (one ``pread`` per header
chunk) and comparing each attribute message byte for byte costs a few microseconds.

This module only finds the messages: :func:`attribute_messages` returns each attribute
message's name, the bytes that encode its name, datatype and dataspace (the *prefix*) and its
data bytes, or None for any header it does not fully understand (version 1 headers, shared
messages, dense attribute storage: an attribute info message pointing to a fractal heap, sizes
past the bounds, anything malformed). The caller (:mod:`.header_attrs`) accepts a dataset's
attributes only when every message is exactly one that libhdf5 itself already confirmed as
the attribute written, and otherwise asks libhdf5.

The offsets used are libhdf5's own addresses: the caller reads through HDF5's descriptor of a
file whose superblock (version 2 or 3, checked by :func:`plain_superblock`) puts its base
address at 0, so they are file positions.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

MAX_HEADER_CHUNK = 1 << 16  # bytes of one header chunk read (lean_store's: under 1 KiB)
MAX_HEADER_CHUNKS = 8  # chunks followed (lean_store's datasets have 1 or 2)
FIRST_READ = 1024  # bytes read first: all of chunk 0 of a lean_store dataset
_OHDR, _OCHK = b"OHDR", b"OCHK"
_NIL, _ATTRIBUTE, _CONTINUATION, _ATTRIBUTE_INFO = 0x00, 0x0C, 0x10, 0x15
_SHARED = 0x02  # message flag: the body is a reference to a shared message
_SUPERBLOCK = struct.Struct("<8sBBBBQQQQ")
_MESSAGE = struct.Struct("<BHB")  # type, size of the body, flags
_UNDEFINED = b"\xff" * 8  # an undefined address
_CONT = struct.Struct("<QQ")
_ATTR_V3 = struct.Struct("<BBHHHB")


AttributeMessage = tuple[int, bytes, bytes]
"""One attribute message: its header flags, the bytes encoding version, flags, name, datatype
and dataspace (its *prefix*), and the bytes after them (its data, possibly followed by a few
bytes of padding the message was allocated with). A plain tuple: a header holds a dozen."""


def plain_superblock(head: bytes) -> bool:
    """True for a superblock of version 2 or 3 with 8-byte offsets and lengths and base
    address 0 (``head``: the file's first 48 bytes): object header addresses are then file
    positions."""
    if len(head) < _SUPERBLOCK.size:
        return False
    sig, version, offsets, lengths, _flags, base, _ext, _eof, _root = _SUPERBLOCK.unpack_from(
        head)
    return sig == b"\x89HDF\r\n\x1a\n" and version in (2, 3) and (offsets, lengths) == (
        8, 8) and base == 0


OtherMessage = tuple[int, int, bytes]
"""A message that is not an attribute, its attribute info, a continuation or a NIL: its
type, its header flags and its body."""

KnownMessages = dict[bytes, tuple[bytes, AttributeMessage]]
"""The whole bytes of an attribute message (its 4-byte message header, then its body) ->
its name and :data:`AttributeMessage`, for messages whose bytes are known in advance: a
message of exactly those bytes is taken as that without being parsed (what parsing it gives,
as these bytes were once parsed to make the entry). See :func:`attribute_messages`."""


def attribute_message_head(flags: int, prefix: bytes, data_size: int) -> bytes | None:
    """The bytes before the data of an attribute message of ``flags`` and ``prefix`` holding
    ``data_size`` bytes of data (no padding) in a header that does not store creation order
    (a key of :data:`KnownMessages` is these, then the data); None past a message's size."""
    size = len(prefix) + data_size
    return _MESSAGE.pack(_ATTRIBUTE, size, flags) + prefix if size <= 0xFFFF else None


def first_chunk(pread: Callable[[int, int], bytes], address: int, file_size: int
                ) -> tuple[bytes, int, int, int, bytes] | None:
    """Chunk 0 of the version 2 object header at ``address`` (``pread(size, offset)`` reads
    the file of ``file_size`` bytes): its bytes (checksum included), where its messages start
    and end, the bytes of creation order each message carries, and the bytes read after it
    (up to :data:`FIRST_READ` in all); None for any other header."""
    if not 0 <= address < file_size:
        return None
    head = pread(min(FIRST_READ, file_size - address), address)
    if len(head) < 8 or head[:4] != _OHDR or head[4] != 2 or head[5] & 0xC0:
        return None
    flags = head[5]
    pos = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 0x03)
    if pos + width > len(head):
        return None
    size = int.from_bytes(head[pos:pos + width], "little")
    pos += width
    total = pos + size + 4  # then its checksum
    if total > MAX_HEADER_CHUNK or address + total > file_size:
        return None
    more = head[total:]
    head = head[:total] if total <= len(head) else pread(total, address)  # longer: read it
    if len(head) != total:
        return None
    return head, pos, pos + size, 2 if flags & 0x04 else 0, more


def attribute_messages(pread: Callable[[int, int], bytes], address: int, file_size: int,
                       others: list[OtherMessage] | None = None,
                       known: KnownMessages | None = None
                       ) -> dict[bytes, AttributeMessage] | None:
    """name -> message of every attribute message in the version 2 object header at
    ``address`` (``pread(size, offset)`` reads the file); None where the header is not of the
    kind this module reads (see the module text): the caller then asks libhdf5. ``others``,
    when given, receives every other message of the header (:data:`OtherMessage`). A message
    whose whole bytes are a key of ``known`` is taken from there instead of being parsed (one
    slice and one lookup: the manifest says what each message holds); any other is parsed."""
    first = first_chunk(pread, address, file_size)
    if first is None:
        return None
    head, pos, end, order, _ = first
    found: dict[bytes, AttributeMessage] = {}
    chunks = [(head, pos, end)]
    seen = 1
    while chunks:
        block, start, end = chunks.pop()
        more = _messages(block, start, end, order, found, others,
                         None if order else known)
        if more is None:
            return None
        for offset, length in more:
            seen += 1
            if seen > MAX_HEADER_CHUNKS or length < 8 or length > MAX_HEADER_CHUNK or (
                offset < 0 or offset + length > file_size
            ):
                return None
            block = pread(length, offset)
            if len(block) != length or block[:4] != _OCHK:
                return None
            chunks.append((block, 4, length - 4))
    return found


def _messages(block: bytes, pos: int, end: int, order: int,
              found: dict[bytes, AttributeMessage], others: list[OtherMessage] | None = None,
              known: KnownMessages | None = None) -> list[tuple[int, int]] | None:
    """Add the attribute messages of one header chunk to ``found``; the continuation
    chunks it points to, or None for anything this module does not read. An attribute
    message must be of version 3 with no shared parts: version, flags, the sizes of its
    name (with its NUL), datatype and dataspace, the name's encoding, then those, then its
    data. One whose whole bytes are a key of ``known`` (no creation order: ``order`` 0) is
    that entry's, unparsed."""
    more: list[tuple[int, int]] = []
    step = 4 + order
    unpack_message, unpack_attribute = _MESSAGE.unpack_from, _ATTR_V3.unpack_from
    lookup = None if known is None else known.get
    while end - pos >= step:  # fewer bytes left: the gap before the checksum
        kind, size, mflags = unpack_message(block, pos)
        start = pos
        body_at = pos + step
        pos = body_at + size
        if pos > end:
            return None
        if kind == _NIL:
            continue
        if lookup is not None and kind == _ATTRIBUTE:
            hit = lookup(block[start:pos])
            if hit is not None:  # exactly a message parsed before, as the manifest says
                if hit[0] in found:
                    return None
                found[hit[0]] = hit[1]
                continue
        if mflags & _SHARED:
            return None  # a reference to a shared message: not read here
        if kind == _ATTRIBUTE:
            if size < _ATTR_V3.size:
                return None
            version, aflags, name_size, type_size, space_size, _ = unpack_attribute(
                block, body_at)
            name_end = body_at + _ATTR_V3.size + name_size
            data_at = name_end + type_size + space_size
            if version != 3 or aflags != 0 or name_size < 1 or data_at > pos or (
                block[name_end - 1] != 0
            ):
                return None
            name = block[body_at + _ATTR_V3.size:name_end - 1]
            if name in found:
                return None
            found[name] = (mflags, block[body_at:data_at], block[data_at:pos])
        elif kind == _ATTRIBUTE_INFO:
            if not compact_only(block[body_at:pos]):
                return None  # dense attribute storage: not read here
        elif kind == _CONTINUATION:
            if size < _CONT.size:
                return None
            more.append(_CONT.unpack_from(block, body_at))
        elif others is not None:
            others.append((kind, mflags, block[body_at:pos]))
    return more


def compact_only(body: bytes) -> bool:
    """An attribute info message (version 0) that points to no dense storage: the object's
    attributes are then exactly its attribute messages."""
    at = 4 if len(body) > 1 and body[1] & 0x01 else 2  # after the max. creation index
    return len(body) >= at + 8 and body[0] == 0 and body[at:at + 8] == _UNDEFINED
