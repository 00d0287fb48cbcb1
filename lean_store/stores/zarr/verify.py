"""What ``verify`` checks in a Zarr array beyond its data: a crc32c codec on every chunk, and
(local stores) every shard index slot of an inner chunk that overlaps the array filled and
inside its shard file."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..base import ChunkProblem
from . import shard_index
from .checks import LocalTree, array_codec_names, zarr_chunk_keys, zarr_grid
from .compat import plain_codecs, sharding_document


def structure_problems(node: str, array: Any, tree: LocalTree | None) -> list[ChunkProblem]:
    """Structural defects of ``array`` (``tree``: the walk of a local store, else None)."""
    _outer, inner = array_codec_names(array)
    problems: list[ChunkProblem] = []
    if "Crc32cCodec" not in inner:
        problems.append((None, "no per-chunk checksum (crc32c codec missing)"))
    if sharding_document(array) is not None and tree is not None and math.prod(array.shape):
        problems.extend(_shard_index_problems(node, array, tree))
    return problems


def _shard_index_problems(node: str, array: Any, tree: LocalTree) -> list[ChunkProblem]:
    """Read each shard's index (at its end, crc32c-protected) and report empty or
    out-of-range slots for inner chunks that overlap the array."""
    config = sharding_document(array) or {}
    if not plain_codecs(config.get("index_codecs") or []) \
            or config.get("index_location", "end") != "end":
        return []
    shard_shape = zarr_grid(node, array)
    inner = tuple(int(c) for c in config["chunk_shape"])
    per_shard = tuple(s // c for s, c in zip(shard_shape, inner))
    n_slots = math.prod(per_shard)
    index_bytes = shard_index.index_bytes(n_slots)
    problems: list[ChunkProblem] = []
    for key, coords in zarr_chunk_keys(node, array, len(tree.files)):
        path = tree.root / key
        size = path.stat().st_size
        if size < index_bytes:
            problems.append((None, f"shard {key!r} is shorter than its index"))
            continue
        with path.open("rb") as f:
            f.seek(size - index_bytes)
            raw = f.read(index_bytes)
        table = shard_index.decode(raw, n_slots)
        if table is None:
            problems.append((None, f"shard {key!r}: index checksum mismatch"))
            continue
        for slot, (offset, nbytes) in enumerate(table):
            local = np.unravel_index(slot, per_shard)
            chunk = tuple(int(s * p + q) for s, p, q in zip(coords, per_shard, local))
            if any(c * n >= d for c, n, d in zip(chunk, inner, array.shape)):
                continue  # slot beyond the array's edge: legitimately empty
            if shard_index.is_empty(int(offset), int(nbytes)):
                problems.append((chunk, f"missing from shard {key!r} (would read as fill)"))
            elif int(offset) + int(nbytes) > size - index_bytes:
                problems.append((chunk, f"lies outside shard {key!r}"))
    return problems
