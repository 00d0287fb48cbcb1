"""``Encoded``: raw bits plus their format, for values that have no numpy dtype."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import FormatError
from .formats import ScalarFormat, get
from .formats.codecs import check_bits


class Encoded:
    """A tensor held as raw bit patterns of a :class:`ScalarFormat`.

    ``bits`` has the format's ``storage_dtype``; for complex formats it has a trailing axis of
    2 (real, imaginary). lean_store never casts an ``Encoded`` silently: call :meth:`decode`.
    """

    __slots__ = ("_bits", "_format")

    def __init__(self, bits: Any, fmt: ScalarFormat | str) -> None:
        fmt = get(fmt) if isinstance(fmt, str) else fmt
        if not isinstance(fmt, ScalarFormat):
            raise FormatError(f"Encoded needs a ScalarFormat or a tag, got {fmt!r}")
        self._format = fmt
        self._bits = check_bits(fmt, bits)

    @classmethod
    def from_values(cls, values: Any, fmt: ScalarFormat | str) -> Encoded:
        """Round ``values`` into ``fmt`` (nearest-even) and hold the resulting bits."""
        fmt = get(fmt) if isinstance(fmt, str) else fmt
        return cls(fmt.encode(values), fmt)

    @property
    def bits(self) -> np.ndarray:
        return self._bits

    @property
    def format(self) -> ScalarFormat:
        return self._format

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (without the complex pair axis)."""
        return self._bits.shape[:-1] if self._format.words_per_value == 2 else self._bits.shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def decode(self, *, exact: bool = True) -> np.ndarray:
        """Exact values as float64 (complex128 for complex formats); see ``ScalarFormat.decode``."""
        return self._format.decode(self._bits, exact=exact)

    def __getitem__(self, key: Any) -> Encoded:
        if self._format.words_per_value == 2:
            key = key if isinstance(key, tuple) else (key,)
            if any(k is Ellipsis for k in key):
                return Encoded(self._bits[key + (slice(None),)], self._format)
            return Encoded(self._bits[key + (Ellipsis, slice(None))], self._format)
        return Encoded(self._bits[key], self._format)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Encoded):
            return NotImplemented
        return self._format == other._format and np.array_equal(self._bits, other._bits)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Encoded(shape={self.shape}, format={self._format.tag!r})"
