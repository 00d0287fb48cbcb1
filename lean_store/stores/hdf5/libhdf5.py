"""Direct calls into the libhdf5 that h5py loaded, for the per-attribute hot paths only.

A dataset carries a dozen attributes; through h5py's low-level API each costs several Python
objects (an ``AttrID``, a ``TypeID``, a ``SpaceID``, each registered in h5py's id registry)
and about three times libhdf5's own time. Here, writing one is ``H5Acreate2`` +
``H5Awrite`` + ``H5Aclose``, and comparing one with what was written is ``H5Aopen`` +
``H5Tequal`` on its type + its dataspace's rank and size + ``H5Aread`` of its bytes.

This is the one module of lean_store that goes past h5py's public API. It is used only when:

- the library is the very one h5py uses (found among the loaded libraries, its version equal
  to the one h5py reports, and an id h5py just created readable through it), so ids pass
  between the two freely;
- h5py's global lock (``phil``) is found: libhdf5 as h5py ships it is not thread-safe, h5py
  serialises every call with that lock, and every call here holds it too (``PyDLL``: the GIL
  is also kept, as h5py keeps it).

Otherwise :func:`library` is None and the callers use h5py's low-level API (the same file
content, and the same checks). ``LEAN_STORE_HDF5_CTYPES=0`` turns it off.

The same lock also guards lean_store's direct-chunk calls through h5py (:func:`chunk_lock`):
h5py before 3.16 runs ``read_direct_chunk`` and ``write_direct_chunk`` without it (h5py pull
request 2764), so a save or load raced other threads' HDF5 calls (errors such as "no VOL object
wrap context", HDF5 metadata cache corruption, crashes).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

_MAPS = "/proc/self/maps"
_LIBNAME = re.compile(r"/libhdf5(?:-[0-9a-f]+)?\.so[0-9.]*$")  # not libhdf5_hl
_hid = ctypes.c_int64  # hid_t since HDF5 1.10
_int = ctypes.c_int
H5P_DEFAULT = 0
# H5O_info2_t (HDF5 1.12+): unsigned long fileno; H5O_token_t token (16 bytes); H5O_type_t
# type; unsigned rc; time_t atime, mtime, ctime, btime; hsize_t num_attrs
_INFO_TOKEN, _INFO_NUM_ATTRS_AT, _INFO_BYTES = 8, 64, 256  # (buffer larger than the struct)
_INFO_BASIC, _INFO_NUM_ATTRS = 0x0001, 0x0004


_MAX_RANK = 32  # H5S_MAX_RANK
_MAX_FILTERS = 8  # filters read here (HDF5 allows 32; lean_store writes at most 4)
_CHUNKED = 2  # H5D_CHUNKED
_UNDEFINED_ADDRESS = 2**64 - 1  # HADDR_UNDEF


class DatasetLayout(NamedTuple):
    """A dataset's storage as libhdf5 reports it: layout class (``H5D_CHUNKED`` ...), its
    filters, the number of external files, its shape, its chunk shape (None unless chunked), the
    chunks allocated, and the bytes they take."""

    layout: int
    filters: tuple[int, ...]  # the filters' ids, in order
    external: int
    shape: tuple[int, ...]
    chunks: tuple[int, ...] | None
    num_chunks: int
    storage_size: int


class _Token(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint8 * 16)]  # H5O_token_t, passed by value


class Library:
    """The few libhdf5 functions used, bound to the library h5py loaded, and h5py's lock."""

    _H5Acreate2: Any
    _H5Awrite: Any
    _H5Aopen: Any
    _H5Aread: Any
    _H5Aget_type: Any
    _H5Aget_space: Any
    _H5Aclose: Any
    _H5Adelete: Any
    _H5Tequal: Any
    _H5Tclose: Any
    _H5Sget_simple_extent_ndims: Any
    _H5Sget_simple_extent_npoints: Any
    _H5Sclose: Any
    _H5Oget_info3: Any
    _H5VLnative_token_to_addr: Any
    _H5Dget_create_plist: Any
    _H5Pget_layout: Any
    _H5Pget_nfilters: Any
    _H5Pget_external_count: Any
    _H5Pget_chunk: Any
    _H5Pclose: Any
    _H5Pget_filter2: Any
    _H5Dget_space: Any
    _H5Sget_simple_extent_dims: Any
    _H5Dget_num_chunks: Any
    _H5Dget_storage_size: Any
    _H5Dget_chunk_info_by_coord: Any

    def __init__(self, lib: ctypes.PyDLL, lock: Any) -> None:
        self._lock = lock
        self._scratch = bytearray(256)  # where attributes are read to; used under the lock
        self._scratch_at = _address(self._scratch)
        self._info = bytearray(_INFO_BYTES)  # an H5O_info2_t; used under the lock
        self._info_at = _address(self._info)
        self._address = ctypes.c_uint64()
        # outputs of dataset_layout and chunk_info, used under the lock
        self._dims = (ctypes.c_uint64 * _MAX_RANK)()
        self._dims_at = ctypes.addressof(self._dims)
        self._count = ctypes.c_uint64()
        self._count_at = ctypes.addressof(self._count)
        self._coords = (ctypes.c_uint64 * _MAX_RANK)()
        self._coords_at = ctypes.addressof(self._coords)
        self._mask = ctypes.c_uint()
        self._mask_at = ctypes.addressof(self._mask)
        self._chunk_addr = ctypes.c_uint64()
        self._addr_at = ctypes.addressof(self._chunk_addr)
        self._chunk_size = ctypes.c_uint64()
        self._flags, self._nelmts, self._filter_config = ctypes.c_uint(), ctypes.c_size_t(), (
            ctypes.c_uint())
        self._flags_at = ctypes.addressof(self._flags)
        self._nelmts_at = ctypes.addressof(self._nelmts)
        self._filter_config_at = ctypes.addressof(self._filter_config)
        self._size_at = ctypes.addressof(self._chunk_size)
        sig = {
            "H5Acreate2": (_hid, [_hid, ctypes.c_char_p, _hid, _hid, _hid, _hid]),
            "H5Awrite": (_int, [_hid, _hid, ctypes.c_char_p]),
            "H5Aopen": (_hid, [_hid, ctypes.c_char_p, _hid]),
            "H5Aread": (_int, [_hid, _hid, ctypes.c_void_p]),
            "H5Aget_type": (_hid, [_hid]),
            "H5Aget_space": (_hid, [_hid]),
            "H5Aclose": (_int, [_hid]),
            "H5Adelete": (_int, [_hid, ctypes.c_char_p]),
            "H5Tequal": (_int, [_hid, _hid]),
            "H5Tclose": (_int, [_hid]),
            "H5Sget_simple_extent_ndims": (_int, [_hid]),
            "H5Sget_simple_extent_npoints": (ctypes.c_int64, [_hid]),
            "H5Sclose": (_int, [_hid]),
            "H5Oget_info3": (_int, [_hid, ctypes.c_void_p, ctypes.c_uint]),
            "H5Dget_create_plist": (_hid, [_hid]),
            "H5Pget_layout": (_int, [_hid]),
            "H5Pget_nfilters": (_int, [_hid]),
            "H5Pget_external_count": (_int, [_hid]),
            "H5Pget_chunk": (_int, [_hid, _int, ctypes.c_void_p]),
            "H5Pclose": (_int, [_hid]),
            "H5Pget_filter2": (_int, [_hid, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                      ctypes.c_void_p]),
            "H5Dget_space": (_hid, [_hid]),
            "H5Sget_simple_extent_dims": (_int, [_hid, ctypes.c_void_p, ctypes.c_void_p]),
            "H5Dget_num_chunks": (_int, [_hid, _hid, ctypes.c_void_p]),
            "H5Dget_storage_size": (ctypes.c_uint64, [_hid]),
            "H5Dget_chunk_info_by_coord": (_int, [_hid, ctypes.c_void_p, ctypes.c_void_p,
                                                  ctypes.c_void_p, ctypes.c_void_p]),
            "H5VLnative_token_to_addr": (_int, [_hid, _Token, ctypes.POINTER(ctypes.c_uint64)]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, "_" + name, fn)

    def write_attrs(self, oid: int, rows: Sequence[tuple[bytes, int, int, int, bytes]]) -> int:
        """Create and write each attribute of ``rows`` (name, file type id, dataspace id,
        memory type id, bytes) on the object ``oid``, in order; the number written. At the
        first failure the attribute is removed again and the count so far returned, for the
        caller to write the rest through h5py (which raises h5py's error if it fails too)."""
        create, write, close = self._H5Acreate2, self._H5Awrite, self._H5Aclose
        done = 0
        with self._lock:
            for name, ftype, space, mtype, raw in rows:
                aid = create(oid, name, ftype, space, H5P_DEFAULT, H5P_DEFAULT)
                if aid < 0:
                    break
                ok = write(aid, mtype, raw) >= 0
                close(aid)
                if not ok:
                    self._H5Adelete(oid, name)
                    break
                done += 1
        return done

    def attrs_equal(self, oid: int, attrs: Sequence[Any]) -> bool:
        """True when each of ``attrs`` is on the object ``oid`` with exactly its file type
        (``H5Tequal``), rank, number of values and bytes (read with its memory type, the same
        size as its file type once the types are equal). False at the first difference or
        failure. The caller checks the number of attributes."""
        with self._lock:
            for attr in attrs:
                aid = self._H5Aopen(oid, attr.name, H5P_DEFAULT)
                if aid < 0:
                    return False
                try:
                    if not self._same(aid, attr):
                        return False
                finally:
                    self._H5Aclose(aid)
        return True

    def object_header(self, oid: int) -> tuple[int, int] | None:
        """(file address of the object header, number of attributes) of the object ``oid``
        (``H5Oget_info3`` and ``H5VLnative_token_to_addr``), or None on failure."""
        info = self._info
        address = self._address
        with self._lock:
            if self._H5Oget_info3(oid, self._info_at, _INFO_BASIC | _INFO_NUM_ATTRS) < 0:
                return None
            token = _Token.from_buffer_copy(info, _INFO_TOKEN)
            if self._H5VLnative_token_to_addr(oid, token, ctypes.byref(address)) < 0:
                return None
            return address.value, int.from_bytes(
                info[_INFO_NUM_ATTRS_AT:_INFO_NUM_ATTRS_AT + 8], "little")

    def dataset_layout(self, did: int) -> DatasetLayout | None:
        """What the open checks of a dataset ask libhdf5 (see :class:`DatasetLayout`), in
        one pass; None on any failure (the caller asks h5py, which raises its error)."""
        dims, count = self._dims, self._count
        with self._lock:
            dcpl = self._H5Dget_create_plist(did)
            if dcpl < 0:
                return None
            try:
                layout = self._H5Pget_layout(dcpl)
                nfilters = self._H5Pget_nfilters(dcpl)
                external = self._H5Pget_external_count(dcpl)
                rank = self._H5Pget_chunk(dcpl, _MAX_RANK, self._dims_at) if layout == (
                    _CHUNKED) else 0
                filters = tuple(self._filter(dcpl, i) for i in range(min(nfilters,
                                                                         _MAX_FILTERS)))
            finally:
                self._H5Pclose(dcpl)
            if layout < 0 or nfilters < 0 or external < 0 or rank < 0 or (
                nfilters > _MAX_FILTERS or any(f < 0 for f in filters)
            ):
                return None
            chunks = tuple(dims[:rank]) if layout == _CHUNKED else None
            sid = self._H5Dget_space(did)
            if sid < 0:
                return None
            ndims = self._H5Sget_simple_extent_dims(sid, self._dims_at, None)
            self._H5Sclose(sid)
            if ndims < 0:
                return None
            shape = tuple(dims[:ndims])
            if chunks is not None and self._H5Dget_num_chunks(did, 0, self._count_at) < 0:
                return None
            stored = self._H5Dget_storage_size(did)
            return DatasetLayout(layout, filters, external, shape, chunks,
                                 count.value if chunks is not None else 0, stored)

    def _filter(self, dcpl: int, index: int) -> int:
        """The id of filter ``index`` of the creation property list ``dcpl`` (under the
        lock); no parameters are copied (their count is passed as 0)."""
        self._nelmts.value = 0
        return self._H5Pget_filter2(dcpl, index, self._flags_at, self._nelmts_at, None, 0,
                                    None, self._filter_config_at)

    def chunk_info(self, did: int, start: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(filter mask, file address, stored size) of the chunk of ``did`` that starts at
        element ``start`` (``H5Dget_chunk_info_by_coord``); None when it has no storage or on
        failure."""
        if len(start) > _MAX_RANK:
            return None
        with self._lock:  # the outputs are shared: read them before another call can
            coords = self._coords
            for i, value in enumerate(start):
                coords[i] = value
            if self._H5Dget_chunk_info_by_coord(did, self._coords_at, self._mask_at,
                                                self._addr_at, self._size_at) < 0:
                return None
            found = self._mask.value, self._chunk_addr.value, self._chunk_size.value
        return None if found[1] == _UNDEFINED_ADDRESS else found

    def _same(self, aid: int, attr: Any) -> bool:
        tid = self._H5Aget_type(aid)
        if tid < 0:
            return False
        equal = self._H5Tequal(tid, attr.ftype.id)
        self._H5Tclose(tid)
        if equal <= 0:
            return False
        sid = self._H5Aget_space(aid)
        if sid < 0:
            return False
        rank = self._H5Sget_simple_extent_ndims(sid)
        count = self._H5Sget_simple_extent_npoints(sid)
        self._H5Sclose(sid)
        if rank != attr.data.ndim or count != attr.data.size:  # a null dataspace: rank 0, 0
            return False
        n = len(attr.raw)
        if n > len(self._scratch):
            self._scratch = bytearray(n)
            self._scratch_at = _address(self._scratch)
        if self._H5Aread(aid, attr.mtype.id, self._scratch_at) < 0:
            return False
        return memoryview(self._scratch)[:n] == attr.raw


def _address(buffer: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def _loaded_path() -> str | None:
    """The file of the libhdf5 loaded in this process (h5py's), from the process's maps."""
    try:
        with open(_MAPS) as f:
            paths = {line.split(None, 5)[5].strip() for line in f if "libhdf5" in line}
    except (OSError, IndexError):
        return None
    found = [p for p in paths if _LIBNAME.search(p)]
    return found[0] if len(found) == 1 else None


def _load() -> Library | None:
    if os.environ.get("LEAN_STORE_HDF5_CTYPES", "1") == "0":
        return None
    import h5py
    from h5py import h5s

    lock = _h5py_lock()
    path = _loaded_path()
    if lock is None or path is None:
        return None
    try:
        lib = ctypes.PyDLL(path)
        version = [ctypes.c_uint() for _ in range(3)]
        lib.H5get_libversion.argtypes = [ctypes.POINTER(ctypes.c_uint)] * 3
        if lib.H5get_libversion(*version) < 0 or tuple(
            v.value for v in version
        ) != h5py.version.hdf5_version_tuple[:3]:
            return None
        probe = h5s.create_simple((3, 7, 11))  # an id only h5py's library instance knows
        lib.H5Sget_simple_extent_npoints.restype = ctypes.c_int64
        lib.H5Sget_simple_extent_npoints.argtypes = [_hid]
        with lock:
            if lib.H5Sget_simple_extent_npoints(probe.id) != 3 * 7 * 11:
                return None
        return Library(lib, lock)
    except (OSError, AttributeError, TypeError, ValueError):
        return None


_LIBRARY: list[Library | None] = []


def library() -> Library | None:
    """The bound library, or None where it cannot be used safely (see the module text)."""
    if not _LIBRARY:
        _LIBRARY.append(_load())
    return _LIBRARY[0]


def _h5py_lock() -> Any:
    """h5py's global re-entrant lock (``h5py._objects.phil``), or None if it is not there."""
    lock = getattr(importlib.import_module("h5py._objects"), "phil", None)
    return lock if hasattr(lock, "__enter__") and hasattr(lock, "__exit__") else None


_CHUNK_LOCK: list[Any] = []


def chunk_lock() -> Any:
    """The lock to hold around h5py's direct-chunk calls (``read_direct_chunk``,
    ``write_direct_chunk``, ``get_chunk_info*``): h5py's own lock, which h5py before 3.16 does
    not take for them (h5py takes it again inside from 3.16: it is re-entrant). Where h5py
    has no such lock, a no-op context."""
    if not _CHUNK_LOCK:
        _CHUNK_LOCK.append(_h5py_lock() or contextlib.nullcontext())
    return _CHUNK_LOCK[0]


def chunk_location(dsid: Any, start: tuple[int, ...]) -> tuple[int, int | None, int] | None:
    """(filter mask, file address or None when unallocated, stored size) of the chunk of the
    h5py dataset id ``dsid`` that starts at element ``start``: through :func:`library` where
    it answers, else through h5py's ``get_chunk_info_by_coord``; None where h5py fails."""
    lib = library()
    found = None if lib is None else lib.chunk_info(dsid.id, start)
    if found is not None:
        return found
    try:
        with chunk_lock():
            info = dsid.get_chunk_info_by_coord(start)
    except (OSError, RuntimeError, ValueError, KeyError):
        return None
    return info.filter_mask, info.byte_offset, info.size
