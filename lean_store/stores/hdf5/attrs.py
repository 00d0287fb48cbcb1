"""Dataset attributes through h5py's low-level API: encoded once, written, read with checks,
and compared with what the writer wrote.

Every value is encoded the way h5py's ``attrs[key] = value`` stores it (see
:func:`to_hdf5_attr`): the file type (logical), the memory type and the dataspace are built
once per kind of value (an int, a string of n bytes, n int64 values, ...) and reused, so that
a dataset's dozen attributes cost libhdf5's time and little of Python's.

:func:`attrs_match` checks a dataset's attributes against the values its manifest record
holds without decoding them: each stored attribute must have exactly the file type, shape and
bytes that writing the recorded value produces. Anything else (a missing, extra, retyped,
reshaped or changed attribute) is "no match", and the caller reads and compares the decoded
values to name the difference.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import h5py
import numpy as np
from h5py import h5a, h5s, h5t

from ...errors import IntegrityError, UnsafeFileError
from ...hardening import MAX_ATTR_BYTES, MAX_ATTRS
from .checks import from_hdf5_attr
from .crc_table import CHUNK_CRC_ATTR
from .libhdf5 import library

_LIMITS = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)


def to_hdf5_attr(value: Any) -> Any:
    """Attributes: numbers as themselves, shapes as int64 arrays, strings (and JSON text for
    anything else) as *fixed-length* UTF-8 strings.

    Fixed-length strings keep every attribute inside its object header. Variable-length strings
    live in HDF5's global heap, and libhdf5 can loop forever on a corrupted global heap; with no
    global heap in the file, that hang cannot be reached through a lean_store file.
    """
    if isinstance(value, bool):
        return np.int8(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, tuple):
        return np.asarray(value, dtype=np.int64).reshape(-1)
    if isinstance(value, np.ndarray):
        return value
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    data = text.encode("utf-8")
    return np.array(data, dtype=h5py.string_dtype("utf-8", max(1, len(data))))


def joined_utf8_attr(pieces: list[str]) -> np.ndarray:
    """What :func:`to_hdf5_attr` makes of ``"".join(pieces)`` (a fixed-length UTF-8 string),
    built with one copy of the text: each piece is copied into place and dropped from
    ``pieces`` (the caller's list is emptied), so a large manifest is not held as a string,
    its bytes and the array at once."""
    total = sum(len(piece) if piece.isascii() else len(piece.encode("utf-8"))
                for piece in pieces)
    out = np.zeros((), dtype=h5py.string_dtype("utf-8", max(1, total)))
    buf = out.reshape(1).view(np.uint8)
    at = 0
    for i, piece in enumerate(pieces):
        raw = piece.encode("utf-8")
        buf[at:at + len(raw)] = np.frombuffer(raw, np.uint8)
        at += len(raw)
        pieces[i] = ""
    pieces.clear()
    return out


class EncodedAttr(NamedTuple):
    """One attribute as written: its name, data (in the memory type) and those bytes, file
    type, memory type and dataspace. ``raw`` is what reading it back with ``mtype`` gives."""

    name: bytes
    data: np.ndarray
    raw: bytes
    ftype: Any
    mtype: Any
    space: Any


_TYPES: dict[Any, tuple[Any, Any]] = {}  # kind of value -> (file type, memory type)
_SPACES: dict[tuple[int, ...], Any] = {}  # dataspace of each shape (HDF5 copies what it uses)
_ENCODED: dict[tuple[str, type, Any], EncodedAttr] = {}  # see encode_attr
MAX_ENCODED = 4096  # remembered attributes (then forgotten all at once)
MAX_REMEMBERED_LEN = 256  # longer strings and tuples (JSON documents) are encoded every time


def _types(key: Any, dtype: np.dtype) -> tuple[Any, Any]:
    types = _TYPES.get(key)
    if types is None:  # file type (logical) and memory type (bit for bit), as h5py makes them
        types = _TYPES[key] = (h5t.py_create(dtype, logical=True), h5t.py_create(dtype))
    return types


def _space(shape: tuple[int, ...]) -> Any:
    space = _SPACES.get(shape)
    if space is None:
        space = _SPACES[shape] = (h5s.create(h5s.SCALAR) if shape == ()
                                  else h5s.create_simple(shape))
    return space


def encode_attr(key: str, value: Any) -> EncodedAttr:
    """``value`` as :func:`to_hdf5_attr` and h5py's ``attrs[key] = value`` would store it.
    Ints, short strings and short tuples are remembered (most repeat from dataset to dataset:
    a format's parameters, a shape): the encoded attribute is immutable, never written to."""
    kind = type(value)
    if kind is int or (kind is str or kind is tuple) and len(value) <= MAX_REMEMBERED_LEN:
        cache_key = (key, kind, value)
        found = _ENCODED.get(cache_key)
        if found is None:
            if len(_ENCODED) >= MAX_ENCODED:
                _ENCODED.clear()
            found = _ENCODED[cache_key] = _encode(key, value)
        return found
    return _encode(key, value)


def _encode(key: str, value: Any) -> EncodedAttr:
    name = key.encode("utf-8")
    if type(value) is str:  # without h5py's string dtype (built per call, with metadata)
        raw = value.encode("utf-8")
        size = max(1, len(raw))
        ftype, mtype = _TYPES.get(("str", size)) or _types(
            ("str", size), h5py.string_dtype("utf-8", size))
        data = np.array(raw, dtype=f"S{size}")
    else:
        data = np.asarray(to_hdf5_attr(value))
        dtype = data.dtype
        ftype, mtype = _types((dtype.str, h5py.check_string_dtype(dtype)), dtype)
    data.flags.writeable = False
    return EncodedAttr(name, data, data.tobytes(), ftype, mtype, _space(data.shape))


def write_attrs(oid: Any, attrs: dict[str, Any], *, replace: bool = False) -> None:
    """Write ``attrs`` (encoded as :func:`encode_attr` encodes them) on the HDF5 object
    ``oid``: the same file types and dataspaces as ``h5py``'s ``attrs[key] = value``, without
    its per-attribute overhead (straight into libhdf5 where :mod:`.libhdf5` can, else h5py's
    low-level API). ``replace``: delete an attribute of the same name first (objects created by
    the writer have none)."""
    lib = library()
    if replace or lib is None:
        for key, value in attrs.items():
            write_encoded(oid, encode_attr(key, value), replace=replace)
        return
    items = list(attrs.items())
    rows = [attr_row(key, value) for key, value in items]
    for key, value in items[lib.write_attrs(oid.id, rows):]:  # the rest, if one failed
        write_encoded(oid, encode_attr(key, value))


AttrRow = tuple[bytes, int, int, int, bytes]
"""An attribute ready for ``H5Acreate2`` + ``H5Awrite``: name, file type id, dataspace id,
memory type id, bytes (the ids are those of :func:`encode_attr`'s kept types and spaces)."""

_Template = tuple[bytes, int, int, int]  # an AttrRow without its bytes
_INT_TEMPLATES: dict[str, _Template] = {}  # key -> template of an int64 under that key
_STR_TEMPLATES: dict[tuple[str, int], _Template] = {}  # (key, bytes) -> template of a string
_ARRAY_TEMPLATES: dict[tuple[str, str, tuple[int, ...]], _Template] = {}  # (key, dtype, shape)
_TUPLE_ROWS: dict[tuple[str, tuple[Any, ...]], AttrRow] = {}  # (key, a short tuple) -> row
_INT64 = np.dtype("<i8")


def attr_row(key: str, value: Any) -> AttrRow:
    """``key``, ``value`` as :func:`encode_attr` encodes them, as an :data:`AttrRow`. Ints,
    strings and 1-D numeric arrays (the values unique to a dataset: index, name, CRCs, CRC
    table; and a format's parameters) take the types and dataspace of the first value of their
    kind under that key, and only their bytes are made here (``int.to_bytes``, ``str.encode``,
    ``ndarray.tobytes``: the bytes numpy gives, without an array); short tuples (shapes) are
    remembered whole; everything else goes through :func:`encode_attr`."""
    kind = type(value)
    if kind is str:
        raw = value.encode("utf-8") or b"\0"  # an empty string is stored as one NUL byte
        template = _STR_TEMPLATES.get((key, len(raw)))
        if template is None:
            template = _remember(_STR_TEMPLATES, (key, len(raw)), _row(_encode(key, value))[:4])
        return (*template, raw)
    if kind is int and _LIMITS[0] <= value <= _LIMITS[1]:
        template = _INT_TEMPLATES.get(key)
        if template is None:
            attr = _encode(key, value)
            if attr.data.dtype != _INT64:  # not numpy's int64: no short cut
                return _row(attr)
            template = _remember(_INT_TEMPLATES, key, _row(attr)[:4])
        return (*template, value.to_bytes(8, "little", signed=True))
    if kind is np.ndarray and value.ndim == 1 and value.dtype.kind in "iuf" and (
        value.dtype.metadata is None
    ):
        tkey = (key, value.dtype.str, value.shape)
        template = _ARRAY_TEMPLATES.get(tkey)
        if template is None:  # (a copy: encoding makes its array read-only)
            template = _remember(_ARRAY_TEMPLATES, tkey, _row(_encode(key, value.copy()))[:4])
        return (*template, value.tobytes())
    if kind is tuple and len(value) <= MAX_REMEMBERED_LEN:
        row = _TUPLE_ROWS.get((key, value))
        if row is None:
            row = _remember(_TUPLE_ROWS, (key, value), _row(encode_attr(key, value)))
        return row
    return _row(encode_attr(key, value))


def _remember(memo: dict[Any, Any], key: Any, value: Any) -> Any:
    """``memo[key] = value``, forgetting everything first when ``memo`` is full (the types
    and dataspaces the values name are kept for good: their ids stay valid)."""
    if len(memo) >= MAX_ENCODED:
        memo.clear()
    memo[key] = value
    return value


def _row(attr: EncodedAttr) -> AttrRow:
    return attr.name, attr.ftype.id, attr.space.id, attr.mtype.id, attr.raw


def write_encoded(oid: Any, attr: EncodedAttr, *, replace: bool = False) -> None:
    """One attribute through h5py's low-level API."""
    if replace and h5a.exists(oid, attr.name):
        h5a.delete(oid, attr.name)
    aid = h5a.create(oid, attr.name, attr.ftype, attr.space)
    try:
        aid.write(np.array(attr.data), mtype=attr.mtype)
    finally:
        aid.close()


def attrs_match(oid: Any, expected: list[EncodedAttr]) -> bool:
    """True when the HDF5 object ``oid`` holds exactly the attributes of ``expected`` and
    each has the file type (``H5Tequal``), shape and bytes writing it produced; False
    otherwise, or when anything cannot be read (the caller then reads and names the
    difference). Nothing is decoded: each value is read into a buffer of the expected size."""
    try:
        if h5a.get_num_attrs(oid) != len(expected):
            return False
        lib = library()
        if lib is not None:
            return lib.attrs_equal(oid.id, expected)
        for attr in expected:
            aid = h5a.open(oid, attr.name)  # KeyError when missing
            try:
                if aid.shape != attr.data.shape or aid.get_type() != attr.ftype:
                    return False
                got = np.empty_like(attr.data)
                aid.read(got, mtype=attr.mtype)
            finally:
                aid.close()
            if got.tobytes() != attr.raw:
                return False
    except (OSError, RuntimeError, ValueError, TypeError, KeyError):
        return False
    return True


def read_attrs(oid: Any, where: str, names: list[str] | None = None) -> dict[str, Any]:
    """The attributes of the HDF5 object ``oid`` (a low-level id) with the checks of
    :func:`.checks.read_hdf5_attrs` (count, shape, type and size checked before a
    value is read; variable-length strings refused), through h5py's low-level API: several
    times cheaper. ``names``: read these (opened by name, cheaper than by index; a missing one
    is an IntegrityError) and only these when the object holds exactly that many."""
    try:
        count = h5a.get_num_attrs(oid)
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise IntegrityError(f"{where}: unreadable attribute list ({exc})") from None
    if count > MAX_ATTRS:
        raise UnsafeFileError(f"{where}: {count} attributes (limit {MAX_ATTRS})")
    if names is not None and count != len(names):
        raise IntegrityError(f"{where}: {count} attributes where {len(names)} were written")
    out: dict[str, Any] = {}
    for i in range(count):
        name = f"#{i}" if names is None else names[i]
        try:
            if names is None:
                aid = h5a.open(oid, index=i)
                name = aid.name.decode("utf-8")
            else:
                aid = h5a.open(oid, name.encode("utf-8"))
            shape, ftype = aid.shape, aid.get_type()
            dtype, mtype = _attr_types(ftype)
        except (OSError, RuntimeError, ValueError, TypeError, KeyError, UnicodeError) as exc:
            raise IntegrityError(f"{where}: unreadable attribute {name!r} ({exc})") from None
        if shape is None or len(shape) > 1:
            raise IntegrityError(f"{where}: attribute {name!r} has an unsupported shape {shape}")
        if dtype is None:
            if ftype.get_class() == h5t.STRING:  # the only other string kind: variable length
                raise UnsafeFileError(
                    f"{where}: attribute {name!r} is a variable-length string; lean_store files "
                    "hold fixed-length strings only"
                )
            raise IntegrityError(f"{where}: attribute {name!r} has an unsupported type")
        n = math.prod(shape)
        if n * max(1, dtype.itemsize) > MAX_ATTR_BYTES or (dtype.kind == "S" and n > 1):
            raise UnsafeFileError(f"{where}: attribute {name!r} claims {n} values; too large")
        try:
            data = np.zeros(shape, dtype=dtype)
            aid.read(data, mtype=mtype)
            value = data if name == CHUNK_CRC_ATTR and data.ndim == 1 else from_hdf5_attr(
                data[()] if data.ndim == 0 else data
            )
        except (OSError, RuntimeError, ValueError, TypeError, KeyError, UnicodeError) as exc:
            raise IntegrityError(f"{where}: unreadable attribute {name!r} ({exc})") from None
        out[name] = value
    return out


_MEMORY_TYPES: dict[str, Any] = {}


def _attr_types(ftype: Any) -> tuple[np.dtype | None, Any]:
    """(numpy dtype, HDF5 memory type) to read an attribute of file type ``ftype``: native
    integers and floats, fixed-length strings as their bytes; (None, None) for anything else.
    Built from the type's class and size (``AttrID.dtype`` costs ~10x more)."""
    cls, size = ftype.get_class(), ftype.get_size()
    if cls == h5t.STRING:
        if ftype.is_variable_str():
            return None, None
        return np.dtype(f"S{size}"), ftype
    if cls == h5t.INTEGER and size in (1, 2, 4, 8):
        code = f"{'i' if ftype.get_sign() == h5t.SGN_2 else 'u'}{size}"
    elif cls == h5t.FLOAT and size in (2, 4, 8):
        code = f"f{size}"
    else:
        return None, None
    mtype = _MEMORY_TYPES.get(code)
    if mtype is None:
        mtype = _MEMORY_TYPES[code] = h5t.py_create(np.dtype(code))
    return np.dtype(code), mtype
