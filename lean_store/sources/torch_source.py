"""torch modules, state dicts and tensors. The only module of lean_store that imports torch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..chunking import Region
from ..encoded import Encoded
from ..errors import CheckpointError, FormatError
from ..formats import ScalarFormat, complex_of, get
from ..layout import Entry, Layout
from .base import SourceTensor, TargetTensor, TensorSource
from .numpy_source import ArraySourceTensor, ArrayTarget, _format_of

_TAGS: dict[Any, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
              "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _TAGS[getattr(torch, _name)] = _name
_DTYPE_OF_TAG = {tag: dtype for dtype, tag in _TAGS.items()}
_UINT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def format_of_dtype(dtype: torch.dtype) -> ScalarFormat:
    """The lean_store format of a torch dtype (``torch.complex32`` is ``complex(float16)``)."""
    if dtype == torch.complex32:
        return complex_of(get("float16"))
    tag = _TAGS.get(dtype)
    if tag is None:
        raise FormatError(f"torch dtype {dtype} has no lean_store format")
    return get(tag)


def dtype_of_format(fmt: ScalarFormat) -> torch.dtype | None:
    if fmt == complex_of(get("float16")):
        return torch.complex32
    return _DTYPE_OF_TAG.get(fmt.tag)


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a signed-int tensor of equal width (complex: trailing axis of 2)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_UINT_VIEW[t.element_size()])


def _to_numpy_bits(t: torch.Tensor, fmt: ScalarFormat) -> np.ndarray:
    return t.numpy().view(fmt.storage_dtype)


class TorchSourceTensor(SourceTensor):
    def __init__(self, tensor: torch.Tensor, fmt: ScalarFormat) -> None:
        tensor = tensor.detach()
        self._fmt = fmt
        self._bits = bit_view(tensor.reshape(1) if tensor.dim() == 0 else tensor)
        self.device = str(tensor.device)

    def read(self, region: Region) -> np.ndarray:
        part = self._bits[region]
        if part.device.type != "cpu":
            part = part.to("cpu")
        return np.ascontiguousarray(_to_numpy_bits(part.contiguous(), self._fmt))


def state_dict_of(obj: Any) -> Mapping[str, Any]:
    """A module's ``state_dict()`` (persistent buffers in, non-persistent out), or the mapping."""
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict(keep_vars=False)
    if isinstance(obj, Mapping):
        return obj
    raise CheckpointError(f"cannot take torch state from a {type(obj).__name__}")


def _entry_format(name: str, value: Any) -> ScalarFormat:
    if isinstance(value, torch.Tensor):
        try:
            return format_of_dtype(value.dtype)
        except FormatError as exc:
            raise FormatError(f"tensor {name!r}: {exc}") from None
    if isinstance(value, (np.ndarray, Encoded)):
        return _format_of(name, value)
    raise CheckpointError(f"state entry {name!r} is a {type(value).__name__}, not a tensor")


class TorchSource(TensorSource):
    def __init__(self, obj: Any) -> None:
        state = state_dict_of(obj)
        self._values = dict(state)
        self.layout = Layout.from_specs(
            [(n, tuple(v.shape), _entry_format(n, v)) for n, v in self._values.items()]
        )

    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]:
        for entry in self.layout:
            value = self._values[entry.name]
            if isinstance(value, torch.Tensor):
                yield entry, TorchSourceTensor(value, entry.format)
            else:
                yield entry, ArraySourceTensor(value, entry.format)


class TorchTarget(TargetTensor):
    def __init__(self, entry: Entry, tensor: torch.Tensor) -> None:
        self.entry = entry
        tensor = tensor.detach()
        self._bits = bit_view(tensor.reshape(1) if tensor.dim() == 0 else tensor)

    def write(self, region: Region, bits: np.ndarray) -> None:
        src = torch.from_numpy(np.ascontiguousarray(bits).view(_np_int(bits.dtype.itemsize)))
        dst = self._bits[region]
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape), non_blocking=False)


def _np_int(itemsize: int) -> np.dtype:
    return np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize])


def torch_targets(obj: Any) -> dict[str, TargetTensor]:
    state = state_dict_of(obj)
    layout = Layout.from_specs([(n, tuple(v.shape), _entry_format(n, v)) for n, v in state.items()])
    targets: dict[str, TargetTensor] = {}
    for entry in layout:
        value = state[entry.name]
        if isinstance(value, torch.Tensor):
            targets[entry.name] = TorchTarget(entry, value)
        elif isinstance(value, np.ndarray):
            targets[entry.name] = ArrayTarget(entry, value)
        else:
            raise CheckpointError(f"target {entry.name!r} is not writable in place")
    return targets


def new_tensor(bits: np.ndarray, fmt: ScalarFormat, shape: tuple[int, ...], device: Any) -> Any:
    """A new torch tensor holding ``bits`` exactly, or an ``Encoded`` if torch has no dtype."""
    dtype = dtype_of_format(fmt)
    if dtype is None:
        return Encoded(bits, fmt)
    words = torch.from_numpy(np.ascontiguousarray(bits).view(_np_int(bits.dtype.itemsize)))
    probe = torch.empty(0, dtype=dtype)
    if probe.is_complex():
        real = words.view(torch.view_as_real(probe).dtype).reshape(shape + (2,))
        out = torch.view_as_complex(real.contiguous())
    else:
        out = words.view(dtype).reshape(shape)
    # ``bits`` is a fresh array owned by the caller, so the CPU tensor can share its memory.
    return out.to(device) if device is not None and str(device) != "cpu" else out
