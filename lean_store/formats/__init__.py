"""Scalar formats: tags, widths, exact codecs and packing.

>>> from lean_store import formats
>>> formats.binary(8, 7) == formats.get("bfloat16")
True
>>> formats.binary(5, 6).tag
'binary_5_6_15_ieee'
"""

from .codecs import decode, encode
from .model import (
    ENCODINGS,
    BinaryFormat,
    BoolFormat,
    ComplexFormat,
    ExponentFormat,
    IntegerFormat,
    ScalarFormat,
)
from .packing import pack, packed_nbytes, unpack
from .registry import STANDARD, binary, complex_of, default_bias, from_config, get, of_numpy_dtype

__all__ = [
    "ENCODINGS",
    "STANDARD",
    "BinaryFormat",
    "BoolFormat",
    "ComplexFormat",
    "ExponentFormat",
    "IntegerFormat",
    "ScalarFormat",
    "binary",
    "complex_of",
    "decode",
    "default_bias",
    "encode",
    "from_config",
    "get",
    "of_numpy_dtype",
    "pack",
    "packed_nbytes",
    "unpack",
]
