"""A dataset's attributes compared with its manifest record from its object header's bytes.

Through libhdf5 (:func:`.attrs.attrs_match`) a dataset's dozen attributes cost a dozen
``H5Aopen`` + ``H5Aread`` round trips. :class:`HeaderAttributes` instead reads the dataset's
object header with one ``pread`` per header chunk (:mod:`.header`) and compares each attribute
message with the bytes that libhdf5 already confirmed, once, as encoding exactly that
attribute (:func:`learn_header`, after :func:`.attrs.attrs_match` passed on some dataset).
Anything else (a kind of attribute not yet confirmed, another encoding, a header
:mod:`.header` does not read, a changed value) is no match, and the caller asks libhdf5.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Hashable
from typing import Any

import numpy as np
from h5py import h5a, h5d, h5o

from .attrs import EncodedAttr, encode_attr
from .crc_table import CHUNK_CRC_ATTR
from .header import (
    AttributeMessage,
    KnownMessages,
    attribute_message_head,
    attribute_messages,
    plain_superblock,
)
from .header_layout import SingleChunk, single_chunk
from .libhdf5 import library


class HeaderAttributes:
    """Reads the attribute messages of a file's datasets from their object headers through
    the file's descriptor ``fd`` (HDF5's own) of ``file_size`` bytes."""

    def __init__(self, fd: int | None, file_size: int) -> None:
        self._fd = fd
        self._file_size = file_size
        self._readable: bool | None = None  # decided at the first dataset
        self._plain: bool | None = None  # addresses are file positions (see single_chunk)

    def attribute_messages(self, dsid: h5d.DatasetID, count: int
                           ) -> dict[bytes, AttributeMessage] | None:
        """The attribute messages in ``dsid``'s object header; None where headers cannot be
        read (no descriptor or libhdf5 binding, a superblock whose addresses are not file
        positions), the header is not one :mod:`.header` reads, or libhdf5 counts other than
        ``count`` attributes."""
        if self._readable is None:
            self._readable = self._headers_readable(dsid)
        lib = library()
        fd = self._fd
        if not self._readable or lib is None or fd is None:
            return None
        found = lib.object_header(dsid.id)
        if found is None or found[1] != count:
            return None
        return attribute_messages(lambda n, at: os.pread(fd, n, at), found[0],
                                  self._file_size)

    def single_chunk(self, address: int, known: KnownMessages | None = None
                     ) -> SingleChunk | None:
        """The one-chunk dataset whose object header is at ``address`` (the root group's hard
        link to it says so), read from the file's bytes (:mod:`.header_layout`; ``known``:
        see :func:`known_messages`); None where it is not one or headers cannot be read
        here."""
        fd = self._fd
        if fd is None or not self.addresses_are_positions():
            return None
        try:
            return single_chunk(lambda n, at: os.pread(fd, n, at), address, self._file_size,
                                known)
        except OSError:
            return None

    def addresses_are_positions(self) -> bool:
        """The superblock puts its base at 0: libhdf5's addresses are file positions."""
        if self._plain is None:
            try:
                self._plain = self._fd is not None and plain_superblock(os.pread(self._fd, 48, 0))
            except OSError:
                self._plain = False
        return self._plain

    def _headers_readable(self, dsid: h5d.DatasetID) -> bool:
        """The superblock puts its base at 0 (addresses are file positions), and the libhdf5
        binding reports the header address and attribute count h5py does for ``dsid``."""
        lib = library()
        if self._fd is None or lib is None:
            return False
        try:
            if not plain_superblock(os.pread(self._fd, 48, 0)):
                return False
            return lib.object_header(dsid.id) == (h5o.get_info(dsid).addr,
                                                  h5a.get_num_attrs(dsid))
        except (OSError, RuntimeError, ValueError, TypeError, AttributeError):
            return False


ExpectedAttr = tuple[bytes, Hashable, bytes]
"""One attribute as the writer wrote it, made from a manifest record without numpy or
libhdf5 (:func:`expected_attr`): its name, its *kind* (a key that fixes the file type and
dataspace :func:`.attrs.encode_attr` gives it: the name, the value's type and its size) and
its data bytes, exactly those :func:`.attrs.encode_attr` makes."""

