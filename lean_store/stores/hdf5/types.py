"""The HDF5 datatype of each scalar format.

IEEE-like formats whose every value is a binary64 value become real HDF5 float types with
custom fields, so h5dump and h5py print the right numbers. Formats whose special values HDF5
would misread (fn, fnuz, finite, e8m0, and any that overflow binary64) are stored as unsigned
bit patterns with the format in attributes: a tool shows bits, never a wrong number. Complex is a
compound ``{r, i}`` of the component type (not HDF5 2.0's native complex, which HDF5 1.10 cannot
read). Types narrower than their container carry a precision, and the N-bit filter packs them.
"""

from __future__ import annotations

import numpy as np
from h5py import h5t

from ...formats import BinaryFormat, BoolFormat, ComplexFormat, IntegerFormat, ScalarFormat

_UINT = {1: h5t.STD_U8LE, 2: h5t.STD_U16LE, 4: h5t.STD_U32LE, 8: h5t.STD_U64LE}
_INT = {1: h5t.STD_I8LE, 2: h5t.STD_I16LE, 4: h5t.STD_I32LE, 8: h5t.STD_I64LE}


def is_hdf5_float(fmt: ScalarFormat) -> bool:
    """True when HDF5's float model decodes every code point of ``fmt`` exactly."""
    return isinstance(fmt, BinaryFormat) and fmt.encoding == "ieee" and fmt.embeds_in_float64


def storage_kind(fmt: ScalarFormat) -> str:
    if isinstance(fmt, ComplexFormat):
        return "compound"
    if isinstance(fmt, IntegerFormat):
        return "int"
    if isinstance(fmt, BoolFormat):
        return "bool"
    return "float" if is_hdf5_float(fmt) else "uint"


def hdf5_type(fmt: ScalarFormat) -> h5t.TypeID:
    """A new HDF5 type object for ``fmt`` (little-endian, exact bits)."""
    if isinstance(fmt, ComplexFormat):
        member = hdf5_type(fmt.component)
        size = member.get_size()
        compound = h5t.create(h5t.COMPOUND, 2 * size)
        compound.insert(b"r", 0, member)
        compound.insert(b"i", size, hdf5_type(fmt.component))
        return compound
    if isinstance(fmt, BoolFormat):
        return h5t.py_create(np.dtype(np.bool_))
    nbytes = fmt.storage_dtype.itemsize
    if isinstance(fmt, IntegerFormat):
        return (_INT if fmt.signed else _UINT)[nbytes].copy()
    if is_hdf5_float(fmt):
        assert isinstance(fmt, BinaryFormat)
        e, f = fmt.exponent_bits, fmt.fraction_bits
        base = h5t.IEEE_F64LE if nbytes == 8 else h5t.IEEE_F32LE
        t = base.copy()
        if nbytes < t.get_size():
            t.set_fields(e + f, f, e, 0, f)
            t.set_offset(0)
            t.set_precision(1 + e + f)
            t.set_size(nbytes)
        else:
            t.set_offset(0)
            t.set_precision(max(t.get_precision(), 1 + e + f))
            t.set_fields(e + f, f, e, 0, f)
            t.set_precision(1 + e + f)
        t.set_ebias(fmt.bias)
        t.set_inpad(h5t.PAD_ZERO)
        return t
    t = _UINT[nbytes].copy()
    if fmt.width < 8 * nbytes:
        t.set_precision(fmt.width)
    return t


def needs_nbit(fmt: ScalarFormat) -> bool:
    """True when the type is narrower than its container, so the N-bit filter saves space."""
    if isinstance(fmt, BoolFormat):
        return False
    return fmt.word_width < 8 * fmt.storage_dtype.itemsize


__all__ = ["hdf5_type", "is_hdf5_float", "needs_nbit", "storage_kind"]
