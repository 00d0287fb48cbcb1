"""torch's ``float4_e2m1fn_x2``: two FP4 (E2M1, the OCP MX element type) values packed in each
byte, stored as the ``float4_e2m1fn`` values they hold.

torch defines the byte's layout (``torch/headeronly/util/Float4_e2m1fn_x2.h``): of two values
``val0, val1`` in a row, ``val0`` is bits 0-3 and ``val1`` bits 4-7. A tensor of shape
``(..., n)`` holds ``(..., 2n)`` values (a 0-d one: 2), and lean_store stores exactly those,
in that order, as a ``float4_e2m1fn`` tensor: readers see FP4 values (numpy's
``ml_dtypes.float4_e2m1fn``), the words round-trip bit for bit, and safetensors' ``F4``
uses the same shape and order. Loading into (or ``like=``) such a tensor packs them again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..chunking import Region
from ..errors import IntegrityError
from ..formats import ScalarFormat, get, pack, unpack

PACKED = getattr(torch, "float4_e2m1fn_x2", None)  # torch 2.8+
FORMAT: ScalarFormat = get("float4_e2m1fn")


def is_packed(value: Any) -> bool:
    """A torch tensor of ``float4_e2m1fn_x2``."""
    return PACKED is not None and isinstance(value, torch.Tensor) and value.dtype == PACKED


def values_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the values a packed tensor of ``shape`` holds."""
    return shape[:-1] + (2 * shape[-1],) if shape else (2,)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(1) if t.dim() == 0 else t.view(torch.uint8)


def unpacked(t: torch.Tensor) -> torch.Tensor:
    """The FP4 words (one a byte, low nibble first) of packed tensor ``t``, where ``t`` is."""
    b = _bytes(t.detach())
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(values_shape(tuple(t.shape)))


def _check_words(words: np.ndarray) -> None:
    if words.size and int(words.max()) > 0xF:
        raise IntegrityError("a float4_e2m1fn word is wider than 4 bits")


def packed_tensor(words: np.ndarray, shape: tuple[int, ...], device: Any) -> torch.Tensor:
    """A new ``float4_e2m1fn_x2`` tensor of ``shape`` holding the FP4 ``words``."""
    assert PACKED is not None  # a packed tensor was asked for: this torch has the dtype
    _check_words(words)
    b = pack(words, FORMAT)  # the values in C order, two a byte: torch's layout
    out = torch.from_numpy(b).view(PACKED).reshape(shape)
    return out if device is None or str(device) == "cpu" else out.to(device)


def write_words(t: torch.Tensor, region: Region, words: np.ndarray) -> None:
    """Install the FP4 ``words`` of ``region`` (of the values' shape) into packed tensor ``t``:
    the bytes the region touches are read, their nibbles replaced, and written back, so a
    region that starts or ends inside a byte keeps the byte's other value."""
    _check_words(words)
    *lead, last = region
    start, stop = last.start or 0, last.stop
    lo, hi = start // 2, (stop + 1) // 2
    b = _bytes(t)
    box = (*lead, slice(lo, hi))
    host = b.device.type == "cpu"
    cur = b[box].numpy() if host else b[box].cpu().numpy()
    values = unpack(cur, FORMAT, cur.shape[:-1] + (2 * (hi - lo),))
    part = values[..., start - 2 * lo: stop - 2 * lo]
    part[...] = words.reshape(part.shape)
    with torch.no_grad():
        b[box].copy_(torch.from_numpy(pack(values, FORMAT).reshape(cur.shape)))
