"""zarr_compat.json_document_bytes reuses the indented text of members alike across array
documents (issue 13); documents that differ in those members, at any depth, still encode
exactly as ``json.dumps(indent=...)``."""

from __future__ import annotations

import json

import numpy as np
import zarr

from lean_store.stores.zarr.compat import (
    consolidated_group_document,
    encoded_document,
    json_document_bytes,
    plain_array_document,
)


def _reference(doc: dict) -> bytes:
    return json.dumps(doc, indent=zarr.config.get("json_indent"), allow_nan=True).encode()


def test_alike_and_differing_members_encode_exactly() -> None:
    docs = []
    for dtype in ("float32", "float64", "uint16", "bool", "complex64"):
        for shards in (None, (64,)):
            doc = plain_array_document((128,), np.dtype(dtype), (8,), shards,
                                       {"name": dtype, "nan": float("nan")}, ["x"])
            assert doc is not None
            docs.append(doc)
    # the same member text at another depth, and a member that is 1 in one and true in another
    docs.append({"outer": {"codecs": [{"name": "bytes"}]}, "codecs": [1]})
    docs.append({"outer": {"codecs": [{"name": "bytes"}]}, "codecs": [True]})
    for _ in range(2):  # the second round is served from the reused text
        for doc in docs:
            assert json_document_bytes(doc) == _reference(doc)
    root = consolidated_group_document({"complete": True},
                                       {f"a{i}": encoded_document(d)
                                        for i, d in enumerate(docs[:4])})
    assert json.loads(json_document_bytes(root)) == json.loads(_reference(
        consolidated_group_document({"complete": True},
                                    {f"a{i}": d for i, d in enumerate(docs[:4])})))
