"""The master manifest of a sharded HDF5 checkpoint: every virtual dataset's record in one root
attribute of the master file, read once when it is opened.

``master_manifest`` (a fixed-length UTF-8 string attribute on the master's root group, JSON)
holds, in layout order, one record per dataset: its node name, the attributes written on it,
its stored shape and its virtual mappings (box, shard file, source dataset; docs/FORMAT.md
6.1.1). A sharded load routes reads to the shard files from these records without touching the
master's datasets; each master dataset (its attributes, mappings, shape and datatype) is still
compared with its record before its data is first read or by ``verify``, or by the one rank of a
sharded load that checks it for all (the ranks agree before anything is installed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...distributed.shard_spec import Box
from ...errors import IntegrityError, UnsafeFileError
from ...hardening import MAX_ATTR_BYTES
from .manifest import manifest_items, value_differences

MASTER_MANIFEST_ATTR = "master_manifest"
MASTER_MANIFEST_VERSION = 1
MAX_DEPTH = 6  # object > tensors list > record > sources list > source object > offsets list
_RECORD_KEYS = {"node", "attrs", "stored_shape", "sources"}
_SOURCE_KEYS = {"offsets", "lengths", "file", "dataset"}
SHARD_FILE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.h5$")
SOURCE_DSET = re.compile(r"^/t(\d{6})-s(\d{5})$")

Mapping = tuple[Box, str, str]
"""One virtual mapping: the box of the virtual dataset, the shard file, the source dataset."""


@dataclass(frozen=True)
class MasterRecord:
    """One master dataset as the master manifest describes it."""

    node: str
    attrs: dict[str, Any]  # as a reader returns them: shapes as tuples of int
    stored_shape: tuple[int, ...]
    sources: list[Mapping]  # [] for an empty tensor (an ordinary chunked dataset)


def record_json(node: str, attrs: dict[str, Any], stored_shape: tuple[int, ...],
                sources: list[Mapping]) -> dict[str, Any]:
    """The master manifest record of one dataset (JSON-ready)."""
    return {
        "node": node,
        "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()},
        "stored_shape": list(stored_shape),
        "sources": [{"offsets": list(b.offsets), "lengths": list(b.lengths), "file": f,
                     "dataset": d} for b, f, d in sources],
    }


def master_manifest_text(records: list[dict[str, Any]]) -> str:
    return json.dumps({"version": MASTER_MANIFEST_VERSION, "tensors": records},
                      separators=(",", ":"))


def _sizes(value: Any, n: int | None, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or (n is not None and len(value) != n) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise IntegrityError(f"{where}: master manifest {what} is not a list of sizes "
                             f"({value!r:.80})")
    return tuple(value)


def _source(item: Any, rank: int, node: str, where: str) -> Mapping:
    if not isinstance(item, dict) or set(item) != _SOURCE_KEYS:
        raise IntegrityError(f"{where}: malformed master manifest source of {node!r} "
                             f"({str(item)[:80]!r})")
    fname, dset = item["file"], item["dataset"]
    if not isinstance(fname, str) or not isinstance(dset, str) or not SHARD_FILE.match(
            fname) or not SOURCE_DSET.match(dset):
        raise UnsafeFileError(f"{where}: master manifest source {fname!r}:{dset!r} of {node!r} "
                              "is not a shard of this checkpoint")
    box = Box(_sizes(item["offsets"], rank, f"offsets of {node!r}", where),
              _sizes(item["lengths"], rank, f"lengths of {node!r}", where))
    return box, fname, dset


def parse_master_manifest(text: Any, where: str, limit: int = MAX_ATTR_BYTES
                          ) -> dict[str, MasterRecord]:
    """node -> record, every field type-checked; its size and nesting are checked on the raw
    text before it is parsed, and every source name against the shard naming rules."""
    items = manifest_items(text, where, "master manifest", MASTER_MANIFEST_VERSION, MAX_DEPTH,
                           limit)
    out: dict[str, MasterRecord] = {}
    for item in items:
        if not isinstance(item, dict) or set(item) != _RECORD_KEYS:
            raise IntegrityError(f"{where}: malformed master manifest record {str(item)[:80]!r}")
        node, attrs, sources = item["node"], item["attrs"], item["sources"]
        if not isinstance(node, str) or node in out:
            raise IntegrityError(f"{where}: master manifest node {node!r:.80} is not a unique "
                                 "name")
        if not isinstance(attrs, dict) or not isinstance(sources, list):
            raise IntegrityError(f"{where}: master manifest record of {node!r} is malformed")
        shape = _sizes(item["stored_shape"], None, f"stored_shape of {node!r}", where)
        out[node] = MasterRecord(
            node, {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}, shape,
            [_source(s, len(shape), node, where) for s in sources])
    return out


def master_differences(record: MasterRecord, attrs: dict[str, Any], shape: tuple[int, ...],
                       mappings: list[Mapping]) -> list[str]:
    """How a master dataset (its attributes, shape and virtual mappings) differs from its
    record."""
    problems = value_differences(record.attrs, attrs, "master manifest")
    if shape != record.stored_shape:
        problems.append(f"dataset shape {shape} is not the master manifest's "
                        f"{record.stored_shape}")
    if mappings != record.sources:
        problems.append("its virtual mappings differ from the master manifest's sources")
    return problems
