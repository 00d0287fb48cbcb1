"""A faithful, pickle-free codec for small state trees (scheduler, RNG, data position, extras).

A tree of ``None``, bools, ints, floats, strings, lists, tuples, dicts, numpy arrays/scalars and
torch tensors becomes JSON text plus a set of tensors that are stored as ordinary datasets.
Everything JSON cannot say exactly is tagged with a one-key object:

``{"$int": "123..."}`` (beyond 2**53), ``{"$float": "nan" | "inf" | "-inf"}``,
``{"$tuple": [...]}``, ``{"$dict": [[key, value], ...]}`` (non-string keys or keys starting
with ``$``), ``{"$array": name}`` / ``{"$scalar": name}`` (numpy), ``{"$tensor": name}`` (torch).
Decoding is the exact inverse. Anything else is refused with a :class:`CheckpointError`.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import CheckpointError, IntegrityError
from .naming import MAX_NAME_LENGTH, MAX_NODE_BYTES, node_name

EXACT_INT = 1 << 53
MAX_DEPTH = 64
JSON_DEPTH = 3 * MAX_DEPTH + 16
"""How deep the JSON text of a tree of at most MAX_DEPTH levels can nest (a ``$dict`` level is
three: object, list of pairs, pair), with the few levels of the attribute around it."""
_TAGS = ("$int", "$float", "$tuple", "$dict", "$array", "$scalar", "$tensor")


def _is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def storable_name(path: str) -> str:
    """The tensor name of the value at ``path``: the path itself, or, where its node name
    would not fit one path component (a Lightning callback's state key, such as
    ``ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', ...}``, escapes to far more
    than 255 bytes), as much of its start as fits, then ``~`` and the first 16 hex digits of
    the SHA-256 of the whole path. The tree names the tensor, so any unique name reads back."""
    if len(path) <= MAX_NAME_LENGTH and len(node_name(path)) <= MAX_NODE_BYTES:
        return path
    digest = hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    keep = path[:MAX_NODE_BYTES]
    while keep and len(node_name(f"{keep}~{digest}")) > MAX_NODE_BYTES:
        keep = keep[:-4]
    return f"{keep}~{digest}"


def encode(value: Any, path: str, tensors: dict[str, Any], depth: int = 0) -> Any:
    """JSON-able form of ``value``; arrays and tensors go to ``tensors`` under ``path/...``."""
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{path}: state nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -EXACT_INT < value < EXACT_INT else {"$int": str(int(value))}
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, np.ndarray):
        name = storable_name(path)
        tensors[name] = value
        return {"$array": name}
    if isinstance(value, np.generic):
        name = storable_name(path)
        tensors[name] = np.asarray(value)
        return {"$scalar": name}
    if _is_torch_tensor(value):
        name = storable_name(path)
        tensors[name] = value.detach()
        return {"$tensor": name}
    if isinstance(value, list):
        return [encode(v, f"{path}/{i}", tensors, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        items = [encode(v, f"{path}/{i}", tensors, depth + 1) for i, v in enumerate(value)]
        return {"$tuple": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, f"{path}/{k}", tensors, depth + 1) for k, v in value.items()}
        return {
            "$dict": [
                [encode(k, f"{path}/key{i}", tensors, depth + 1),
                 encode(v, f"{path}/{i}", tensors, depth + 1)]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    raise CheckpointError(
        f"{path}: cannot store a {type(value).__name__} without pickle; state may hold only "
        "None, bools, numbers, strings, lists, tuples, dicts, numpy arrays and torch tensors"
    )


def decode(data: Any, lookup: Callable[[str, str], Any], where: str = "state",
           depth: int = 0) -> Any:
    """Inverse of :func:`encode`. ``lookup(kind, name)`` returns the stored tensor, where kind is
    ``"array"``, ``"scalar"`` or ``"tensor"``. Malformed input raises IntegrityError."""
    if depth > MAX_DEPTH:
        raise IntegrityError(f"{where}: state nested deeper than {MAX_DEPTH} levels")
    if data is None or isinstance(data, (bool, str, int, float)):
        return data
    if isinstance(data, list):
        return [decode(v, lookup, where, depth + 1) for v in data]
    if not isinstance(data, dict):
        raise IntegrityError(f"{where}: unexpected JSON value {data!r}")
    if len(data) == 1:
        ((key, inner),) = data.items()
        if key in _TAGS:
            return _decode_tagged(key, inner, lookup, where, depth)
    if any(k.startswith("$") for k in data):
        raise IntegrityError(f"{where}: malformed tagged value {sorted(data)}")
    return {k: decode(v, lookup, where, depth + 1) for k, v in data.items()}


def _decode_tagged(tag: str, inner: Any, lookup: Callable[[str, str], Any], where: str,
                   depth: int) -> Any:
    try:
        if tag == "$int":
            if not isinstance(inner, str) or len(inner) > 4000:
                raise ValueError(inner)
            return int(inner)
        if tag == "$float":
            if inner not in ("nan", "inf", "-inf"):
                raise ValueError(inner)
            return float(inner)
        if tag == "$tuple":
            if not isinstance(inner, list):
                raise ValueError(inner)
            return tuple(decode(v, lookup, where, depth + 1) for v in inner)
        if tag == "$dict":
            if not isinstance(inner, list) or not all(
                isinstance(p, list) and len(p) == 2 for p in inner
            ):
                raise ValueError(inner)
            return {
                _hashable(decode(k, lookup, where, depth + 1)): decode(v, lookup, where, depth + 1)
                for k, v in inner
            }
        if not isinstance(inner, str):
            raise ValueError(inner)
        return lookup(tag[1:], inner)
    except (ValueError, TypeError) as exc:
        raise IntegrityError(f"{where}: malformed {tag} value ({exc})") from None


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise TypeError(f"unhashable dict key {key!r}")
    return key


def tensor_names(data: Any, depth: int = 0) -> list[tuple[str, str]]:
    """Every ``(kind, name)`` a decoded tree will ask for, without decoding it."""
    out: list[tuple[str, str]] = []
    if depth > MAX_DEPTH:
        return out
    if isinstance(data, list):
        for v in data:
            out.extend(tensor_names(v, depth + 1))
    elif isinstance(data, dict):
        if len(data) == 1:
            ((key, inner),) = data.items()
            if key in ("$array", "$scalar", "$tensor") and isinstance(inner, str):
                return [(key[1:], inner)]
        for v in data.values():
            out.extend(tensor_names(v, depth + 1))
    return out


__all__ = ["decode", "encode", "tensor_names"]
