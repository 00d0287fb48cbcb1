"""The HDF5 root manifest: every dataset's record in one root attribute, read once at open.

``manifest`` (a fixed-length UTF-8 string attribute on the root group, JSON) holds, in layout
order, one record per dataset: its node name, the attributes written on it (``chunk_crc32c``
apart), its stored shape, its chunk shape and its ``chunk_crc32c`` table.
A reader validates the layout against these records in memory; each dataset's own attributes
(kept for h5py and h5dump users) are compared with its record before its data is first handed
out, and by ``verify``. Structure (filters, storage) is read from the dataset itself, so a file
repacked by h5repack stays readable. See docs/FORMAT.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...chunking import chunk_count
from ...errors import IntegrityError, UnsafeFileError
from ...hardening import MAX_ATTR_BYTES, json_depth
from .crc_table import CHUNK_CRC_ATTR, parse_table

MANIFEST_ATTR = "manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_DEPTH = 6  # object > tensors list > record > attrs object > shape list (5)
_RECORD_KEYS = {"node", "attrs", "stored_shape", "chunks", CHUNK_CRC_ATTR}


@dataclass(frozen=True)
class TensorRecord:
    """One dataset as the manifest describes it."""

    node: str
    attrs: dict[str, Any]  # as a reader returns them: shapes as tuples of int
    stored_shape: tuple[int, ...]
    chunks: tuple[int, ...]
    table: np.ndarray  # the chunk_crc32c table, uint32


def record_json(node: str, attrs: dict[str, Any], stored_shape: tuple[int, ...],
                chunks: tuple[int, ...], table: np.ndarray) -> dict[str, Any]:
    """The manifest record of one dataset, ready for :func:`manifest_text` (``json`` writes
    tuples as lists: shapes are passed as they are, not copied)."""
    return {
        "node": node,
        "attrs": attrs,
        "stored_shape": stored_shape,
        "chunks": chunks,
        CHUNK_CRC_ATTR: table.tolist(),
    }


def manifest_text(records: list[dict[str, Any]]) -> str:
    return json.dumps({"version": MANIFEST_VERSION, "tensors": records}, separators=(",", ":"))


def _int_tuple(value: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise IntegrityError(f"{where}: manifest {what} is not a list of sizes ({value!r:.80})")
    return tuple(value)


def _attr_value(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    return value


def manifest_items(text: Any, where: str, what: str, version: int, max_depth: int
                   ) -> list[Any]:
    """The ``tensors`` list of a JSON manifest attribute (``what``: its name in errors): the
    text's size and nesting checked before it is parsed, then its ``version``."""
    if not isinstance(text, str):
        raise IntegrityError(f"{where}: the {what} attribute is not a string")
    if len(text) > MAX_ATTR_BYTES:
        raise UnsafeFileError(f"{where}: {what} of {len(text)} bytes is too large")
    depth = json_depth(text)
    if depth > max_depth:
        raise UnsafeFileError(f"{where}: {what} JSON nested {depth} levels deep; refusing it")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"{where}: {what} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != version:
        raise IntegrityError(f"{where}: {what} version {str(doc)[:40]!r} is not {version}")
    items = doc.get("tensors")
    if not isinstance(items, list):
        raise IntegrityError(f"{where}: the {what} holds no list of tensors")
    return items


def parse_manifest(text: Any, where: str) -> dict[str, TensorRecord]:
    """node -> record, every field type-checked; its size and nesting are checked on the raw
    text before it is parsed, and its tables against the chunk grids they claim to cover."""
    items = manifest_items(text, where, "manifest", MANIFEST_VERSION, MAX_MANIFEST_DEPTH)
    out: dict[str, TensorRecord] = {}
    for item in items:
        if not isinstance(item, dict) or set(item) != _RECORD_KEYS:
            raise IntegrityError(f"{where}: malformed manifest record {str(item)[:80]!r}")
        node, attrs = item["node"], item["attrs"]
        if not isinstance(node, str) or node in out:
            raise IntegrityError(f"{where}: manifest node {node!r:.80} is not a unique name")
        if not isinstance(attrs, dict) or CHUNK_CRC_ATTR in attrs:
            raise IntegrityError(f"{where}: manifest attributes of {node!r} are malformed")
        shape = _int_tuple(item["stored_shape"], f"stored_shape of {node!r}", where)
        chunks = _int_tuple(item["chunks"], f"chunks of {node!r}", where)
        if len(chunks) != len(shape) or 0 in chunks:
            raise IntegrityError(f"{where}: manifest chunks {chunks} of {node!r} do not fit "
                                 f"its shape {shape}")
        raw = item[CHUNK_CRC_ATTR]
        if not isinstance(raw, list) or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**32 for c in raw
        ):
            raise IntegrityError(f"{where}: manifest {CHUNK_CRC_ATTR} of {node!r} is malformed")
        table = parse_table(np.asarray(raw, dtype=np.int64).astype(np.uint32)
                            if raw else np.zeros(0, np.uint32),
                            chunk_count(shape, chunks), repr(node), shape=shape, chunks=chunks)
        out[node] = TensorRecord(node, {k: _attr_value(v) for k, v in attrs.items()}, shape,
                                 chunks, table)
    return out


def value_differences(recorded: dict[str, Any], attrs: dict[str, Any], source: str,
                      skip: frozenset[str] = frozenset()) -> list[str]:
    """How the attributes read from a dataset (all but ``skip``) differ from the values its
    record in ``source`` (a manifest's name, for the messages) holds."""
    problems = []
    for key in sorted((set(recorded) | set(attrs)) - skip):
        got, want = attrs.get(key), recorded.get(key)
        if isinstance(got, np.ndarray):
            got = tuple(got.tolist())
        if key not in attrs:
            problems.append(f"dataset attribute {key} is missing")
        elif key not in recorded:
            problems.append(f"dataset attribute {key} was not written by lean_store")
        elif got != want:
            problems.append(f"dataset attribute {key} is {got!r:.80}, the {source} says "
                            f"{want!r:.80}")
    return problems


def attribute_differences(record: TensorRecord, attrs: dict[str, Any]) -> list[str]:
    """How the attributes read from a dataset differ from its manifest record."""
    problems = value_differences(record.attrs, attrs, "manifest", frozenset({CHUNK_CRC_ATTR}))
    table = attrs.get(CHUNK_CRC_ATTR)
    if not isinstance(table, np.ndarray) or table.shape != record.table.shape or not (
        np.array_equal(table, record.table)
    ):
        problems.append(f"dataset attribute {CHUNK_CRC_ATTR} differs from the manifest's table")
    return problems
