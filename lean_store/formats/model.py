"""Scalar format value types: what a stored scalar *is*.

Every format is a small frozen value object. Two formats are equal exactly when they mean the
same thing, so ``binary(8, 7) == get("bfloat16")``. Codecs live in :mod:`.codecs`; the tag
registry lives in :mod:`.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from ..errors import FormatError

ENCODINGS = ("ieee", "finite-max-nan", "finite-unsigned-zero", "finite")
MAX_WIDTH = 64


def storage_dtype_for(width: int) -> np.dtype:
    """The smallest unsigned container that holds ``width`` bits."""
    for bits, dtype in ((8, np.uint8), (16, np.uint16), (32, np.uint32), (64, np.uint64)):
        if width <= bits:
            return np.dtype(dtype)
    raise FormatError(f"no container holds {width} bits (the maximum is {MAX_WIDTH})")


class ScalarFormat:
    """Base of every scalar format. Subclasses are frozen dataclasses."""

    kind: ClassVar[str] = ""

    # tag, storage_dtype, numpy_dtype, width and words_per_value are asked several times per
    # tensor on every save and load: each is computed once per format object (the object is
    # frozen; cached_property keeps the value in its __dict__, outside the dataclass fields
    # that equality and hashing use), then read as a plain attribute

    @cached_property
    def tag(self) -> str:
        """Stable text name of this format, used on disk."""
        from .registry import tag_of

        return tag_of(self)

    @cached_property
    def width(self) -> int:
        """Bits per scalar (2 x the component for complex formats)."""
        raise NotImplementedError

    @cached_property
    def word_width(self) -> int:
        """Bits per stored word: the width, or the component width for complex formats."""
        return self.width

    @cached_property
    def storage_dtype(self) -> np.dtype:
        """Unsigned container of one stored word (complex values store a pair of them)."""
        return storage_dtype_for(self.word_width)

    @cached_property
    def words_per_value(self) -> int:
        return 1

    @cached_property
    def numpy_dtype(self) -> np.dtype | None:
        """The numpy / ml_dtypes dtype with exactly these semantics, or ``None``."""
        from .registry import numpy_dtype_of

        return numpy_dtype_of(self)

    @property
    def torchlean_tag(self) -> str | None:
        """TorchLean's JSON state tag for this format, or ``None`` where TorchLean has none."""
        return None

    def to_config(self) -> dict[str, Any]:
        """JSON-able description; :func:`lean_store.formats.from_config` inverts it."""
        raise NotImplementedError

    def decode(self, bits: np.ndarray, *, exact: bool = True) -> np.ndarray:
        """Exact values of raw bit patterns (float64, complex128, or integers for int formats)."""
        from .codecs import decode

        return decode(self, bits, exact=exact)

    def encode(self, values: Any) -> np.ndarray:
        """Bit patterns of ``values``, rounded to nearest-even under this format's rules."""
        from .codecs import encode

        return encode(self, values)

    def __str__(self) -> str:
        return self.tag

    def __repr__(self) -> str:
        return f"ScalarFormat({self.tag!r})"


