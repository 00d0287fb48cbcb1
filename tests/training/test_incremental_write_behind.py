"""Incremental steps compare, link or write their big units on the save's CRC workers (as
full saves write them behind): the statistics count every unit once, unchanged units are
linked, changed ones written, and each step verifies and loads exactly."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from torch_optional import require_torch

import lean_store as ls
from lean_store.stores.zarr import direct_write

torch = require_torch()  # Checkpointer steps hold a torch model


def test_units_compared_on_workers_with_exact_stats(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(6)])
    ck = ls.Checkpointer(tmp_path, backend="zarr", incremental=True, keep_last=2)
    ck.save(0, model=model, rng=False)
    threads: list[str] = []
    real = direct_write.DirectWriter._link_or_write

    def recorded(self, region, flat):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return real(self, region, flat)

    monkeypatch.setattr(direct_write.DirectWriter, "_link_or_write", recorded)
    for step in (1, 2, 3):
        with torch.no_grad():
            model[step].weight.add_(1.0)  # one 1 MiB weight changes a step
        path = ck.save(step, model=model, rng=False)
        stats = ck.last_save_stats
        unit = 512 * 512 * 4 + 4  # the words and the chunk's CRC word
        assert stats.linked_files >= 5 and stats.written_files >= 1
        assert stats.written_bytes >= unit and stats.linked_bytes >= 5 * unit
        assert ls.verify(path).ok
        got = ls.load_state(path)
        for name, value in model.state_dict().items():
            np.testing.assert_array_equal(np.asarray(got[f"model/{name}"]), value.numpy())
    assert len(threads) == 3 * 6 and all(t != "MainThread" for t in threads)
    assert ck.steps() == [2, 3]
