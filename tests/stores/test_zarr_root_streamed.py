"""The root ``zarr.json`` of a direct Zarr save is written in blocks (``compat.
write_json_document``), byte for byte what zarr's own encoding and :func:`json_document_bytes`
give: a root with the consolidated metadata of tens of thousands of arrays (about 1.3 kB of
text each) was built as pieces, one string and its bytes at once, most of the peak memory of
such a save (50,000 tiny tensors: +265 MiB of RSS, now +86 MiB)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import zarr

import lean_store as ls
from lean_store.stores.zarr import compat


def test_a_many_array_root_is_zarrs_own_encoding(tmp_path: Path) -> None:
    state = {f"blocks.{i // 7}.p{i % 7}": np.full(3, i, np.float32) for i in range(2500)}
    path = tmp_path / "many.zarr"
    ls.save(state, path)
    raw = (path / "zarr.json").read_bytes()
    assert len(raw) > 2 * compat._BLOCK_CHARS  # written in several blocks
    indent = zarr.config.get("json_indent")
    assert raw == json.dumps(json.loads(raw), indent=indent, allow_nan=True).encode()
    back = ls.load_state(path)
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    group = zarr.open_group(path, mode="r", use_consolidated=True)
    assert group.metadata.consolidated_metadata is not None
    assert len(group.metadata.consolidated_metadata.metadata) == len(state)


def _root(arrays: int) -> dict:
    member = compat.encoded_document({"shape": [3], "attributes": {"name": "x" * 40,
                                                                    "crc32c": 12345}})
    return {"attributes": {"complete": True}, "zarr_format": 3,
            "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                      "metadata": {f"a{i}": member for i in range(arrays)}},
            "node_type": "group"}


def test_written_in_blocks_equals_the_whole_encoding_with_bounded_memory(tmp_path: Path
                                                                         ) -> None:
    doc = _root(60000)
    whole = compat.json_document_bytes(doc)
    assert len(whole) > 8 * compat._BLOCK_CHARS
    path = tmp_path / "zarr.json"
    tracemalloc.start()
    try:
        compat.write_json_document(doc, path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert path.read_bytes() == whole
    assert peak < len(whole) / 2  # blocks, not the pieces, a string and its bytes at once


def test_a_document_the_fast_encoder_leaves_is_written_by_json_dumps(tmp_path: Path) -> None:
    doc = {"attributes": {1: "a non-string key"}, "big": ["y" * 100] * 30000}
    path = tmp_path / "zarr.json"
    compat.write_json_document(doc, path)
    indent = zarr.config.get("json_indent")
    assert path.read_bytes() == json.dumps(doc, indent=indent, allow_nan=True).encode()
