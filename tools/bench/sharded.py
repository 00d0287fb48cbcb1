"""Sharded save/load throughput against the single-process save of the same state.

Each of WORLD ranks (gloo on loopback) holds a Shard(0) block of every tensor, MIB MiB per
rank in all; the single process saves and loads the whole state (WORLD * MIB MiB). Reported:
best of REPEAT runs, MiB/s of the whole state, warm page cache (nothing is dropped).

    .venv/bin/python tools/bench/sharded.py --world 4 --mib 64 --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

TENSORS = 4
COLS = 4096


def _rows(world: int, mib: int) -> int:
    """Rows of each (rows, COLS) float32 tensor so that each rank holds ``mib`` MiB in all."""
    per_rank = mib * (1 << 20) // (TENSORS * COLS * 4)
    return per_rank * world


def rank_main(rank: int, world: int, port: int, mib: int, root: Path, repeat: int) -> None:
    import torch
    import torch.distributed as dist

    import lean_store as ls
    from lean_store.distributed import LocalShard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    rows = _rows(world, mib)
    block = rows // world
    g = torch.Generator().manual_seed(rank)
    state = {f"t{i}": LocalShard(torch.rand(block, COLS, generator=g), (rows, COLS),
                                 (rank * block, 0)) for i in range(TENSORS)}
    cols = COLS // world  # resharded load: Shard(1) blocks
    other = {f"t{i}": LocalShard(torch.empty(rows, cols), (rows, COLS), (0, rank * cols))
             for i in range(TENSORS)}
    times: dict[str, list[float]] = {}
    for backend, suffix in (("zarr", ".zarr"), ("hdf5", ".h5")):
        for r in range(repeat):
            path = root / f"sharded-{r}{suffix}"
            for what, fn in (("save", lambda p=path: ls.save(state, p)),
                             ("load", lambda p=path: ls.load(state, p)),
                             ("reshard-load", lambda p=path: ls.load(other, p))):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times.setdefault(f"{backend} {what}", []).append(time.perf_counter() - t0)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    if rank == 0:
        print(json.dumps({k: min(v) for k, v in times.items()}))
    dist.destroy_process_group()
    sys.stdout.flush()  # then no interpreter finalization, which a gloo worker thread
    os._exit(0)  # can abort (the race in tests/gloo_world.py leave_world)


def single(world: int, mib: int, root: Path, repeat: int) -> dict[str, float]:
    import lean_store as ls

    rows = _rows(world, mib)
    rng = np.random.default_rng(0)
    state = {f"t{i}": rng.random((rows, COLS), dtype=np.float32) for i in range(TENSORS)}
    times: dict[str, list[float]] = {}
    for backend, suffix in (("zarr", ".zarr"), ("hdf5", ".h5")):
        for r in range(repeat):
            path = root / f"single-{r}{suffix}"
            t0 = time.perf_counter()
            ls.save(state, path)
            times.setdefault(f"{backend} save", []).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ls.load(state, path)
            times.setdefault(f"{backend} load", []).append(time.perf_counter() - t0)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return {k: min(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64, help="MiB per rank")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lean_store-bench-", dir=args.dir))
    total = args.world * args.mib
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), str(args.world), str(port),
             str(args.mib), str(root), str(args.repeat)],
            stdout=subprocess.PIPE, env=env) for r in range(args.world)]
        outs = [p.communicate(timeout=1800)[0].decode() for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
        sharded = json.loads(outs[0].strip().splitlines()[-1])
        one = single(args.world, args.mib, root, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state: {total} MiB ({args.world} ranks x {args.mib} MiB), {os.cpu_count()} cores")
    print(f"{'operation':<28}{'seconds':>9}{'MiB/s':>9}")
    for name, secs in [*(("1 process " + k, v) for k, v in one.items()),
                       *((f"{args.world} ranks " + k, v) for k, v in sharded.items())]:
        print(f"{name:<28}{secs:>9.2f}{total / secs:>9.0f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _r, _w, _p, _m, _root, _rep = sys.argv[2:8]
        rank_main(int(_r), int(_w), int(_p), int(_m), Path(_root), int(_rep))
    else:
        main()
