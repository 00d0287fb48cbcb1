"""Mappings of names to numpy arrays (ml_dtypes included) and :class:`Encoded` values."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..chunking import Region
from ..encoded import Encoded
from ..errors import CheckpointError, FormatError, UnsupportedValueError
from ..formats import ScalarFormat, of_numpy_dtype
from ..layout import Entry, Layout
from .base import SourceTensor, TargetTensor, TensorSource, elements_overlap, overlap_refusal


def is_array_mapping(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(
        isinstance(v, (np.ndarray, np.generic, Encoded)) for v in obj.values()
    )


def non_array_entry(obj: Mapping[Any, Any]) -> str | None:
    """Why a mapping is not a mapping of arrays, naming its first offending entry; None if
    it is one."""
    for name, value in obj.items():
        if not isinstance(value, (np.ndarray, np.generic, Encoded)):
            noun = type(value).__name__
            article = "an" if noun[:1].lower() in "aeiou" else "a"
            return (
                f"state entry {name!r} is {article} {noun}, not an array or tensor: save "
                "trainer state such as epochs and steps with lean_store.save_training, or leave "
                "it out of the state passed to save"
            )
    return None


def masked_entry(name: str, value: Any) -> str | None:
    """Why ``value`` (a numpy masked array) is refused, or None: its mask would be lost (the
    values under the mask are whatever its data holds)."""
    if isinstance(value, np.ma.MaskedArray):
        return (
            f"state entry {name!r} is a numpy masked array; lean_store stores plain arrays, so "
            "its mask would be lost: save value.filled(fill) or its .data and .mask as two "
            "tensors"
        )
    return None


def array_bits(array: np.ndarray, fmt: ScalarFormat) -> np.ndarray:
    """Raw little-endian words of a numpy array (a view when the memory allows it)."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if fmt.words_per_value == 2:
        array = np.ascontiguousarray(array)
        return array.view(fmt.storage_dtype).reshape(array.shape + (2,))
    return array.view(fmt.storage_dtype)


def stored_view(bits: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Raw words reshaped to the stored shape: scalars become (1,)."""
    return bits.reshape((1,) + bits.shape[len(shape):]) if not shape else bits


class ArraySourceTensor(SourceTensor):
    stable_reads = True  # views of the tensor's memory, or fresh copies

    def __init__(self, value: np.ndarray | Encoded, fmt: ScalarFormat) -> None:
        self._fmt = fmt
        if isinstance(value, Encoded):
            self._bits: np.ndarray | None = stored_view(value.bits, value.shape)
            self._array = None
        elif fmt.words_per_value == 2 and not value.flags.c_contiguous:
            self._bits = None  # complex views need contiguous memory: copy per region
            self._array = value.reshape(1) if value.ndim == 0 else value
        else:
            self._bits = stored_view(array_bits(value, fmt), value.shape)
            self._array = None

    def read(self, region: Region) -> np.ndarray:
        if self._bits is not None:
            return np.ascontiguousarray(self._bits[region])
        assert self._array is not None
        return array_bits(np.ascontiguousarray(self._array[region]), self._fmt)


def format_of_value(name: str, value: Any) -> ScalarFormat:
    if isinstance(value, Encoded):
        return value.format
    try:
        return of_numpy_dtype(value.dtype)
    except FormatError as exc:
        raise FormatError(f"tensor {name!r}: {exc}") from None


class MappingSource(TensorSource):
    def __init__(self, state: Mapping[str, Any]) -> None:
        values = {}
        for name, value in state.items():
            if not isinstance(name, str):
                raise CheckpointError(f"tensor names must be strings, got {name!r}")
            why = masked_entry(name, value)
            if why is not None:
                raise UnsupportedValueError(why)
            values[name] = np.asarray(value) if isinstance(value, np.generic) else value
        self._values = values
        self.layout = Layout.from_specs(
            [(n, tuple(v.shape), format_of_value(n, v)) for n, v in values.items()]
        )

    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]:
        for entry in self.layout:
            yield entry, ArraySourceTensor(self._values[entry.name], entry.format)


class ArrayTarget(TargetTensor):
    def __init__(self, entry: Entry, array: np.ndarray) -> None:
        self.entry = entry
        if not array.flags.writeable:
            raise CheckpointError(f"target {entry.name!r} is read-only")
        if not (array.flags.c_contiguous or array.flags.f_contiguous) and elements_overlap(
                array.shape, array.strides, array.itemsize):
            raise UnsupportedValueError(overlap_refusal(entry.name))
        self._array = array.reshape(1) if array.ndim == 0 else array

    def memory(self) -> tuple[Any, ...] | None:
        a = self._array
        if a.size == 0:
            return None
        return (a.__array_interface__["data"][0], a.shape, a.strides, self.entry.format.tag)

    def write(self, region: Region, bits: np.ndarray) -> None:
        fmt = self.entry.format
        dst = self._array[region]
        if not dst.dtype.isnative:  # e.g. '>f4' (FITS data, a big-endian file's arrays): the
            # words are native, so numpy converts each value into the target's byte order
            native = dst.dtype.newbyteorder("=")
            dst[...] = np.ascontiguousarray(bits).view(native).reshape(dst.shape)
            return
        if fmt.words_per_value == 2:
            dst[...] = bits.view(dst.dtype).reshape(dst.shape)
        else:
            dst.view(fmt.storage_dtype)[...] = bits


def numpy_targets(obj: Any) -> dict[str, TargetTensor]:
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"cannot load into a {type(obj).__name__}")
    targets: dict[str, TargetTensor] = {}
    layout = MappingSource(obj).layout
    for entry in layout:
        value = obj[entry.name]
        if isinstance(value, Encoded) and value.format.words_per_value == 2:
            targets[entry.name] = _EncodedPairTarget(entry, value.bits)
        elif isinstance(value, Encoded):
            targets[entry.name] = ArrayTarget(entry, value.bits)
        elif isinstance(value, np.ndarray):
            targets[entry.name] = ArrayTarget(entry, value)
        else:
            raise CheckpointError(f"target {entry.name!r} is not a writable numpy array")
    return targets


class _EncodedPairTarget(TargetTensor):
    def __init__(self, entry: Entry, bits: np.ndarray) -> None:
        self.entry = entry
        self._bits = bits.reshape((1, 2)) if bits.ndim == 1 else bits

    def write(self, region: Region, bits: np.ndarray) -> None:
        self._bits[region] = bits
