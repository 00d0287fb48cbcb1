"""A rank's pieces take their format and source from one value at a time (issue 13: a whole
TorchSource per value cost ~30x more), with the same formats, bytes and refusals as a state's
TorchSource. One process."""

from __future__ import annotations

import numpy as np
import pytest

from lean_store.distributed.local_state import LocalShard, local_pieces
from lean_store.errors import CheckpointError, UnsupportedValueError
from lean_store.sources import tensor_source
from tests.torch_optional import require_torch

torch = require_torch()


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(6, 5, generator=g),
        "half": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "c": torch.randn(3, dtype=torch.complex64, generator=g),
        "t": torch.randn(8, 6, generator=g).t(),  # not contiguous
        "arr": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "shard": LocalShard(torch.arange(6, dtype=torch.float16).reshape(2, 3), (4, 3), (2, 0)),
    }


def test_pieces_have_the_formats_and_bytes_of_a_whole_state_source():
    state = _state()
    pieces = local_pieces(state)
    plain = {n: (v.tensor if isinstance(v, LocalShard) else v) for n, v in state.items()}
    whole = {e.name: (e, s) for e, s in tensor_source(plain).tensors()}
    assert [p.name for p in pieces] == list(state)
    for p in pieces:
        entry, source = whole[p.name]
        assert p.format == entry.format, p.name
        region = tuple(slice(0, n) for n in p.box.lengths)
        got, want = p.source().read(region), source.read(region)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), p.name


@pytest.mark.parametrize("value, words", [
    (torch.zeros(2, 2).to_sparse(), "sparse tensor"),
    (torch.empty(3, device="meta"), "meta tensor"),
    ("text", "is a str"),
])
def test_one_value_is_refused_as_in_a_whole_state(value, words):
    with pytest.raises(UnsupportedValueError, match=words):
        local_pieces({"x": value})
    with pytest.raises(UnsupportedValueError, match=words):
        tensor_source({"y": torch.zeros(1), "x": value})


def test_a_local_tensor_whose_format_changed_since_planning_is_refused():
    (piece,) = local_pieces({"w": torch.zeros(3)})
    piece.local = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(CheckpointError, match="local format float64 differs"):
        piece.source()
