"""Cost of checksums on save and load throughput (best of N runs, robust to other load).

Three configurations per backend: ``full`` (per-chunk fletcher32 / crc32c codec plus the
whole-tensor crc32c digest, the default), ``no-chunk`` (digest only) and ``none`` (neither).

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
from lean_store.stores import hdf5 as hdf5_mod
from lean_store.stores import zarr_store as zarr_mod


@contextlib.contextmanager
def checksums(chunk: bool, digest: bool):
    saved = (hdf5_mod.h5d.create, zarr_mod._compressors, checkpoint_mod.crc32c_update)
    real_create, real_compressors, _ = saved
    if not chunk:
        def create(*args, dcpl=None, **kwargs):
            if dcpl is not None:
                dcpl.remove_filter(hdf5_mod.h5z.FILTER_FLETCHER32)
            return real_create(*args, dcpl=dcpl, **kwargs)

        hdf5_mod.h5d = _Shim(create)
        zarr_mod._compressors = lambda c: [x for x in real_compressors(c)
                                           if type(x).__name__ != "Crc32cCodec"]
    if not digest:
        checkpoint_mod.crc32c_update = lambda crc, bits: 0
    try:
        yield
    finally:
        hdf5_mod.h5d = _REAL_H5D
        zarr_mod._compressors, checkpoint_mod.crc32c_update = saved[1], saved[2]


_REAL_H5D = hdf5_mod.h5d


class _Shim:
    """h5py.h5d with ``create`` replaced."""

    def __init__(self, create) -> None:
        self._create = create

    def __getattr__(self, name):
        if name == "create":
            return self._create
        return getattr(_REAL_H5D, name)


def run(backend: str, mib: int, directory: Path, repeats: int) -> dict[str, tuple[float, float]]:
    rng = np.random.default_rng(0)
    n = mib // 64
    state = {f"t{i}": rng.standard_normal(16 << 20, dtype=np.float32).reshape(4096, 4096)
             for i in range(n)}
    target = {k: np.empty_like(v) for k, v in state.items()}
    path = directory / f"bench{'.h5' if backend == 'hdf5' else '.zarr'}"
    out = {}
    for name, chunk, digest in (("full", True, True), ("no-chunk", False, True),
                                ("none", False, False)):
        saves, loads = [], []
        with checksums(chunk, digest):
            for _ in range(repeats):
                t = time.perf_counter()
                ls.save(state, path)
                saves.append(time.perf_counter() - t)
                t = time.perf_counter()
                ls.load(target, path)
                loads.append(time.perf_counter() - t)
            with ls.open(path) as ck:
                filters = ck[next(iter(ck))].stored.filters
        assert all(np.array_equal(target[k], state[k]) for k in state)
        gib = mib / 1024
        out[name] = (gib / min(saves), gib / min(loads))
        print(f"{backend:5s} {name:9s} save {out[name][0]:5.2f} GiB/s  load "
              f"{out[name][1]:5.2f} GiB/s   filters={filters}", flush=True)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for backend in ("hdf5", "zarr"):
            r = run(backend, args.mib, directory, args.repeats)
            for name in ("no-chunk", "none"):
                print(f"{backend}: checksum cost vs {name}: save "
                      f"{100 * (r[name][0] / r['full'][0] - 1):+.1f} %, load "
                      f"{100 * (r[name][1] / r['full'][1] - 1):+.1f} % throughput")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