_CONFIRMED: dict[Hashable, set[tuple[int, bytes]]] = {}
"""kind of attribute (:data:`ExpectedAttr`) -> the (message flags, message prefix) pairs
libhdf5 confirmed as encoding exactly that attribute: see :func:`header_match`. Prefixes hold
no file address (shared messages are never read), so they hold in any file."""
MAX_CONFIRMED = 4096  # kinds of attribute remembered (then forgotten all at once)
MAX_PADDING = 8  # bytes a message may hold past its data (HDF5 may allocate a few more)
_INT64 = (-(1 << 63), 1 << 63)
_NAMES: dict[str, tuple[bytes, tuple[bytes, str]]] = {}  # key -> (its bytes, its int64 kind)
_ENCODED_KINDS: dict[int, Any] = {}  # id of a file type -> that type (kept: ids stay unique)
_PACK_INT64: dict[int, struct.Struct] = {}  # n -> "<nq"


def _name(key: str) -> tuple[bytes, tuple[bytes, str]]:
    found = _NAMES.get(key)
    if found is None:
        if len(_NAMES) >= MAX_CONFIRMED:
            _NAMES.clear()
        name = key.encode("utf-8")
        found = _NAMES[key] = (name, (name, "<i8"))
    return found


def expected_attr(key: str, value: Any) -> ExpectedAttr:
    """``key``, ``value`` (as a manifest record holds it) as :data:`ExpectedAttr`: the bytes
    :func:`.attrs.encode_attr` writes, made directly for what a record holds for every
    tensor (an int, a string, a tuple of ints, the uint32 ``chunk_crc32c`` table), through
    :func:`.attrs.encode_attr` for anything else. Raises what that raises (OverflowError,
    ValueError, TypeError) for a value that cannot be written: the caller says which tensor."""
    kind = type(value)
    if kind is int:
        if _INT64[0] <= value < _INT64[1]:
            name, int_kind = _name(key)
            return name, int_kind, value.to_bytes(8, "little", signed=True)
    elif kind is str:
        raw = value.encode("utf-8") or b"\0"  # an empty string is stored as one NUL byte
        name = _name(key)[0]
        return name, (name, "S", len(raw)), raw
    elif kind is tuple and value and all(type(v) is int for v in value):
        n = len(value)
        pack = _PACK_INT64.get(n)
        if pack is None:
            pack = _PACK_INT64.setdefault(n, struct.Struct(f"<{n}q"))
        try:
            raw = pack.pack(*value)
        except struct.error:  # outside int64: encode_attr raises its OverflowError
            pass
        else:
            name = _name(key)[0]
            return name, (name, "<i8", n), raw
    elif kind is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu" and (
        value.dtype.metadata is None
    ):
        name = _name(key)[0]
        return name, (name, value.dtype.str, value.shape), value.tobytes()
    attr = encode_attr(key, value)
    _ENCODED_KINDS.setdefault(id(attr.ftype), attr.ftype)  # the id stays this type's
    return attr.name, (attr.name, id(attr.ftype), attr.data.shape), attr.raw


_PER_TENSOR = frozenset({"index", "name", "crc32c"})
"""Keys whose value differs from tensor to tensor (:func:`lean_store.metadata.tensor_attrs`,
and the digest): not remembered by :func:`expected_attrs`."""
_REMEMBERED: dict[tuple[str, Any], ExpectedAttr] = {}  # (key, str or int value) -> its attribute


def expected_attrs(attrs: dict[str, Any], table: np.ndarray) -> list[ExpectedAttr]:
    """:func:`expected_attr` of every item of ``attrs``, then of the ``chunk_crc32c``
    ``table``, in that order. A string or int under a key other than the per-tensor ones (a
    format's parameters: the same for every tensor of the format) is made once and
    remembered. Raises what :func:`expected_attr` raises."""
    out = []
    remembered = _REMEMBERED.get
    for key, value in attrs.items():
        kind = type(value)
        if (kind is str or kind is int) and key not in _PER_TENSOR:
            found = remembered((key, value))
            if found is None:
                if len(_REMEMBERED) >= MAX_CONFIRMED:
                    _REMEMBERED.clear()
                found = _REMEMBERED[(key, value)] = expected_attr(key, value)
            out.append(found)
        else:
            out.append(expected_attr(key, value))
    out.append(expected_attr(CHUNK_CRC_ATTR, table))
    return out


