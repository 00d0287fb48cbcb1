"""The metadata lean_store writes and the checks a reader makes before touching any data.

Root: ``lean_store`` (format name), ``format_version``, ``kind``, ``tensor_count``, ``layout``
(JSON), ``writer``, ``save_id`` (unique per save) and ``complete`` (written last). Each dataset:
``index``, ``name``, ``shape``, ``format``, ``width``, the format's parameters, ``crc32c`` of its
raw words, ``storage``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from typing import Any

from ._version import __version__
from .errors import (
    CheckpointError,
    FormatError,
    IntegrityError,
    LayoutError,
    UnsafeFileError,
    listing,
)
from .formats import BinaryFormat, ComplexFormat, ScalarFormat, get
from .hardening import json_depth
from .layout import Entry, Layout
from .naming import legacy_node_name, node_name
from .stores.base import FORMAT_VERSION, StoredTensor, StoreReader
from .stores.target import FORMAT_NAME

KINDS = ("state", "module", "optimizer", "training")
MAX_ELEMENTS = 1 << 48  # a claimed size beyond this is rejected, never allocated
MAX_LAYOUT_DEPTH = 8  # a layout is a list of objects holding a shape list: 3 levels
MAX_ENTRY_TEXT = 16 << 10  # one layout entry: a 1024-character name escaped 12 bytes a char


def tensor_attrs(entry: Entry, storage: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "index": entry.index,
        "name": entry.name,
        "shape": tuple(entry.shape),
    }
    attrs.update(format_attrs(entry.format, storage))
    return attrs


_IDENTITY: dict[ScalarFormat, tuple[tuple[str, Any], ...]] = {}
"""format -> the (key, value) pairs of :func:`format_attrs` a reader compares (``storage``
apart): made once per format, not per tensor (a state has few formats, many tensors)."""


def _format_identity(fmt: ScalarFormat) -> tuple[tuple[str, Any], ...]:
    found = _IDENTITY.get(fmt)
    if found is None:
        if len(_IDENTITY) >= 256:
            _IDENTITY.clear()
        found = _IDENTITY[fmt] = tuple(
            (k, v) for k, v in format_attrs(fmt, "").items() if k != "storage")
    return found


def format_attrs(fmt: ScalarFormat, storage: str) -> dict[str, Any]:
    """The attributes of a tensor of ``fmt`` that depend on its format alone, in the order
    :func:`tensor_attrs` writes them (after ``index``, ``name`` and ``shape``)."""
    attrs: dict[str, Any] = {"format": fmt.tag, "width": fmt.width, "storage": storage}
    if isinstance(fmt, BinaryFormat):
        attrs.update(
            exponent_bits=fmt.exponent_bits,
            fraction_bits=fmt.fraction_bits,
            bias=fmt.bias,
            encoding=fmt.encoding,
        )
    if isinstance(fmt, ComplexFormat):
        attrs["component"] = fmt.component.tag
    return attrs


def root_attrs(layout: Layout, kind: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    if kind not in KINDS:
        raise CheckpointError(f"unknown checkpoint kind {kind!r}; known: {', '.join(KINDS)}")
    attrs: dict[str, Any] = {
        "lean_store": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "tensor_count": len(layout),
        "layout": json.dumps(layout.to_json(), separators=(",", ":")),
        "writer": f"lean_store {__version__}",
        "save_id": uuid.uuid4().hex,  # new per save: readers tell a replaced store by it
    }
    attrs.update(extra or {})
    return attrs


def parse_root(
    attrs: dict[str, Any], where: str, present: Callable[[], int] | None = None
) -> tuple[int, str, Layout]:
    """Check the header and return (format version, kind, layout).

    ``tensor_count`` is compared with ``present()`` (the datasets the store actually holds),
    and the layout text's size (with ``tensor_count``) and nesting depth are checked on the raw
    text, all before the layout is parsed: a forged layout cannot make the reader build more
    than the file holds, nor recurse without bound."""
    if attrs.get("lean_store") != FORMAT_NAME:
        raise IntegrityError(f"{where} is not a lean_store checkpoint (no 'lean_store' header)")
    version = attrs.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise IntegrityError(f"{where}: malformed format_version {version!r}")
    if version > FORMAT_VERSION:
        raise IntegrityError(
            f"{where}: format version {version} is newer than this lean_store "
            f"(reads up to {FORMAT_VERSION}); upgrade lean_store"
        )
    if attrs.get("complete") not in (True, 1):
        raise IntegrityError(f"incomplete checkpoint: {where} was never committed")
    kind = attrs.get("kind")
    if kind not in KINDS:
        raise IntegrityError(f"{where}: unknown checkpoint kind {kind!r}")
    count = attrs.get("tensor_count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise IntegrityError(f"{where}: malformed tensor_count {count!r:.80}")
    if present is not None:
        held = present()
        if count > held:
            raise IntegrityError(
                f"{where}: tensor_count {count} but the store holds only {held} datasets; the "
                "checkpoint is truncated or forged"
            )
    text = attrs.get("layout")
    if isinstance(text, str):
        # bounded by the tensors (and the file's root attribute, or the Zarr root, it came in)
        if len(text) > 2 + count * MAX_ENTRY_TEXT:
            raise IntegrityError(
                f"{where}: layout text of {len(text)} bytes is far longer than {count} tensors "
                "need; the checkpoint is forged or corrupt"
            )
        depth = json_depth(text)  # before json.loads could recurse into it
        if depth > MAX_LAYOUT_DEPTH:
            raise UnsafeFileError(
                f"{where}: layout JSON nested {depth} levels deep (a layout nests 3); "
                "refusing to parse it"
            )
        try:
            items = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise IntegrityError(f"{where}: layout is not valid JSON ({exc})") from None
    else:
        items = text
    if isinstance(items, list) and len(items) != count:
        raise IntegrityError(f"{where}: tensor_count {count} but the layout lists {len(items)}")
    try:
        layout = Layout.from_json(items)
    except (LayoutError, FormatError) as exc:
        raise IntegrityError(f"{where}: malformed layout: {exc}") from None
    if count != len(layout):
        raise IntegrityError(f"{where}: tensor_count {count!r} but the layout lists {len(layout)}")
    for entry in layout:
        if math.prod(entry.shape) > MAX_ELEMENTS:
            raise IntegrityError(
                f"{where}: tensor {entry.name!r} claims an absurd shape {entry.shape}"
            )
    return version, kind, layout


def check_stored(reader: StoreReader, layout: Layout, where: str) -> dict[str, StoredTensor]:
    """Compare every dataset with the layout; raise one IntegrityError listing every problem."""
    problems: list[str] = []
    nodes = reader.nodes()
    present = set(nodes)  # a list scan per tensor would make the open quadratic
    expected_nodes = {_node_of(e.name, present): e for e in layout}
    for node in nodes:
        if node not in expected_nodes:
            problems.append(f"dataset {node!r} is not in the layout")
    stored: dict[str, StoredTensor] = {}
    for node, entry in expected_nodes.items():
        if node not in present:
            problems.append(f"tensor {entry.name!r}: dataset {node!r} is missing")
            continue
        info = reader.stored(node)
        stored[entry.name] = info
        problems.extend(_check_tensor(reader, entry, info))
    if problems:
        raise IntegrityError(
            f"{where}: stored data does not match its layout:\n{listing(problems)}"
        )
    return stored


def _node_of(name: str, present: set[str]) -> str:
    """The node of tensor ``name``: its node name (FORMAT.md 2.1), unless the store lacks it
    and holds the node name writers gave it before reserved names were escaped (``zarr.json``
    in any case: HDF5 files, and Zarr stores on case-sensitive file systems, could hold it)."""
    node = node_name(name)
    if node not in present:
        old = legacy_node_name(name)
        if old is not None and old in present:
            return old
    return node


def _check_tensor(reader: StoreReader, entry: Entry, info: StoredTensor) -> list[str]:
    attrs, name = info.attrs, entry.name
    problems = []
    get = attrs.get
    # identity and the format's parameters (redundant, so a flip shows), in the order
    # tensor_attrs writes them; the format's part made once per format
    for key, want in (("index", entry.index), ("name", name), ("shape", tuple(entry.shape)),
                      *_format_identity(entry.format)):
        got = get(key)
        if key == "shape" and isinstance(got, list):
            got = tuple(got)
        if got != want:
            problems.append(f"tensor {name!r}: attribute {key} is {got!r}, layout says {want!r}")
    shape = reader.stored_shape_of(entry)
    if info.stored_shape != shape:
        problems.append(
            f"tensor {name!r}: payload shape {info.stored_shape} disagrees with shape "
            f"{entry.shape} (expected stored shape {shape})"
        )
    mismatch = reader.type_mismatch(info.node, entry.format)
    if mismatch is not None:
        problems.append(f"tensor {name!r}: {mismatch}")
    crc = attrs.get("crc32c")
    valid_crc = isinstance(crc, int) and not isinstance(crc, bool) and 0 <= crc < 2**32
    # sharded checkpoints record one digest per shard instead (lean_store.distributed checks
    # them); every other lean_store writer records the tensor's digest
    sharded = "shards" in attrs and "sharded" in reader.root_attrs
    if crc is None and not sharded:  # without it the data would go unverified
        problems.append(f"tensor {name!r}: the crc32c digest attribute is missing")
    elif crc is not None and not valid_crc:
        problems.append(f"tensor {name!r}: malformed crc32c attribute {crc!r}")
    return problems


__all__ = ["check_stored", "parse_root", "root_attrs", "tensor_attrs", "get"]
