"""safetensors files: a validating, memory-mapped reader and a streaming, deterministic writer.

The reader parses the header itself and maps the data buffer, so every dtype (bfloat16 and the
float8 types included) comes back as its exact raw words with no framework in between.

The writer produces the same bytes as ``safetensors.serialize`` (0.4 - 0.8) for the same tensors
and metadata: tensors are laid out by descending dtype (safetensors' own dtype order) and then by
name; the header lists ``__metadata__`` first, then the tensors in data order, as compact JSON
padded with spaces to a multiple of 8 bytes. safetensors itself writes metadata keys in a Rust
``HashMap`` order that changes from process to process, so this writer keeps the order it is
given, and a file read by :class:`SafetensorsSource` is written back with its own order.
Payloads are streamed tensor by tensor in row blocks, so memory stays bounded. The test suite
checks the bytes against the ``safetensors`` library for every dtype.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..chunking import iter_regions, plan_chunks
from ..errors import CheckpointError, FormatError, IntegrityError, UnsafeFileError
from ..formats import ScalarFormat, get, pack, unpack
from ..layout import Entry, Layout
from ..sources.base import SourceTensor, TensorSource
from ..stores.commit import Commit
from ..stores.target import FileKind
from .foreign import MAX_HEADER_BYTES, looks_like_safetensors

SAFETENSORS_FILE = FileKind("a safetensors file", looks_like_safetensors)
_BLOCK_BYTES = 8 << 20

# safetensors dtype name -> lean_store tag. "F8_E4M3" is torch's float8_e4m3fn.
DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F4": "float4_e2m1fn",  # packed two a byte, the first value in bits 0-3 (torch's order)
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}
# safetensors' Dtype enum order (the writer sorts by it, descending). F4/F6 sit between BOOL and
# U8; they are packed, F4 two values a byte (read and written), F6 four in three bytes (not).
_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
          "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
          "F64", "I64", "U64"]
_RANK = {name: i for i, name in enumerate(_ORDER)}
_DTYPE_OF_FORMAT: dict[ScalarFormat, str] = {get(tag): name for name, tag in DTYPES.items()}


def safetensors_dtype(fmt: ScalarFormat) -> str | None:
    """The safetensors dtype that holds ``fmt`` exactly, or None."""
    return _DTYPE_OF_FORMAT.get(fmt)


def unrepresentable(layout: Layout) -> list[str]:
    """One line per tensor whose format safetensors cannot hold."""
    out = []
    for e in layout:
        if safetensors_dtype(e.format) is None:
            out.append(f"{e.name!r}: {e.format.tag} ({e.format.width} bits) has no safetensors "
                       "dtype")
        elif e.format == _F4 and math.prod(e.shape) % 2:
            out.append(f"{e.name!r}: {math.prod(e.shape)} float4_e2m1fn values cannot be packed "
                       "two a byte (safetensors' F4 needs an even count)")
    return out


_F4 = get("float4_e2m1fn")


def _data_bytes(count: int, fmt: ScalarFormat) -> int:
    """Bytes of ``count`` values in a safetensors data buffer (F4: two a byte)."""
    if fmt == _F4:
        return count // 2
    return count * fmt.storage_dtype.itemsize * fmt.words_per_value


# ------------------------------------------------------------------------------------ reading


class MappedTensor(SourceTensor):
    """Regions of a tensor's words in a memory-mapped file."""

    def __init__(self, words: np.ndarray) -> None:
        self._words = words

    def read(self, region: Any) -> np.ndarray:
        return np.ascontiguousarray(self._words[region])


class SafetensorsSource(TensorSource):
    """The tensors of a safetensors file, in data order, as exact raw words (memory-mapped).

    ``metadata`` is the file's ``__metadata__`` (or None when it has none).
    """

    kind = "state"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        header, self.metadata, data_start, size = _read_header(self.path)
        specs = []
        self._spans: dict[str, tuple[int, int]] = {}
        for name, (dtype, shape, begin, end) in header:
            specs.append((name, shape, get(DTYPES[dtype])))
            self._spans[name] = (data_start + begin, data_start + end)
        try:
            self.layout = Layout.from_specs(specs)
        except CheckpointError as exc:
            raise IntegrityError(f"{self.path}: {exc}") from None
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None
        # kept whether or not there is any ("null"), so that a round trip gives the same bytes
        self.extra = {"safetensors_metadata": json.dumps(self.metadata)}

    def words(self, entry: Entry) -> np.ndarray:
        begin, end = self._spans[entry.name]
        fmt = entry.format
        shape = (entry.shape or (1,)) + ((2,) if fmt.words_per_value == 2 else ())
        if end == begin:
            return np.empty(shape, dtype=fmt.storage_dtype)
        assert self._map is not None
        raw = self._map[begin:end]
        if fmt == _F4:  # two values a byte, the first in bits 0-3: lean_store's packing
            return unpack(raw, fmt, shape)
        return raw.view(fmt.storage_dtype.newbyteorder("<")).reshape(shape)

    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]:
        for entry in self.layout:
            yield entry, MappedTensor(self.words(entry))

    def close(self) -> None:
        self._map = None