@dataclass(frozen=True, repr=False)
class BinaryFormat(ScalarFormat):
    """sign | exponent | fraction, no implicit bit stored; width = 1 + e + f."""

    exponent_bits: int
    fraction_bits: int
    bias: int
    encoding: str

    kind: ClassVar[str] = "binary"

    def __post_init__(self) -> None:
        e, f, bias, enc = self.exponent_bits, self.fraction_bits, self.bias, self.encoding
        for name, value in (("exponent_bits", e), ("fraction_bits", f), ("bias", bias)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise FormatError(f"{name} must be an integer, got {value!r}")
        if enc not in ENCODINGS:
            raise FormatError(f"unknown encoding {enc!r}; known: {', '.join(ENCODINGS)}")
        if e < 2:
            raise FormatError(f"exponent_bits must be >= 2, got {e}")
        if f < 1:
            raise FormatError(f"fraction_bits must be >= 1, got {f}")
        if 1 + e + f > MAX_WIDTH:
            raise FormatError(f"width 1 + {e} + {f} = {1 + e + f} exceeds {MAX_WIDTH} bits")
        if not 0 <= bias <= (1 << e) - 1:
            raise FormatError(f"bias {bias} out of range [0, {(1 << e) - 1}] for {e} exponent bits")

    @cached_property
    def width(self) -> int:
        return 1 + self.exponent_bits + self.fraction_bits

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of the largest finite value."""
        top = (1 << self.exponent_bits) - 1
        if self.encoding == "ieee":
            top -= 1
        return top - self.bias

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return 1 - self.bias

    @cached_property
    def embeds_in_float64(self) -> bool:
        """True when every value of this format is exactly a binary64 value."""
        return (
            self.fraction_bits <= 52
            and self.max_exponent <= 1023
            and self.min_exponent - self.fraction_bits >= -1074
        )

    @property
    def torchlean_tag(self) -> str:
        if (self.exponent_bits, self.fraction_bits, self.bias, self.encoding) == (
            11,
            52,
            1023,
            "ieee",
        ):
            return "torchlean_state_bits_v1"
        if (self.exponent_bits, self.fraction_bits, self.bias, self.encoding) == (
            8,
            23,
            127,
            "ieee",
        ):
            return "torchlean_state_float32_bits_v1"
        return (
            f"torchlean_state_binary_{self.exponent_bits}_{self.fraction_bits}"
            f"_{self.bias}_{self.encoding}_v1"
        )

    def to_config(self) -> dict[str, Any]:
        return {
            "kind": "binary",
            "exponent_bits": int(self.exponent_bits),
            "fraction_bits": int(self.fraction_bits),
            "bias": int(self.bias),
            "encoding": self.encoding,
        }


@dataclass(frozen=True, repr=False)
class ExponentFormat(ScalarFormat):
    """Unsigned exponent-only scale format (OCP MX ``E8M0``): 2^(bits - bias); all ones is NaN."""

    exponent_bits: int = 8
    bias: int = 127

    kind: ClassVar[str] = "exponent"

    def __post_init__(self) -> None:
        if (self.exponent_bits, self.bias) != (8, 127):
            raise FormatError("only the 8-bit exponent-only format float8_e8m0fnu is supported")

    @cached_property
    def width(self) -> int:
        return self.exponent_bits

    def to_config(self) -> dict[str, Any]:
        return {"kind": "exponent", "exponent_bits": self.exponent_bits, "bias": self.bias}


@dataclass(frozen=True, repr=False)
class IntegerFormat(ScalarFormat):
    """Two's-complement (signed) or plain binary (unsigned) integers of 8, 16, 32 or 64 bits."""

    bits: int
    signed: bool

    kind: ClassVar[str] = "int"

    def __post_init__(self) -> None:
        if self.bits not in (8, 16, 32, 64) or not isinstance(self.signed, bool):
            raise FormatError(f"integer formats have 8, 16, 32 or 64 bits, got {self.bits!r}")

    @cached_property
    def width(self) -> int:
        return self.bits

    def to_config(self) -> dict[str, Any]:
        return {"kind": "int", "bits": self.bits, "signed": self.signed}


@dataclass(frozen=True, repr=False)
class BoolFormat(ScalarFormat):
    """Booleans, one byte each, 0 or 1."""

    kind: ClassVar[str] = "bool"

    @cached_property
    def width(self) -> int:
        return 8

    def to_config(self) -> dict[str, Any]:
        return {"kind": "bool"}


@dataclass(frozen=True, repr=False)
class ComplexFormat(ScalarFormat):
    """A pair (real, imaginary), each coordinate in the component's encoding."""

    component: ScalarFormat

    kind: ClassVar[str] = "complex"

    def __post_init__(self) -> None:
        if not isinstance(self.component, (BinaryFormat, ExponentFormat)):
            raise FormatError(
                f"complex components must be binary float formats, not {self.component}"
            )
        if isinstance(self.component, ExponentFormat):
            raise FormatError("float8_e8m0fnu is unsigned and cannot be a complex component")

    @cached_property
    def width(self) -> int:
        return 2 * self.component.width

    @cached_property
    def word_width(self) -> int:
        return self.component.width

    @cached_property
    def words_per_value(self) -> int:
        return 2

    @property
    def torchlean_tag(self) -> str | None:
        return f"torchlean_state_complex_v1({self.component.torchlean_tag})"

    def to_config(self) -> dict[str, Any]:
        return {"kind": "complex", "component": self.component.to_config()}
