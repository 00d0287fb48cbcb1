"""Row blocks of a chosen size read through :meth:`Checkpoint.blocks` (every chunk and the
digest checked), and fast exact decoding. Shared by :mod:`.stats`, :mod:`.diff` and
:mod:`.analysis`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import lru_cache

import numpy as np

from ..checkpoint import Checkpoint
from ..chunking import Region, plan_chunks
from ..formats import BinaryFormat, ComplexFormat, ExponentFormat, ScalarFormat
from ..layout import Entry
from .foreign import InputBlocks

DEFAULT_BLOCK_BYTES = 8 << 20
_LUT_MAX_WIDTH = 16


def stored_shape(entry: Entry) -> tuple[int, ...]:
    """The shape tensors are read in: the logical shape, or ``(1,)`` for scalars."""
    return entry.shape or (1,)


def block_unit(entry: Entry, block_bytes: int = DEFAULT_BLOCK_BYTES) -> tuple[int, ...]:
    """Row-block unit of about ``block_bytes`` of raw words for ``entry``."""
    fmt = entry.format
    itemsize = fmt.storage_dtype.itemsize * fmt.words_per_value
    return plan_chunks(stored_shape(entry), itemsize, block_bytes)


def iter_words(
    ck: Checkpoint | InputBlocks, entry: Entry, block_bytes: int = DEFAULT_BLOCK_BYTES, *,
    unit: tuple[int, ...] | None = None,
) -> Iterator[tuple[Region, np.ndarray]]:
    """Raw words of ``entry`` in row blocks (of ``unit``, or about ``block_bytes``), C order,
    every chunk and the digest checked (:meth:`Checkpoint.blocks`)."""
    return ck.blocks(entry.name, unit=unit or block_unit(entry, block_bytes))


@lru_cache(maxsize=64)
def _table(fmt: ScalarFormat) -> np.ndarray:
    return fmt.decode(np.arange(1 << fmt.width, dtype=np.uint64).astype(fmt.storage_dtype))


def decoder(fmt: ScalarFormat) -> Callable[[np.ndarray], np.ndarray]:
    """An exact words -> values function: float64 for real floats, complex128 for complex,
    the integers / bools themselves otherwise. Narrow formats use a decoded lookup table."""
    if isinstance(fmt, ComplexFormat):
        part = decoder(fmt.component)

        def complex_decode(words: np.ndarray) -> np.ndarray:
            out = np.empty(words.shape[:-1], dtype=np.complex128)
            out.real = part(words[..., 0])
            out.imag = part(words[..., 1])
            return out

        return complex_decode
    if isinstance(fmt, (BinaryFormat, ExponentFormat)):
        if fmt.numpy_dtype is not None and fmt.numpy_dtype.itemsize >= 2 and fmt.width > 8:
            return fmt.decode  # numpy / ml_dtypes: vectorised and exact
        if fmt.width <= _LUT_MAX_WIDTH:
            table = _table(fmt)
            return lambda words: table[words]
    return fmt.decode


def values_dtype(fmt: ScalarFormat) -> np.dtype:
    """The dtype :func:`decoder` returns for ``fmt``."""
    if isinstance(fmt, ComplexFormat):
        return np.dtype(np.complex128)
    if isinstance(fmt, (BinaryFormat, ExponentFormat)):
        return np.dtype(np.float64)
    dtype = fmt.numpy_dtype
    assert dtype is not None
    return dtype


__all__ = [
    "DEFAULT_BLOCK_BYTES", "block_unit", "decoder", "iter_words", "stored_shape", "values_dtype",
]