def _read_header(
    path: Path,
) -> tuple[list[tuple[str, tuple[str, tuple[int, ...], int, int]]], dict | None, int, int]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise IntegrityError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise UnsafeFileError(
                    f"{path}: header length {n} is impossible for a {size}-byte safetensors file"
                )
            text = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise IntegrityError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise IntegrityError(f"{path}: __metadata__ must map strings to strings")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise IntegrityError(
                f"{path}: tensor {name!r} needs exactly dtype, shape and data_offsets"
            )
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            hint = " (packed F6 dtypes are not supported)" if dtype in _RANK else ""
            raise FormatError(f"{path}: tensor {name!r} has dtype {dtype!r}{hint}")
        if not (isinstance(shape, list) and all(_nat(d) for d in shape)):
            raise IntegrityError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_nat(o) for o in offsets)):
            raise IntegrityError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
        fmt = get(DTYPES[dtype])
        nbytes = _data_bytes(math.prod(shape), fmt)
        if fmt == _F4 and math.prod(shape) % 2:
            raise IntegrityError(f"{path}: tensor {name!r} holds an odd number of F4 values")
        if offsets[1] - offsets[0] != nbytes:
            raise IntegrityError(
                f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but "
                f"{dtype}{shape} needs {nbytes}"
            )
        entries.append((name, (dtype, tuple(shape), offsets[0], offsets[1])))
    entries.sort(key=lambda item: (item[1][2], item[1][3]))
    at = 0
    for name, (_, _, begin, end) in entries:
        if begin != at:
            raise IntegrityError(f"{path}: tensor {name!r} starts at {begin}, expected {at}")
        at = end
    data_start = 8 + n
    if data_start + at != size:
        raise IntegrityError(
            f"{path}: the data buffer holds {size - data_start} bytes but the tensors cover {at}"
        )
    return entries, metadata, data_start, size


def _nat(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------------------------ writing


def header_bytes(
    entries: list[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str] | None
) -> bytes:
    """The length-prefixed, space-padded header for ``(name, dtype, shape, nbytes)`` entries
    already in data order."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    at = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def data_order(layout: Layout) -> list[Entry]:
    """Entries in the order safetensors lays out their data: dtype descending, then name."""
    return sorted(
        layout,
        key=lambda e: (-_RANK[_DTYPE_OF_FORMAT[e.format]], e.name.encode("utf-8", "surrogatepass")),
    )


def write_safetensors(
    source: TensorSource,
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    progress: Any = None,
) -> None:
    """Write ``source`` as a safetensors file, atomically (a :class:`Commit`: a temporary
    sibling, fsynced, renamed into place, then the directory fsynced).

    Formats safetensors cannot hold are refused with a FormatError before anything is written.
    Only a safetensors file is replaced: a directory, a link or another kind of file at ``path``
    raises :class:`~lean_store.errors.ForeignPathError` and is left untouched.
    """
    problems = unrepresentable(source.layout)
    if problems:
        raise FormatError(
            "safetensors cannot hold these tensors exactly (lean_store never casts):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError("safetensors metadata must map strings to strings")
    order = data_order(source.layout)
    header = header_bytes(
        [(e.name, _DTYPE_OF_FORMAT[e.format], e.shape, _data_bytes(math.prod(e.shape), e.format))
         for e in order], metadata
    )
    tensors = dict(source.tensors())
    by_name = {e.name: e for e in tensors}
    with Commit.local(path, directory=False, kind=SAFETENSORS_FILE) as commit:
        with open(commit.work, "wb") as f:
            f.write(header)
            for entry in order:
                src = tensors[by_name[entry.name]]
                for words in _blocks(entry, src):
                    f.write(words.astype(words.dtype.newbyteorder("<"), copy=False).tobytes())
                    if progress is not None:
                        progress.advance(words.nbytes)
        commit.commit()


def _blocks(entry: Entry, src: SourceTensor) -> Iterator[np.ndarray]:
    shape = entry.shape or (1,)
    fmt = entry.format
    if fmt == _F4:  # packed two a byte across the whole tensor: read whole (a byte per value)
        yield pack(src.read(tuple(slice(0, d) for d in shape)), fmt)
        return
    itemsize = fmt.storage_dtype.itemsize * fmt.words_per_value
    for region in iter_regions(shape, plan_chunks(shape, itemsize, _BLOCK_BYTES)):
        yield np.ascontiguousarray(src.read(region))


__all__ = [
    "DTYPES", "SAFETENSORS_FILE", "SafetensorsSource", "data_order", "header_bytes",
    "safetensors_dtype", "unrepresentable", "write_safetensors",
]
