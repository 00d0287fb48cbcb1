"""A process's first open of an HDF5 checkpoint (nothing confirmed yet about how libhdf5
encodes lean_store's attributes): the first dataset of each kind is compared through libhdf5
at open and its header's encodings learned, so the rest match from their headers (issue 13:
before, every one-chunk dataset of a fresh process was opened at its first read). A changed
attribute is still named, however many datasets have one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.errors import IntegrityError

_PROBE = """
import json, sys
import lean_store as ls
from lean_store.stores.hdf5.store import HDF5Reader
opened = []
real = HDF5Reader._open_dataset
HDF5Reader._open_dataset = lambda self, node: (opened.append(node), real(self, node))[1]
with ls.open(sys.argv[1]) as ck:
    reader = ck._reader
    out = {"at_open": len(opened), "differs": len(reader._header_differs)}
state = ls.load_state(sys.argv[1])
out["in_all"] = len(opened)
out["count"] = len(state)
print(json.dumps(out))
"""


def _state(n: int = 120) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    out: dict[str, np.ndarray] = {}
    for i in range(n):
        out[f"block{i}.weight"] = rng.standard_normal((8, 4)).astype(np.float32)
        out[f"block{i}.bias"] = rng.standard_normal(4).astype(np.float32)
    return out


def _fresh(path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_process_opens_a_few_datasets_not_every_one(tmp_path: Path) -> None:
    path = tmp_path / "ck.h5"
    ls.save(_state(), path)
    got = _fresh(path)
    assert got["count"] == 240
    assert got["differs"] == 0
    # one per kind of header (name lengths, shapes), far fewer than the 240 datasets
    assert 0 < got["at_open"] <= 16, got
    assert got["in_all"] <= 16, got


def _tamper(path: Path, names: list[str]) -> None:
    with h5py.File(path, "r+") as f:
        for name in names:
            attrs = f[name].attrs
            attrs["index"] = np.int64(attrs["index"] + 1)  # same type, another value


@pytest.mark.parametrize("count", [1, 12])
def test_changed_attributes_are_still_named(tmp_path: Path, count: int) -> None:
    """One changed dataset, or more than the reader confirms in vain at open (those are
    compared at their first read): every load fails naming the first changed tensor."""
    path = tmp_path / "ck.h5"
    ls.save(_state(), path)
    changed = [f"block{i}.bias" for i in range(100, 100 + count)]
    _tamper(path, changed)
    with pytest.raises(IntegrityError, match=r"'block100\.bias'.*changed after the save"):
        ls.load_state(path)
    done = subprocess.run(
        [sys.executable, "-c", "import sys, lean_store as ls; ls.load_state(sys.argv[1])",
         str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "changed after the save" in done.stderr, done.stderr
    assert "'block100.bias'" in done.stderr
    with ls.open(path) as ck:
        assert ck["block0.weight"].read().tobytes() == _state()["block0.weight"].tobytes()
        with pytest.raises(IntegrityError, match="changed after the save"):
            ck[changed[-1]].read()
    assert not ls.verify(path).ok
