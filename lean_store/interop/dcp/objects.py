"""DCP's non-tensor values (``BYTE_IO`` items) as plain JSON, never pickle unless asked.

DCP hands every non-tensor state entry (a step count, a learning rate, a config dict) to the
storage layer serialised with ``torch.save``. lean_store stores the *value* instead: plain data
(None, bools, numbers, strings, lists, tuples, dicts of these) is written as JSON with the tags
of :mod:`lean_store.statetree` (``$tuple``, ``$int``, ``$float``, ``$dict``), so tuples, big
ints and NaN come back exactly. Anything else is refused with a :class:`CheckpointError` naming
the key, unless the writer's ``allow_pickle`` option is set; then the ``torch.save`` bytes are
kept (base64), and only a reader with ``allow_pickle`` set hands them to DCP, which unpickles
them. lean_store itself never pickles or unpickles anything.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

from ...errors import CheckpointError, IntegrityError
from ...hardening import check_json_depth
from ...statetree import JSON_DEPTH, decode, encode

ROOT_ATTR = "dcp"  # root attribute: {"version": 1, "objects": {key: record}}
VERSION = 1
MAX_TEXT = 64 << 20


def encode_object(key: str, value: Any, pickled: bytes | None, allow_pickle: bool) -> dict:
    """The stored record of one non-tensor value: ``{"json": ...}`` or ``{"pickle": base64}``.
    ``pickled``: DCP's ``torch.save`` bytes of it (kept only with ``allow_pickle``)."""
    tensors: dict[str, Any] = {}
    try:
        data = encode(value, key, tensors)
        if not tensors:
            return {"json": data}
        reason = "it holds tensors or arrays inside a non-tensor value"
    except CheckpointError as exc:
        reason = str(exc).split(";")[0]
    if allow_pickle and pickled is not None:
        return {"pickle": base64.b64encode(pickled).decode("ascii")}
    raise CheckpointError(
        f"state entry {key!r} ({type(value).__name__}) cannot be stored without pickle "
        f"({reason}): lean_store.interop.dcp stores tensors and plain data (None, bools, numbers, "
        "strings, lists, tuples, dicts); to keep it as torch.save bytes, set allow_pickle to "
        "True on lean_store.interop.dcp.StorageWriter"
    )


def parse_objects(text: Any, where: str) -> dict[str, dict]:
    """The ``dcp`` root attribute, checked: key -> record."""
    if text is None:
        return {}
    if isinstance(text, str) and len(text) <= MAX_TEXT:
        check_json_depth(text, f"{where}: the {ROOT_ATTR} attribute", JSON_DEPTH)
    try:
        meta = json.loads(text) if isinstance(text, str) and len(text) <= MAX_TEXT else text
    except ValueError as exc:
        raise IntegrityError(f"{where}: the {ROOT_ATTR} attribute is not JSON ({exc})") from None
    objects = meta.get("objects") if isinstance(meta, dict) else None
    if not isinstance(objects, dict) or not all(
        isinstance(r, dict) and len(r) == 1 and ("json" in r or "pickle" in r)
        for r in objects.values()
    ):
        raise IntegrityError(f"{where}: malformed {ROOT_ATTR} attribute")
    return objects


def _no_tensors(kind: str, name: str) -> Any:
    raise IntegrityError(f"stored value refers to a {kind} {name!r}; DCP objects hold none")


def object_bytes(key: str, record: dict, allow_pickle: bool) -> io.BytesIO:
    """``torch.save`` bytes of the stored value, as DCP's load planner expects them."""
    import torch

    if "json" in record:
        value = decode(record["json"], _no_tensors, f"state entry {key!r}")
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return buf
    if not allow_pickle:
        raise CheckpointError(
            f"state entry {key!r} was stored pickled (torch.save bytes); loading it runs "
            "arbitrary code; set allow_pickle to True on lean_store.interop.dcp.StorageReader "
            "only if you trust this checkpoint"
        )
    try:
        return io.BytesIO(base64.b64decode(record["pickle"], validate=True))
    except (ValueError, TypeError) as exc:
        raise IntegrityError(f"state entry {key!r}: malformed pickled record ({exc})") from None


def objects_attr(objects: dict[str, dict]) -> str:
    """The ``dcp`` root attribute of ``objects``; refused before the commit when it is larger
    than a load reads (:data:`MAX_TEXT`), naming the largest objects."""
    text = json.dumps({"version": VERSION, "objects": objects}, separators=(",", ":"),
                      allow_nan=False)
    if len(text) > MAX_TEXT:
        sizes = sorted(((len(json.dumps(r)), k) for k, r in objects.items()), reverse=True)
        largest = ", ".join(f"{k!r} ({n} characters)" for n, k in sizes[:3])
        raise CheckpointError(
            f"the non-tensor objects of this DCP state take {len(text)} characters, more than "
            f"the {MAX_TEXT} a load reads; the largest: {largest}. Store large data as "
            "tensors")
    return text
