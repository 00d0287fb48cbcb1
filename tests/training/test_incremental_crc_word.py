"""An incremental step never carries a damaged CRC-32C word over from its base: a chunk file
whose bytes equal the new ones but whose stored word is wrong is written afresh, not linked
(the word of a linked chunk is checked against the CRC of the new bytes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch_optional import require_torch

import lean_store as ls
from lean_store.naming import node_name
from lean_store.writing import OVERLAP_CRC_BYTES

torch = require_torch()  # Checkpointer steps hold a torch model


def _model() -> torch.nn.Module:
    """A frozen 2 MiB weight (one unsharded chunk, its CRC computed on the CRC workers) and a
    trainable head."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8))
    for p in model[0].parameters():
        p.requires_grad_(False)
    assert model[0].weight.numel() * 4 >= OVERLAP_CRC_BYTES
    return model


def _chunk(step: Path) -> Path:
    return step / node_name("model/0.weight") / "c.0.0"


def test_a_damaged_crc_word_in_the_base_is_not_linked(tmp_path: Path) -> None:
    model = _model()
    ck = ls.Checkpointer(tmp_path, backend="zarr", incremental=True, keep_last=None)
    first = ck.save(0, model=model, rng=False)
    chunk = _chunk(first)
    data = bytearray(chunk.read_bytes())
    assert len(data) == model[0].weight.numel() * 4 + 4  # the words, then the CRC word
    data[-1] ^= 0x40  # the base's stored CRC word is wrong; its data bytes are intact
    chunk.write_bytes(bytes(data))
    assert not ls.verify(first).ok
    with torch.no_grad():
        model[1].weight.add_(0.5)
    second = ck.save(1, model=model, rng=False)
    assert _chunk(second).stat().st_ino != chunk.stat().st_ino  # written, not linked
    assert ls.verify(second).ok
    got = ls.load_state(second)
    np.testing.assert_array_equal(np.asarray(got["model/0.weight"]),
                                  model[0].weight.detach().numpy())
    third = ck.save(2, model=model, rng=False)  # an intact base is linked again
    assert _chunk(third).stat().st_ino == _chunk(second).stat().st_ino
    assert ls.verify(third).ok
