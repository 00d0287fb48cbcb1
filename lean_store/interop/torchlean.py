"""Bit-exact readers and writers for TorchLean's three checkpoint file formats.

* ``TLSF32B`` -- streamed float32 model state (:func:`read_sf32`, :func:`write_sf32`);
* JSON state with raw storage words (:func:`read_state_json`, :func:`write_state_json`);
* ``TLADAMF`` -- Adam/AdamW optimizer state, versions 2-4 (:func:`read_adam`, :func:`write_adam`).

The byte-level specification is ``docs/TORCHLEAN.md``. Every value is carried as its
storage bits and never passes through a Python float, so NaN payloads, signed zeros and subnormals
survive.

Readers take either a path (``str`` or :class:`os.PathLike`) or the file's contents as a bytes-like
object; ``decode_*`` take contents only. Malformed input raises :class:`IntegrityError` (structure:
magic, version, truncation, trailing bytes, counts) or :class:`FormatError` (a scalar format tag or
a storage word that the format does not allow). Every length or count read from a file is checked
against the bytes actually present before anything is allocated for it.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lean_store.errors import FormatError, IntegrityError
from lean_store.stores.commit import Commit
from lean_store.stores.target import FileKind

__all__ = [
    "ADAM_FILE",
    "ADAM_MAGIC",
    "ADAM_VERSIONS",
    "SF32_FILE",
    "SF32_MAGIC",
    "SF32_VERSION",
    "STATE_ENCODINGS",
    "STATE_JSON_FILE",
    "TLAdamEntry",
    "TLAdamFile",
    "TLAdamParam",
    "TLFormatTag",
    "TLState",
    "binary_tag",
    "complex_tag",
    "decode_adam",
    "decode_sf32",
    "decode_state_json",
    "encode_adam",
    "encode_sf32",
    "encode_state_json",
    "parse_tag",
    "read_adam",
    "read_sf32",
    "read_state_json",
    "write_adam",
    "write_sf32",
    "write_state_json",
]

SF32_MAGIC = b"TLSF32B"
SF32_VERSION = 1
ADAM_MAGIC = b"TLADAMF"
ADAM_VERSIONS = (2, 3, 4)
STATE_ENCODINGS = ("ieee", "finite-max-nan", "finite-unsigned-zero", "finite")

# the kinds of file the writers replace (anything else at the path is refused)
SF32_FILE = FileKind("a TorchLean TLSF32B file", lambda head: head.startswith(SF32_MAGIC))
ADAM_FILE = FileKind("a TorchLean TLADAMF file", lambda head: head.startswith(ADAM_MAGIC))
STATE_JSON_FILE = FileKind(
    "a TorchLean JSON state file",
    lambda head: re.match(rb'\s*\{\s*"(format|state)"\s*:', head) is not None,
)

_U64 = struct.Struct("<Q")
_U64_LIMIT = 1 << 64
_ADAM_KINDS = ("adam", "adamw")

_TAG_BINARY64 = "torchlean_state_bits_v1"
_TAG_FLOAT32 = "torchlean_state_float32_bits_v1"
_COMPLEX_PREFIX = "torchlean_state_complex_v1("
_NAT = r"(0|[1-9][0-9]{0,3})"
_BINARY_RE = re.compile(
    r"torchlean_state_binary_" + _NAT + "_" + _NAT + r"_(-?(?:0|[1-9][0-9]{0,99}))_"
    r"(ieee|finite-max-nan|finite-unsigned-zero|finite)_v1"
)
# The only NaN words Lean's native Float / Float32 produce; any other NaN word is rejected under
# the two native tags (TorchLean's decoder does the same).
_CANONICAL_NAN = {64: 0x7FF8000000000000, 32: 0x7FC00000}
_NAN_FIELDS = {64: (0x7FF0000000000000, 0x000FFFFFFFFFFFFF), 32: (0x7F800000, 0x007FFFFF)}


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def _load(source: str | os.PathLike[str] | bytes | bytearray | memoryview, what: str) -> bytes:
    """Return the bytes of ``source``: a path is read, a bytes-like object is the content."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as fh:
            return fh.read()
    raise TypeError(f"{what}: expected a path or bytes, got {type(source).__name__}")


