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
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from ...chunking import chunk_count
from ...errors import IntegrityError, UnsafeFileError
from ...hardening import MAX_ATTR_BYTES, json_depth
from .crc_table import CHUNK_CRC_ATTR, parse_table

MANIFEST_ATTR = "manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_DEPTH = 6  # object > tensors list > record > attrs object > shape list (5)
_RECORD_KEYS = {"node", "attrs", "stored_shape", "chunks", CHUNK_CRC_ATTR}
_INT_ONLY = frozenset({int})  # the types of a list of JSON integers (bool is not int)


class TensorRecord(NamedTuple):
    """One dataset as the manifest describes it (a named tuple: one is made per tensor at
    every open, in a third of a frozen dataclass's time)."""

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


class ManifestBuilder:
    """The manifest of one save, built while its datasets are written: the records of closed
    datasets are turned into their JSON text in batches of :attr:`batch`, in order, so that a
    save of tens of thousands of tensors holds ~0.3 kB of text per tensor until the end, not
    each record's dicts, tuples and table (~1.5 kB). :meth:`text` is exactly
    :func:`manifest_text` of every record.

    A record is a dict with ``node``, ``attrs``, ``stored_shape`` and ``chunks``; it is
    closed once its ``table`` (the chunk_crc32c table) is set."""

    def __init__(self, batch: int = 256) -> None:
        self.batch = batch
        self._open: deque[dict[str, Any]] = deque()  # in order, from the first not yet text
        self._parts: list[str] = []  # JSON text of the records before, in batches
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, record: dict[str, Any]) -> None:
        """The next dataset's record (closed later by setting its ``table``)."""
        self._open.append(record)
        self._count += 1
        if len(self._open) >= 2 * self.batch:
            self._compact()

    def complete(self) -> bool:
        """True when every record added is closed."""
        return all("table" in r for r in self._open)

    def text(self) -> str:
        """The manifest text of every record (all closed)."""
        return "".join(self.take_pieces())

    def take_pieces(self) -> list[str]:
        """The manifest text of every record (all closed) as pieces to be concatenated, handed
        over: the builder is empty afterwards, so the caller can free each piece once copied.
        The text is ASCII (``json`` escapes the rest)."""
        self._compact()
        if self._open:
            raise ValueError(f"{len(self._open)} manifest records are not closed")
        parts, self._parts = self._parts, []
        pieces = [f'{{"version":{MANIFEST_VERSION},"tensors":[']
        for i, part in enumerate(parts):
            pieces += [",", part] if i else [part]
        pieces.append("]}")
        return pieces

    def _compact(self) -> None:
        """The closed records at the front, as one more part of JSON text."""
        done = []
        while self._open and "table" in self._open[0]:
            r = self._open.popleft()
            done.append(record_json(r["node"], r["attrs"], r["stored_shape"], r["chunks"],
                                    r["table"]))
        if done:
            self._parts.append(json.dumps(done, separators=(",", ":"))[1:-1])


def _int_tuple(value: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise IntegrityError(f"{where}: manifest {what} is not a list of sizes ({value!r:.80})")
    return tuple(value)


def manifest_items(text: Any, where: str, what: str, version: int, max_depth: int,
                   limit: int = MAX_ATTR_BYTES) -> list[Any]:
    """The ``tensors`` list of a JSON manifest attribute (``what``: its name in errors): the
    text's size (at most ``limit``: the file's root attribute limit,
    :func:`~lean_store.hardening.root_attr_limit`) and nesting checked before it is parsed,
    then its ``version``."""
    if not isinstance(text, str):
        raise IntegrityError(f"{where}: the {what} attribute is not a string")
    if len(text) > limit:
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


def parse_manifest(text: Any, where: str, limit: int = MAX_ATTR_BYTES
                   ) -> dict[str, TensorRecord]:
    """node -> record, every field type-checked; its size and nesting are checked on the raw
    text before it is parsed, and its tables against the chunk grids they claim to cover.

    The checks are those of one record at a time, made with few Python steps per record (a
    manifest holds one per tensor): a list of sizes is checked by the set of its items' types
    and its least item, and every record's ``chunk_crc32c`` values go into one uint32 array,
    of which each record's table is a slice (checked by :func:`.crc_table.parse_table` only
    where it does not hold one value per chunk of row blocks, to name the problem)."""
    items = manifest_items(text, where, "manifest", MANIFEST_VERSION, MAX_MANIFEST_DEPTH, limit)
    rows: list[tuple[str, dict[str, Any], tuple[int, ...], tuple[int, ...], int]] = []
    values: list[int] = []
    seen: set[str] = set()
    int_only = _INT_ONLY
    for item in items:
        if type(item) is not dict or item.keys() != _RECORD_KEYS:
            raise IntegrityError(f"{where}: malformed manifest record {str(item)[:80]!r}")
        node, attrs = item["node"], item["attrs"]
        if type(node) is not str or node in seen:
            raise IntegrityError(f"{where}: manifest node {node!r:.80} is not a unique name")
        seen.add(node)
        if type(attrs) is not dict or CHUNK_CRC_ATTR in attrs:
            raise IntegrityError(f"{where}: manifest attributes of {node!r} are malformed")
        shape, chunks = item["stored_shape"], item["chunks"]
        if type(shape) is not list or not int_only.issuperset(map(type, shape)) or (
            shape and min(shape) < 0
        ):
            _int_tuple(shape, f"stored_shape of {node!r}", where)  # raises, naming it
        if type(chunks) is not list or not int_only.issuperset(map(type, chunks)) or (
            chunks and min(chunks) < 0
        ):
            _int_tuple(chunks, f"chunks of {node!r}", where)
        if len(chunks) != len(shape) or 0 in chunks:
            raise IntegrityError(f"{where}: manifest chunks {tuple(chunks)} of {node!r} do not "
                                 f"fit its shape {tuple(shape)}")
        raw = item[CHUNK_CRC_ATTR]
        if type(raw) is not list or raw and (
            not int_only.issuperset(map(type, raw)) or min(raw) < 0 or max(raw) >= 1 << 32
        ):
            raise IntegrityError(f"{where}: manifest {CHUNK_CRC_ATTR} of {node!r} is malformed")
        for key, value in attrs.items():  # as a reader returns them: shapes as tuples
            if type(value) is list:
                attrs[key] = tuple(value)
        rows.append((node, attrs, tuple(shape), tuple(chunks), len(raw)))
        values += raw
    tables = np.array(values, dtype=np.uint32) if values else np.zeros(0, np.uint32)
    out: dict[str, TensorRecord] = {}
    at = 0
    for node, attrs, shape, chunks, n in rows:
        table = tables[at:at + n]
        at += n
        if n != 1 or not all(0 < d <= c for d, c in zip(shape, chunks)):  # one chunk
            table = parse_table(table, chunk_count(shape, chunks), repr(node), shape=shape,
                                chunks=chunks)
        out[node] = TensorRecord(node, attrs, shape, chunks, table)
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
