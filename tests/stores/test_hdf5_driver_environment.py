"""lean_store's HDF5 files are single files whatever ``HDF5_DRIVER`` the environment sets.

libhdf5 takes its default file driver from that variable when it starts (so each case runs in
its own process). With a multi-file driver (``split``: ``NAME.meta`` + ``NAME.raw``,
``family``, ``multi``) a save used to leave tens of MB of temporaries next to the target and
fail with "No such file or directory", and a checkpoint saved without the variable could not
be loaded with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls

_RUN = """
import json, os, sys
import numpy as np
import lean_store as ls
folder, before = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(5)
state = {f"w{i}": rng.standard_normal((n, 64)).astype(np.float32)
         for i, n in enumerate([3, 1000, 20000])}
out = {"before": ls.load_state(before)["w"].tolist()}
ls.verify(before).raise_if_bad()
for comp in (None, "weights"):
    path = os.path.join(folder, f"ckpt-{comp}.h5")
    ls.save(state, path, compression=comp)
    ls.save({k: v + 1 for k, v in state.items()}, path, compression=comp)  # replaces it
    back = ls.load_state(path)
    out[str(comp)] = all(np.array_equal(back[k], v + 1) for k, v in state.items())
    ls.verify(path).raise_if_bad()
out["files"] = sorted(os.listdir(folder))
print(json.dumps(out))
"""


@pytest.mark.parametrize("driver", ["split", "family", "multi"])
def test_a_multi_file_default_driver_changes_nothing(tmp_path: Path, driver: str) -> None:
    before = tmp_path / "before.h5"
    ls.save({"w": np.arange(5, dtype=np.float64)}, before)  # saved without the variable
    folder = tmp_path / "out"
    folder.mkdir()
    done = subprocess.run([sys.executable, "-c", _RUN, str(folder), str(before)],
                          env={**os.environ, "HDF5_DRIVER": driver},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] == list(range(5))
    assert out["None"] and out["weights"]
    assert out["files"] == ["ckpt-None.h5", "ckpt-weights.h5"]  # one file each, nothing else
    for name in out["files"]:  # and plain HDF5 files any reader opens
        assert ls.load_state(folder / name)["w0"].shape == (3, 64)
