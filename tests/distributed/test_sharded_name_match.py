"""Sharded loads match tensors by name, as single-process loads do: a checkpoint whose tensors
are in another order than the target's (a converted safetensors file is sorted by name) loads;
``strict_order=True`` still refuses it. One gloo rank in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch_optional import require_torch

require_torch()  # the child runs torch.distributed

import lean_store as ls  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
import numpy as np
import torch.distributed as dist
import lean_store as ls
from lean_store.distributed import LocalShard

dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
path, out = sys.argv[2], sys.argv[3]
got = {}
for strict_order in (False, True):
    target = {"a": LocalShard(np.zeros((4, 3), np.float32), (4, 3), (0, 0)),
              "b": LocalShard(np.zeros((5,), np.float64), (5,), (0,))}
    try:
        ls.load(target, path, strict_order=strict_order)
        got[str(strict_order)] = {"a": target["a"].tensor.tolist(),
                                  "b": target["b"].tensor.tolist()}
    except ls.CheckpointError as exc:
        got[str(strict_order)] = {"error": type(exc).__name__, "message": str(exc)}
dist.destroy_process_group()
with open(out, "w") as f:
    json.dump(got, f)
import os, sys; sys.stdout.flush(); os._exit(0)  # why: tests/gloo_world.py leave_world
"""


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_sharded_load_matches_by_name(tmp_path: Path, suffix: str) -> None:
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = np.linspace(-1, 1, 5)
    path = tmp_path / f"ck{suffix}"
    ls.save({"b": b, "a": a}, path)  # the file's order: b, a; the target's: a, b
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "rendezvous"), str(path), str(out)],
        env=env, check=True, timeout=120,
    )
    by_name, in_order = (json.loads(out.read_text())[k] for k in ("False", "True"))
    np.testing.assert_array_equal(np.array(by_name["a"], np.float32), a)
    np.testing.assert_array_equal(np.array(by_name["b"]), b)
    assert in_order["error"] == "LayoutError"
    assert "'a': at index 1, expected at index 0" in in_order["message"]