def header_match(messages: dict[bytes, AttributeMessage] | None,
                 expected: list[ExpectedAttr] | None) -> bool:
    """True when the attribute messages read from an object header (:mod:`.header`) are
    exactly ``expected``: one message per attribute, no other, each with message flags, name,
    datatype and dataspace encoded by bytes that libhdf5 already confirmed once as that kind
    of attribute (:func:`learn_header`), followed by exactly the bytes written. False
    otherwise: the caller asks libhdf5 (:func:`attrs_match`)."""
    if messages is None or expected is None or len(messages) != len(expected):
        return False
    get, confirmed = messages.get, _CONFIRMED.get
    for name, kind, raw in expected:
        message = get(name)
        if message is None:
            return False
        known = confirmed(kind)
        if known is None or (message[0], message[1]) not in known:
            return False
        data = message[2]
        if not data.startswith(raw) or len(data) - len(raw) >= MAX_PADDING:
            return False
    return True


_HEADS: dict[tuple[Hashable, int], list[tuple[bytes, int, bytes]]] = {}
"""(kind of attribute, bytes of its data) -> (the message's bytes before its data, message
flags, prefix) for each confirmed encoding of that kind (:data:`_CONFIRMED`): see
:func:`known_messages`. Forgotten whenever :data:`_CONFIRMED` changes."""


def known_messages(expected: list[ExpectedAttr]) -> KnownMessages:
    """The whole bytes of each attribute message ``expected`` may be in a header (one per
    encoding libhdf5 confirmed for its kind, with exactly its data bytes, no padding) -> its
    name and message: :func:`.header.attribute_messages` then takes such a message without
    parsing it. Attributes of a kind not yet confirmed are left out (their messages are
    parsed, and :func:`header_match` says no to them)."""
    out: KnownMessages = {}
    heads_of = _HEADS.get
    for name, kind, raw in expected:
        heads = heads_of((kind, len(raw)))
        if heads is None:
            confirmed = _CONFIRMED.get(kind)
            if not confirmed:
                continue
            heads = []
            for flags, prefix in tuple(confirmed):  # a copy: a load in another thread may add
                head = attribute_message_head(flags, prefix, len(raw))
                if head is not None:
                    heads.append((head, flags, prefix))
            if len(_HEADS) >= MAX_CONFIRMED:
                _HEADS.clear()
            _HEADS[(kind, len(raw))] = heads
        for head, flags, prefix in heads:
            out[head + raw] = (name, (flags, prefix, raw))
    return out


def learn_header(messages: dict[bytes, AttributeMessage] | None,
                 expected: list[ExpectedAttr] | None, encoded: list[EncodedAttr]) -> None:
    """Remember how the header of an object encodes each attribute of ``expected``, after
    libhdf5 confirmed (:func:`attrs_match`) that the object holds exactly the attributes
    ``encoded`` (the same attributes, in the same order): a message with that name whose data
    bytes are the ones written had its prefix decoded by libhdf5 as exactly that name, file
    type and shape."""
    if messages is None or expected is None or len(messages) != len(expected) or (
        len(encoded) != len(expected)
    ):
        return
    if len(_CONFIRMED) >= MAX_CONFIRMED:
        _CONFIRMED.clear()
        _HEADS.clear()
    for (name, kind, raw), attr in zip(expected, encoded):
        message = messages.get(name)
        data = None if message is None else message[2]
        if data is None or attr.name != name or attr.raw != raw or not data.startswith(raw) or (
            len(data) - len(raw) >= MAX_PADDING
        ):
            continue
        assert message is not None
        known = _CONFIRMED.get(kind)
        if known is None:
            known = _CONFIRMED[kind] = set()
        if len(known) < 8 and (message[0], message[1]) not in known:
            known.add((message[0], message[1]))
            _HEADS.clear()  # made again from _CONFIRMED as needed
