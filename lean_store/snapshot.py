"""A frozen copy of a state, taken before a background save returns (see ``SaveOptions``).

``"device"``: a copy next to each tensor; ``"host"``: device tensors copied into host memory;
``"auto"``: ``"device"`` when every CUDA device has room, else ``"host"``; ``"none"``: no copy
(the caller must not modify the state until the save is done). See :mod:`lean_store.async_save`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .encoded import Encoded
from .errors import CheckpointError

SNAPSHOTS = ("auto", "device", "host", "none")


def snapshot_of(obj: Any, mode: str) -> Any:
    """A frozen copy of the state of ``obj`` (see the module docstring for ``mode``)."""
    if mode not in SNAPSHOTS:
        raise CheckpointError(f"unknown snapshot {mode!r}; use one of {SNAPSHOTS}")
    if mode == "none":
        return obj
    from .sources import is_torch_state

    if is_torch_state(obj):
        from .sources.torch_source import snapshot_state

        return snapshot_state(obj, mode)
    if not isinstance(obj, Mapping):
        return obj  # tensor_source has already rejected it
    out: dict[str, Any] = {}
    for name, value in obj.items():
        if isinstance(value, Encoded):
            out[name] = Encoded(value.bits.copy(), value.format)
        elif isinstance(value, (np.ndarray, np.generic)):
            out[name] = np.array(value, copy=True)
        else:
            out[name] = value
    return out


__all__ = ["SNAPSHOTS", "snapshot_of"]
