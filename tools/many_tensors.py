"""A state of very many tensors through save, load, verify and a partial read, on both backends.

    .venv/bin/python tools/many_tensors.py                  # 100,000 tensors (a few minutes)
    .venv/bin/python tools/many_tensors.py --count 20000    # quicker

A mixture-of-experts model saved unfused has tens of thousands of tensors (~90,000 for a
DeepSeek-V3-sized one), three times that with its AdamW moments. The metadata that grows with
them (a Zarr root's consolidated metadata, ~1.5 KiB per tensor; an HDF5 manifest, ~350 bytes)
passed fixed 64 MiB limits there, and such checkpoints were saved but refused by every load.
Each backend runs in a fresh child process (its peak RSS is its own): the state is named like
an expert model (``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``), small tensors
of distinct values; every value is compared after the load. The suite's short version is
``tests/hostile/test_metadata_growing_with_tensors.py`` (limits lowered, 300 tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, time
import numpy as np
import lean_store as ls

count, path = int(sys.argv[1]), sys.argv[2]
kinds = ("gate", "up", "down")
names = [f"model.layers.{i // 768}.mlp.experts.{(i // 3) % 256}.{kinds[i % 3]}_proj.weight"
         for i in range(count)]
state = {n: np.full((4, 2), i, np.float32) for i, n in enumerate(names)}
out = {}
t = time.perf_counter()
ls.save(state, path, progress=False)
out["save_s"] = time.perf_counter() - t
t = time.perf_counter(); got = ls.load_state(path); out["load_s"] = time.perf_counter() - t
out["exact"] = set(got) == set(state) and all(np.array_equal(got[n], v) for n, v in state.items())
del got
t = time.perf_counter(); report = ls.verify(path); out["verify_s"] = time.perf_counter() - t
out["verified"] = bool(report.ok)
t = time.perf_counter()
with ls.open(path) as ck:
    out["partial_exact"] = bool(np.array_equal(ck.read(names[-1]), state[names[-1]]))
out["open_read_one_s"] = time.perf_counter() - t
root = os.path.join(path, "zarr.json")
out["root_document_bytes"] = os.path.getsize(root) if os.path.isdir(path) else None
if not os.path.isdir(path):
    import h5py
    with h5py.File(path, "r") as f:
        out["manifest_bytes"] = len(f.attrs["manifest"])
out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def run(count: int, backend: str, directory: str) -> dict:
    path = os.path.join(directory, f"many{'.h5' if backend == 'hdf5' else '.zarr'}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, str(count), path], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args(argv)
    failed = False
    for backend in ("hdf5", "zarr"):
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            result = run(args.count, backend, directory)
        print(f"{backend} {args.count} tensors: {json.dumps(result)}")
        failed |= "error" in result or not (result.get("exact") and result.get("verified")
                                            and result.get("partial_exact"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
