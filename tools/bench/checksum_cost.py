"""Cost of checksums on save and load throughput (best of N runs, robust to other load).

HDF5: ``default`` (the per-chunk CRC-32C table ``chunk_crc32c`` plus the whole-tensor digest
derived from it), ``fletcher32`` (``checksum="fletcher32+crc32c"``: HDF5's native filter on
top) and ``none`` (every CRC computation replaced by a constant). Zarr: ``default`` (crc32c
codec per chunk plus the digest), ``digest-only`` (no codec) and ``none`` (neither).

    .venv/bin/python tools/bench/checksum_cost.py --mib 512 --dir /dev/shm
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import lean_store as ls
import lean_store.checkpoint as checkpoint_mod
import lean_store.writing as writing_mod
from lean_store.stores.hdf5 import store as hdf5_mod
from lean_store.stores.zarr import store as zarr_mod

CONFIGS = {
    "hdf5": (("default", True, True, None), ("fletcher32", True, True, "fletcher32+crc32c"),
             ("none", False, False, None)),
    "zarr": (("default", True, True, None), ("digest-only", False, True, None),
             ("none", False, False, None)),
}


@contextlib.contextmanager
def checksums(chunk: bool, digest: bool):
    """``chunk=False``: no Zarr crc32c codec, and HDF5's table is all zeros (no CRC is
    computed). ``digest=False``: no whole-tensor CRC is computed either."""
    saved = (zarr_mod._compressors, checkpoint_mod.crc32c_update, writing_mod.crc32c_of,
             writing_mod.crc32c_combine, checkpoint_mod.crc32c_combine, hdf5_mod.crc32c_of)
    if not chunk:
        real = saved[0]
        zarr_mod._compressors = lambda c: [x for x in real(c)
                                           if type(x).__name__ != "Crc32cCodec"]
        hdf5_mod.crc32c_of = lambda bits, crc=0: 0
    if not digest:
        checkpoint_mod.crc32c_update = lambda crc, bits: 0
        writing_mod.crc32c_of = lambda bits, crc=0: 0
        writing_mod.crc32c_combine = checkpoint_mod.crc32c_combine = lambda a, b, n: 0
    try:
        yield
    finally:
        (zarr_mod._compressors, checkpoint_mod.crc32c_update, writing_mod.crc32c_of,
         writing_mod.crc32c_combine, checkpoint_mod.crc32c_combine, hdf5_mod.crc32c_of) = saved


def run(backend: str, mib: int, directory: Path, repeats: int) -> dict[str, tuple[float, float]]:
    rng = np.random.default_rng(0)
    n = max(1, mib // 64)
    state = {f"t{i}": rng.standard_normal(16 << 20, dtype=np.float32).reshape(4096, 4096)
             for i in range(n)}
    target = {k: np.empty_like(v) for k, v in state.items()}
    path = directory / f"bench{'.h5' if backend == 'hdf5' else '.zarr'}"
    out = {}
    for name, chunk, digest, checksum in CONFIGS[backend]:
        saves, loads = [], []
        with checksums(chunk, digest):
            for _ in range(repeats):
                t = time.perf_counter()
                ls.save(state, path, checksum=checksum)
                saves.append(time.perf_counter() - t)
                t = time.perf_counter()
                ls.load(target, path)
                loads.append(time.perf_counter() - t)
            with ls.open(path) as ck:
                filters = ck[next(iter(ck))].stored.filters
        assert all(np.array_equal(target[k], state[k]) for k in state)
        gib = n * 64 / 1024
        out[name] = (gib / min(saves), gib / min(loads))
        print(f"{backend:5s} {name:11s} save {out[name][0]:5.2f} GiB/s  load "
              f"{out[name][1]:5.2f} GiB/s   filters={filters}", flush=True)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["hdf5", "zarr"])
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for backend in args.backends:
            r = run(backend, args.mib, directory, args.repeats)
            for name in [c[0] for c in CONFIGS[backend][1:]]:
                print(f"{backend}: throughput of {name} vs default: save "
                      f"{100 * (r[name][0] / r['default'][0] - 1):+.1f} %, load "
                      f"{100 * (r[name][1] / r['default'][1] - 1):+.1f} %")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