def atomic_write(path: str | os.PathLike[str], chunks: Iterable[bytes], kind: FileKind) -> None:
    """Write ``chunks`` to a temporary sibling of ``path``, fsync it, rename it into place and
    fsync the directory (:class:`~lean_store.stores.commit.Commit`). Only a file of ``kind`` is
    replaced: anything else at ``path`` raises :class:`~lean_store.errors.ForeignPathError`."""
    with Commit.local(path, directory=False, kind=kind) as commit:
        with open(commit.work, "wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
        commit.commit()


def _shaped(flat: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Reshape, turning numpy's refusal of an unrepresentable shape into an IntegrityError."""
    try:
        return flat.reshape(shape)
    except ValueError as exc:
        raise IntegrityError(
            f"{where}: shape {list(shape)} cannot be held by numpy ({exc})"
        ) from None


class _Reader:
    """Bounds-checked cursor over a little-endian binary file."""

    def __init__(self, data: bytes, name: str) -> None:
        self.data = data
        self.name = name
        self.pos = 0

    @property
    def remaining(self) -> int:
        return len(self.data) - self.pos

    def need(self, nbytes: int, what: str) -> None:
        """Fail unless ``nbytes`` more bytes are present (checked before any allocation)."""
        if nbytes > self.remaining:
            raise IntegrityError(
                f"{self.name}: truncated at byte {self.pos}: {what} needs {nbytes} bytes, "
                f"only {self.remaining} remain"
            )

    def magic(self, expected: bytes) -> None:
        head = self.data[: len(expected)]
        if head != expected[: len(head)]:
            raise IntegrityError(
                f"{self.name}: wrong magic at byte 0: expected {expected!r}, found {head!r}"
            )
        self.need(len(expected), "the magic")
        self.pos = len(expected)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.data, self.pos)
        self.pos += 8
        return value

    def f32(self, count: int, what: str) -> np.ndarray:
        self.need(4 * count, what)
        flat = np.frombuffer(self.data, dtype="<f4", count=count, offset=self.pos)
        self.pos += 4 * count
        return flat.astype(np.float32)  # a copy in native order; bits are untouched

    def shape(self, where: str) -> tuple[int, ...]:
        rank = self.u64(f"{where} rank")
        # rank dims plus the element count; also bounds the loop below by the file's size
        self.need(8 * rank + 8, f"{where} dims and element count (rank {rank})")
        return tuple(self.u64(f"{where} dim {k}") for k in range(rank))

    def element_count(self, shape: tuple[int, ...], where: str) -> int:
        at = self.pos
        count = self.u64(f"{where} element count")
        if count != math.prod(shape):
            raise IntegrityError(
                f"{self.name}: {where} element count {count} at byte {at} does not match "
                f"its dims {list(shape)} (product {math.prod(shape)})"
            )
        return count

    def end(self) -> None:
        if self.remaining:
            raise IntegrityError(
                f"{self.name}: {self.remaining} trailing bytes after the last record, "
                f"starting at byte {self.pos}"
            )


def _u64(value: object, what: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise FormatError(f"{what} must be an integer, got {type(value).__name__}")
    if not 0 <= int(value) < _U64_LIMIT:
        raise FormatError(f"{what} = {value} does not fit in an unsigned 64-bit field")
    return _U64.pack(int(value))


def _shape_bytes(shape: Sequence[int], where: str) -> bytes:
    parts = [_u64(len(shape), f"{where} rank")]
    parts += [_u64(d, f"{where} dim {k}") for k, d in enumerate(shape)]
    parts.append(_u64(math.prod(int(d) for d in shape), f"{where} element count"))
    return b"".join(parts)


def _check_f32_array(arr: Any, where: str) -> None:
    if not isinstance(arr, np.ndarray):
        raise FormatError(f"{where}: expected a numpy float32 array, got {type(arr).__name__}")
    if arr.dtype.kind != "f" or arr.dtype.itemsize != 4:
        raise FormatError(f"{where}: expected dtype float32, got {arr.dtype}")


def _f32_bytes(arr: Any, where: str) -> bytes:
    _check_f32_array(arr, where)
    return np.ascontiguousarray(arr, dtype="<f4").tobytes()  # byte swap at most: bits kept


# --------------------------------------------------------------------------------------------
# Format 1: streamed float32 (TLSF32B)
# --------------------------------------------------------------------------------------------


def decode_sf32(data: bytes | bytearray | memoryview) -> list[np.ndarray]:
    """Decode the contents of a ``TLSF32B`` file into float32 arrays (bits exact)."""
    r = _Reader(bytes(data), "TLSF32B")
    r.magic(SF32_MAGIC)
    version = r.u64("the version")
    if version != SF32_VERSION:
        raise IntegrityError(f"TLSF32B: unsupported version {version} at byte 7; expected 1")
    at = r.pos
    count = r.u64("the tensor count")
    if 16 * count > r.remaining:  # every tensor needs at least a rank and an element count
        raise IntegrityError(
            f"TLSF32B: tensor count {count} at byte {at} needs at least {16 * count} more "
            f"bytes, only {r.remaining} remain"
        )
    tensors = []
    for i in range(count):
        where = f"tensor {i}"
        shape = r.shape(where)
        n = r.element_count(shape, where)
        tensors.append(_shaped(r.f32(n, f"{where} payload ({n} float32)"), shape, where))
    r.end()
    return tensors


def read_sf32(source: str | os.PathLike[str] | bytes | bytearray | memoryview) -> list[np.ndarray]:
    """Read a ``TLSF32B`` file from a path, or decode it from bytes."""
    return decode_sf32(_load(source, "read_sf32"))


def _sf32_chunks(tensors: Sequence[np.ndarray]) -> Iterator[bytes]:
    for i, t in enumerate(tensors):  # validate everything before the first byte is produced
        _check_f32_array(t, f"tensor {i}")
    yield SF32_MAGIC + _U64.pack(SF32_VERSION) + _u64(len(tensors), "tensor count")
    for i, t in enumerate(tensors):
        yield _shape_bytes(t.shape, f"tensor {i}")
        yield _f32_bytes(t, f"tensor {i}")


def encode_sf32(tensors: Sequence[np.ndarray]) -> bytes:
    """Encode float32 arrays as a ``TLSF32B`` file; other dtypes raise :class:`FormatError`."""
    return b"".join(_sf32_chunks(tensors))


def write_sf32(path: str | os.PathLike[str], tensors: Sequence[np.ndarray]) -> None:
    """Write a ``TLSF32B`` file atomically, one tensor payload at a time."""
    chunks = _sf32_chunks(tensors)
    first = next(chunks)  # runs the validation before the file is created
    atomic_write(path, _prepend(first, chunks), SF32_FILE)


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


# --------------------------------------------------------------------------------------------
# Format 2: JSON state
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLFormatTag:
    """A parsed JSON state format tag; build one with :func:`parse_tag`."""

    kind: str  # "binary64" | "float32" | "binary" | "complex"
    exponent_bits: int | None = None
    fraction_bits: int | None = None
    bias: int | None = None
    encoding: str | None = None
    component: TLFormatTag | None = None

    def __post_init__(self) -> None:
        if self.kind in ("binary64", "float32"):
            ok = self.exponent_bits is self.fraction_bits is self.bias is self.encoding is None
            ok = ok and self.component is None
        elif self.kind == "binary":
            e, f, b = self.exponent_bits, self.fraction_bits, self.bias
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (e, f, b))
            ok = ok and e >= 2 and f >= 1 and 1 + e + f <= 64  # type: ignore[operator]
            ok = ok and self.encoding in STATE_ENCODINGS and self.component is None
        elif self.kind == "complex":
            ok = isinstance(self.component, TLFormatTag) and self.component.kind != "complex"
            ok = ok and self.exponent_bits is self.fraction_bits is self.bias is None
            ok = ok and self.encoding is None
        else:
            ok = False
        if not ok:
            raise FormatError(f"impossible TorchLean format tag fields: {self!r}")

    @property
    def width(self) -> int:
        """Bits per scalar storage word (for complex: per component)."""
        if self.kind == "binary64":
            return 64
        if self.kind == "float32":
            return 32
        if self.kind == "binary":
            return 1 + self.exponent_bits + self.fraction_bits  # type: ignore[operator]
        return self.component.width  # type: ignore[union-attr]

    @property
    def word_dtype(self) -> np.dtype:
        """Smallest unsigned numpy dtype holding one storage word."""
        for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
            if self.width <= 8 * np.dtype(dt).itemsize:
                return np.dtype(dt)
        raise AssertionError("width exceeds 64")  # pragma: no cover - excluded by validation

    @property
    def tag(self) -> str:
        """The canonical tag string."""
        if self.kind == "binary64":
            return _TAG_BINARY64
        if self.kind == "float32":
            return _TAG_FLOAT32
        if self.kind == "binary":
            return (
                f"torchlean_state_binary_{self.exponent_bits}_{self.fraction_bits}_"
                f"{self.bias}_{self.encoding}_v1"
            )
        return f"{_COMPLEX_PREFIX}{self.component.tag})"  # type: ignore[union-attr]


def parse_tag(tag: str) -> TLFormatTag:
    """Parse a JSON state format tag; unknown or non-canonical spellings raise FormatError."""
    if not isinstance(tag, str):
        raise FormatError(f"format tag must be a string, got {type(tag).__name__}")
    if tag == _TAG_BINARY64:
        return TLFormatTag("binary64")
    if tag == _TAG_FLOAT32:
        return TLFormatTag("float32")
    m = _BINARY_RE.fullmatch(tag)
    if m:
        e, f, bias = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if m.group(3) == "-0":
            raise FormatError(f"format tag {tag!r}: bias must be written '0', not '-0'")
        if e < 2 or f < 1 or 1 + e + f > 64:
            raise FormatError(
                f"format tag {tag!r}: needs exponent bits >= 2, fraction bits >= 1 and "
                f"1 + e + f <= 64 (got e={e}, f={f})"
            )
        return TLFormatTag("binary", e, f, bias, m.group(4))
    if tag.startswith(_COMPLEX_PREFIX) and tag.endswith(")"):
        inner = tag[len(_COMPLEX_PREFIX) : -1]
        if inner.startswith(_COMPLEX_PREFIX):
            raise FormatError(f"format tag {tag!r}: nested complex tags are not supported")
        return TLFormatTag("complex", component=parse_tag(inner))
    raise FormatError(f"unknown TorchLean state format tag {tag!r}")


def binary_tag(e: int, f: int, bias: int, encoding: str) -> str:
    """The tag of a configured binary format: ``torchlean_state_binary_{e}_{f}_{bias}_{enc}_v1``."""
    return TLFormatTag("binary", e, f, bias, encoding).tag


def complex_tag(component_tag: str) -> str:
    """The tag of complex values whose coordinates use ``component_tag`` (itself not complex)."""
    component = parse_tag(component_tag)
    if component.kind == "complex":
        raise FormatError(f"complex component tag {component_tag!r} must not itself be complex")
    return TLFormatTag("complex", component=component).tag


@dataclass(eq=False)
class TLState:
    """JSON model state: raw storage words per tensor.

    Each tensor has dtype ``parse_tag(tag).word_dtype`` and the tensor's shape; complex tensors
    carry an extra trailing axis of length 2 holding ``(re, im)`` component words.
    """

    tag: str
    tensors: list[np.ndarray]


class _NotNat:
    """Stand-in for a JSON number that is not an integer literal (or NaN/Infinity)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise IntegrityError(f"JSON state: duplicate key {key!r} in an object")
        obj[key] = value
    return obj


def _show(value: Any) -> str:
    if isinstance(value, _NotNat):
        text = value.text
    elif isinstance(value, list):
        text = "[" + ",".join(_show(v) for v in value[:4]) + (",...]" if len(value) > 4 else "]")
    elif isinstance(value, dict):
        text = "{...}"
    else:
        text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _keys(obj: Any, expected: tuple[str, ...], where: str) -> None:
    if not isinstance(obj, dict):
        raise IntegrityError(f"JSON state: {where} must be an object, got {_json_type(obj)}")
    if set(obj) != set(expected):
        missing = [k for k in expected if k not in obj]
        extra = sorted(k for k in obj if k not in expected)
        raise IntegrityError(
            f"JSON state: {where} must have exactly the keys {list(expected)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )


def _json_type(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return {dict: "an object", list: "an array", str: "a string", int: "an integer"}.get(
        type(value), "a non-integer number"
    )


def _check_words(words: list[Any], width: int, where: str, pairs: bool) -> None:
    limit = 1 << width
    for j, w in enumerate(words):
        if type(w) is not int or w < 0 or w >= limit:
            at = f"value {j // 2} {'im' if j % 2 else 're'}" if pairs else f"value {j}"
            kind = "natural number" if type(w) is not int or w < 0 else f"{width}-bit word"
            raise FormatError(
                f"JSON state: {where} {at}: {_show(w)} is not a {kind}"
                + ("" if type(w) is not int or w < 0 else f" (must be < 2^{width})")
            )


def _noncanonical_nan(words: np.ndarray, tag: TLFormatTag) -> int | None:
    """Flat index of the first NaN word a native tag does not allow, or None."""
    native = tag.component if tag.kind == "complex" else tag
    if native is None or native.kind not in ("binary64", "float32"):
        return None
    width = native.width
    exp, frac = (np.array(x, dtype=words.dtype) for x in _NAN_FIELDS[width])
    flat = words.reshape(-1)
    bad = ((flat & exp) == exp) & ((flat & frac) != 0) & (flat != _CANONICAL_NAN[width])
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def _nan_message(tag: TLFormatTag, where: str, index: int, word: int) -> str:
    if tag.kind == "complex":
        at = f"value {index // 2} {'im' if index % 2 else 're'}"
    else:
        at = f"value {index}"
    digits = tag.width // 4 + 2
    return (
        f"{where} {at}: word {word:#0{digits}x} is a non-canonical NaN; under {tag.tag!r} "
        f"the only NaN word is {_CANONICAL_NAN[tag.width]:#0{digits}x}"
    )


def decode_state_json(data: bytes | bytearray | memoryview | str) -> TLState:
    """Decode JSON state from its content (UTF-8 bytes, or already-decoded text)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise IntegrityError(f"JSON state: not UTF-8 at byte {exc.start}") from None
    elif isinstance(data, str):
        text = data
    else:
        raise TypeError(f"decode_state_json: expected bytes or str, got {type(data).__name__}")
    try:
        top = json.loads(
            text, parse_float=_NotNat, parse_constant=_NotNat, object_pairs_hook=_unique_keys
        )
    except json.JSONDecodeError as exc:
        raise IntegrityError(
            f"JSON state: invalid JSON at line {exc.lineno} column {exc.colno} "
            f"(char {exc.pos}): {exc.msg}"
        ) from None
    except ValueError as exc:  # e.g. an integer literal longer than Python's digit limit
        raise FormatError(f"JSON state: unreadable number ({exc})") from None
    except RecursionError:
        raise IntegrityError("JSON state: JSON nested too deeply") from None
    _keys(top, ("format", "state"), "the top level")
    if not isinstance(top["format"], str):
        raise IntegrityError(f"JSON state: 'format' must be a string, got {_show(top['format'])}")
    tag = parse_tag(top["format"])
    if not isinstance(top["state"], list):
        raise IntegrityError(
            f"JSON state: 'state' must be an array, got {_json_type(top['state'])}"
        )
    tensors = [_decode_tensor(item, tag, i) for i, item in enumerate(top["state"])]
    return TLState(tag.tag, tensors)


def _decode_tensor(item: Any, tag: TLFormatTag, i: int) -> np.ndarray:
    where = f"tensor {i}"
    _keys(item, ("shape", "values"), where)
    shape, values = item["shape"], item["values"]
    if not isinstance(shape, list):
        raise IntegrityError(f"JSON state: {where} shape must be an array, got {_show(shape)}")
    for k, d in enumerate(shape):
        if type(d) is not int or d < 0:
            raise IntegrityError(
                f"JSON state: {where} dim {k} must be a natural number, got {_show(d)}"
            )
    if not isinstance(values, list):
        raise IntegrityError(f"JSON state: {where} values must be an array, got {_show(values)}")
    size = math.prod(shape)
    if len(values) != size:
        raise IntegrityError(
            f"JSON state: {where} shape {shape} holds {size} scalars but values has {len(values)}"
        )
    pairs = tag.kind == "complex"
    if pairs:
        for j, pair in enumerate(values):
            if not isinstance(pair, list) or len(pair) != 2:
                raise IntegrityError(
                    f"JSON state: {where} value {j} must be a [re, im] pair, got {_show(pair)}"
                )
        words = [w for pair in values for w in pair]
    else:
        words = values
    _check_words(words, tag.width, where, pairs)
    flat = np.array(words, dtype=np.uint64).astype(tag.word_dtype)
    bad = _noncanonical_nan(flat, tag)
    if bad is not None:
        raise FormatError(_nan_message(tag, f"JSON state: {where}", bad, int(flat[bad])))
    return _shaped(flat, tuple(shape) + ((2,) if pairs else ()), f"JSON state: {where}")


def read_state_json(source: str | os.PathLike[str] | bytes | bytearray | memoryview) -> TLState:
    """Read JSON state. ``str``/PathLike is a *path*; bytes are the file's UTF-8 content.

    For JSON text held in a ``str`` use :func:`decode_state_json`.
    """
    if isinstance(source, str) and source.lstrip().startswith("{"):
        raise TypeError("read_state_json takes a path or bytes; use decode_state_json for text")
    return decode_state_json(_load(source, "read_state_json"))


def encode_state_json(state: TLState) -> bytes:
    """Encode JSON state deterministically (compact separators, keys in canonical order)."""
    tag = parse_tag(state.tag)
    pairs = tag.kind == "complex"
    limit = 1 << tag.width
    items = []
    for i, t in enumerate(state.tensors):
        where = f"tensor {i}"
        if not isinstance(t, np.ndarray) or t.dtype.kind != "u":
            dtype = t.dtype if isinstance(t, np.ndarray) else type(t).__name__
            raise FormatError(f"{where}: expected an unsigned-integer word array, got {dtype}")
        if pairs and (t.ndim == 0 or t.shape[-1] != 2):
            raise FormatError(
                f"{where}: complex words need a trailing axis of length 2, got shape {t.shape}"
            )
        flat = t.reshape(-1)
        if flat.size and int(flat.max()) >= limit:
            j = int(np.argmax(flat >= limit)) if limit < _U64_LIMIT else 0
            raise FormatError(
                f"{where}: word {int(flat[j])} at flat index {j} does not fit {tag.width} bits"
            )
        bad = _noncanonical_nan(flat.astype(np.uint64), tag)
        if bad is not None:
            raise FormatError(_nan_message(tag, where, bad, int(flat[bad])))
        shape = list(t.shape[:-1] if pairs else t.shape)
        values = t.reshape(-1, 2).tolist() if pairs else flat.tolist()
        items.append({"shape": [int(d) for d in shape], "values": values})
    text = json.dumps({"format": tag.tag, "state": items}, separators=(",", ":"))
    return text.encode("ascii")


def write_state_json(path: str | os.PathLike[str], state: TLState) -> None:
    """Write JSON state atomically (the bytes of :func:`encode_state_json`)."""
    atomic_write(path, [encode_state_json(state)], STATE_JSON_FILE)


# --------------------------------------------------------------------------------------------
# Format 3: Adam optimizer state (TLADAMF)
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class TLAdamParam:
    """One parameter slot of the optimizer's schema.

    ``alias`` is the raw version-3+ tag: 0 = frozen, ``k`` = shares the history of param ``k-1``
    (``k-1`` equal to this param's own index means it owns its history); ``None`` in version 2.
    """

    shape: tuple[int, ...]
    requires_grad: bool
    alias: int | None = None


@dataclass(eq=False)
class TLAdamEntry:
    """Moments of one history-owning parameter: float32 ``m`` and ``v`` shaped like the param."""

    id: int
    step: int
    m: np.ndarray
    v: np.ndarray


@dataclass(eq=False)
class TLAdamFile:
    """A decoded ``TLADAMF`` file. ``hyper_bits`` (binary64 words of beta1, beta2, eps,
    weight_decay) are what gets written; the float fields must agree with them."""

    version: int
    kind: str  # "adam" | "adamw"
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    hyper_bits: tuple[int, int, int, int]
    random_counter: int | None  # version 4 only
    params: list[TLAdamParam]
    entries: list[TLAdamEntry]

    def representative(self, index: int) -> int | None:
        """Index of the param owning ``params[index]``'s history, or None if it is frozen."""
        p = self.params[index]
        if self.version < 3:
            return index if p.requires_grad else None
        return None if not p.alias else int(p.alias) - 1


def _float_of_bits(bits: int) -> float:
    return struct.unpack("<d", _U64.pack(bits))[0]


def _schema_problem(f: TLAdamFile) -> str | None:
    """First inconsistency of the param schema (the rules TorchLean's loader enforces)."""
    n = len(f.params)
    for i, p in enumerate(f.params):
        rep = f.representative(i)
        if rep is None:
            if p.requires_grad:
                return f"param {i} requires grad but has alias tag 0 (frozen)"
            continue
        if not p.requires_grad:
            return f"param {i} is frozen (requiresGrad 0) but has alias tag {p.alias}"
        if rep > i or rep >= n:
            return f"param {i} alias tag {p.alias} names param {rep}, which does not precede it"
        q = f.params[rep]
        if not q.requires_grad:
            return f"param {i} shares the history of param {rep}, which is frozen"
        if tuple(q.shape) != tuple(p.shape):
            return (
                f"param {i} shape {list(p.shape)} differs from its representative {rep}'s "
                f"shape {list(q.shape)}"
            )
        if f.representative(rep) != rep:
            return f"param {i} shares the history of param {rep}, which is itself an alias"
    return None


def decode_adam(data: bytes | bytearray | memoryview) -> TLAdamFile:
    """Decode the contents of a ``TLADAMF`` file (versions 2, 3, 4)."""
    r = _Reader(bytes(data), "TLADAMF")
    r.magic(ADAM_MAGIC)
    version = r.u64("the version")
    if version not in ADAM_VERSIONS:
        raise IntegrityError(
            f"TLADAMF: unsupported version {version} at byte 7; expected 2, 3 or 4"
        )
    at = r.pos
    kind = r.u64("the optimizer kind")
    if kind > 1:
        raise IntegrityError(
            f"TLADAMF: optimizer kind {kind} at byte {at} is neither 0 (adam) nor 1 (adamw)"
        )
    bits = tuple(r.u64(name) for name in ("beta1", "beta2", "eps", "weight_decay"))
    counter = r.u64("the random counter") if version >= 4 else None
    at = r.pos
    n = r.u64("the parameter count")
    per_param = 24 + (8 if version >= 3 else 0)  # rank, count, requiresGrad (+ alias tag)
    if per_param * n + 8 > r.remaining:
        raise IntegrityError(
            f"TLADAMF: parameter count {n} at byte {at} needs at least {per_param * n + 8} more "
            f"bytes, only {r.remaining} remain"
        )
    params = []
    for i in range(n):
        where = f"param {i}"
        shape = r.shape(where)
        r.element_count(shape, where)
        at = r.pos
        flag = r.u64(f"{where} requiresGrad")
        if flag > 1:
            raise IntegrityError(f"TLADAMF: {where} requiresGrad {flag} at byte {at} is not 0 or 1")
        params.append(TLAdamParam(shape, bool(flag)))
    if version >= 3:  # the alias map follows the whole schema, one tag per param
        for i, p in enumerate(params):
            p.alias = r.u64(f"param {i} alias tag")
    beta1, beta2, eps, weight_decay = (_float_of_bits(b) for b in bits)
    f = TLAdamFile(
        version=version,
        kind=_ADAM_KINDS[kind],
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        hyper_bits=(bits[0], bits[1], bits[2], bits[3]),
        random_counter=counter,
        params=params,
        entries=[],
    )
    problem = _schema_problem(f)
    if problem:
        raise IntegrityError(f"TLADAMF: {problem}")
    owners = [i for i in range(n) if f.representative(i) == i]
    at = r.pos
    count = r.u64("the entry count")
    if count != len(owners):
        raise IntegrityError(
            f"TLADAMF: entry count {count} at byte {at} differs from the {len(owners)} params "
            f"that own optimizer state"
        )
    seen: set[int] = set()
    for j in range(count):
        where = f"entry {j}"
        at = r.pos
        pid = r.u64(f"{where} id")
        step = r.u64(f"{where} step")
        n_el = r.u64(f"{where} element count")
        if pid >= n:
            raise IntegrityError(
                f"TLADAMF: {where} parameter id {pid} at byte {at} is out of range "
                f"(parameter count {n})"
            )
        if pid in seen:
            raise IntegrityError(f"TLADAMF: {where} repeats parameter id {pid} (byte {at})")
        if f.representative(pid) != pid:
            raise IntegrityError(
                f"TLADAMF: {where} parameter {pid} (byte {at}) owns no optimizer state "
                f"(frozen or aliased)"
            )
        if step == 0:
            raise IntegrityError(
                f"TLADAMF: {where} (parameter {pid}) has step t = 0 at byte "
                f"{at + 8}; steps start at 1"
            )
        shape = params[pid].shape
        if n_el != math.prod(shape):
            raise IntegrityError(
                f"TLADAMF: {where} element count {n_el} at byte {at + 16} does not match "
                f"parameter {pid} ({math.prod(shape)} elements)"
            )
        seen.add(pid)
        m = _shaped(r.f32(n_el, f"{where} m ({n_el} float32)"), shape, f"TLADAMF: {where}")
        v = _shaped(r.f32(n_el, f"{where} v ({n_el} float32)"), shape, f"TLADAMF: {where}")
        f.entries.append(TLAdamEntry(pid, step, m, v))
    r.end()
    return f


def read_adam(source: str | os.PathLike[str] | bytes | bytearray | memoryview) -> TLAdamFile:
    """Read a ``TLADAMF`` file from a path, or decode it from bytes."""
    return decode_adam(_load(source, "read_adam"))


def encode_adam(f: TLAdamFile) -> bytes:
    """Encode a ``TLADAMF`` file, validating version-specific fields and shapes."""
    if f.version not in ADAM_VERSIONS:
        raise FormatError(f"TLADAMF: cannot write version {f.version}; expected 2, 3 or 4")
    if f.kind not in _ADAM_KINDS:
        raise FormatError(f"TLADAMF: kind must be 'adam' or 'adamw', got {f.kind!r}")
    if len(f.hyper_bits) != 4:
        raise FormatError("TLADAMF: hyper_bits must hold four binary64 words")
    out = [ADAM_MAGIC, _U64.pack(f.version), _U64.pack(_ADAM_KINDS.index(f.kind))]
    names = ("beta1", "beta2", "eps", "weight_decay")
    for name, bits in zip(names, f.hyper_bits, strict=True):
        out.append(_u64(bits, f"TLADAMF: {name} bits"))
        value = getattr(f, name)
        if isinstance(value, bool) or not isinstance(value, (float, int)):
            raise FormatError(f"TLADAMF: {name} must be a float, got {type(value).__name__}")
        decoded = _float_of_bits(int(bits))
        same = struct.pack("<d", float(value)) == _U64.pack(int(bits))
        if not same and not (math.isnan(decoded) and math.isnan(value)):
            raise FormatError(
                f"TLADAMF: {name} = {value!r} disagrees with its bits {int(bits):#018x} "
                f"({decoded!r}); update hyper_bits too"
            )
    if f.version >= 4:
        if f.random_counter is None:
            raise FormatError("TLADAMF: version 4 needs random_counter")
        out.append(_u64(f.random_counter, "TLADAMF: random_counter"))
    elif f.random_counter is not None:
        raise FormatError(f"TLADAMF: version {f.version} has no random counter; set it to None")
    out.append(_u64(len(f.params), "TLADAMF: parameter count"))
    for i, p in enumerate(f.params):
        if not isinstance(p.requires_grad, (bool, np.bool_)):
            raise FormatError(f"TLADAMF: param {i} requires_grad must be a bool")
        if (p.alias is None) != (f.version < 3):
            need = "an alias tag" if f.version >= 3 else "alias None"
            raise FormatError(f"TLADAMF: version {f.version} needs {need} for param {i}")
        out.append(_shape_bytes(p.shape, f"TLADAMF: param {i}"))
        out.append(_U64.pack(int(bool(p.requires_grad))))
    if f.version >= 3:
        out += [_u64(p.alias, f"TLADAMF: param {i} alias") for i, p in enumerate(f.params)]
    problem = _schema_problem(f)
    if problem:
        raise FormatError(f"TLADAMF: {problem}")
    owners = {i for i in range(len(f.params)) if f.representative(i) == i}
    ids = [e.id for e in f.entries]
    if sorted(ids) != sorted(owners):
        raise FormatError(
            f"TLADAMF: entries must cover exactly the params owning optimizer state "
            f"{sorted(owners)} once each, got ids {ids}"
        )
    out.append(_U64.pack(len(f.entries)))
    for j, e in enumerate(f.entries):
        where = f"TLADAMF: entry {j} (parameter {e.id})"
        shape = tuple(f.params[e.id].shape)
        out.append(_u64(e.id, f"{where} id"))
        if isinstance(e.step, bool) or not isinstance(e.step, (int, np.integer)) or e.step < 1:
            raise FormatError(f"{where}: step must be an integer >= 1, got {e.step!r}")
        out.append(_u64(e.step, f"{where} step"))
        out.append(_U64.pack(math.prod(shape)))
        for name, arr in (("m", e.m), ("v", e.v)):
            _check_f32_array(arr, f"{where} {name}")
            if arr.shape != shape:
                raise FormatError(f"{where}: {name} has shape {arr.shape}, the param {shape}")
            out.append(_f32_bytes(arr, f"{where} {name}"))
    return b"".join(out)


def write_adam(path: str | os.PathLike[str], f: TLAdamFile) -> None:
    """Write a ``TLADAMF`` file atomically (the bytes of :func:`encode_adam`)."""
    atomic_write(path, [encode_adam(f)], ADAM_FILE)
