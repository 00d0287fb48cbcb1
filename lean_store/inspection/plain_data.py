"""A checkpoint's plain data: the JSON state trees beside its tensors (FORMAT.md 7), read for
``lean-store inspect`` and compared by ``lean-store diff``."""

from __future__ import annotations

import json
from typing import Any

from ..checkpoint import Checkpoint
from ..hardening import check_json_depth
from ..statetree import JSON_DEPTH
from .foreign import InputBlocks

PLAIN_DATA = ("training", "lightning", "dcp")
"""Root attributes holding a checkpoint's plain data as JSON state trees (FORMAT.md 7): the
step, trainer extras, optimizer hyperparameters, scheduler and RNG of a training checkpoint,
a checkpoint dict's epochs and hyperparameters, DCP's non-tensor items. Their tensors are
compared as tensors; the rest of the root attributes describe the storage (save id, writer,
manifests, digests) and differ between any two saves."""
_SHOWN = 20


def plain_data(side: Checkpoint | InputBlocks) -> dict[str, Any]:
    """The parsed :data:`PLAIN_DATA` attributes of a checkpoint, or of another file's
    conversion (a torch checkpoint dict carries ``lightning``)."""
    attrs = side.root_attrs if isinstance(side, Checkpoint) else side.extra
    out: dict[str, Any] = {}
    for key in PLAIN_DATA:
        value = attrs.get(key)
        if isinstance(value, str):
            check_json_depth(value, f"the {key!r} attribute", JSON_DEPTH)
            try:
                value = json.loads(value)
            except ValueError:
                pass  # compared as text
        if value is not None:
            out[key] = value
    return out


def metadata_diffs(a: Any, b: Any, path: str = "", out: list[str] | None = None) -> list[str]:
    """Where the JSON values ``a`` and ``b`` differ (``b`` against ``a``), a line each: the
    key path, then both values (at most :data:`_SHOWN` lines, then a count)."""
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            where = f"{path}/{key}" if path else str(key)
            if key not in b:
                out.append(f"{where}: only in the first ({_shown(a[key])})")
            elif key not in a:
                out.append(f"{where}: only in the second ({_shown(b[key])})")
            else:
                metadata_diffs(a[key], b[key], where, out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            metadata_diffs(x, y, f"{path}/{i}", out)
    elif a != b or type(a) is not type(b):
        out.append(f"{path}: {_shown(a)} != {_shown(b)}")
    if path == "" and len(out) > _SHOWN:
        out[_SHOWN:] = [f"... and {len(out) - _SHOWN} more"]
    return out


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["PLAIN_DATA", "metadata_diffs", "plain_data"]
