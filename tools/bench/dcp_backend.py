"""DCP save/load time: lean_store.interop.dcp (Zarr and HDF5) against DCP's own
FileSystemWriter/Reader.

Four gloo ranks on loopback hold a transformer-shaped stack (``--layers`` blocks of LayerNorm +
Linear(d, 4d) + Linear(4d, d), d = ``--dim``; 4 blocks of 512 are 8.4 M parameters) with AdamW
moments, sharded two ways:

- ``fsdp``: FSDP2 (``fully_shard``) over 4 ranks;
- ``tp2x2``: tensor parallel (colwise / rowwise) inside FSDP2 on a 2x2 mesh (strided shards).

Each ``dcp.save`` / ``dcp.load`` of ``{"model": ..., "optim": ...}`` (from
``get_state_dict``) is timed between barriers on rank 0; best of ``--repeat`` runs, warm page
cache (nothing is dropped), a fresh directory per save.

    .venv/bin/python tools/bench/dcp_backend.py --dim 512 --layers 4 --repeat 3 --dir /tmp
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

BACKENDS = ("lean_store-zarr", "lean_store-hdf5", "dcp-filesystem")


def build(layout: str, dim: int, layers: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 4 * dim),
                            torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        for _ in range(layers)])
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (4,))
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {}
        for i in range(layers):
            plan[f"{i}.1"] = ColwiseParallel()
            plan[f"{i}.3"] = RowwiseParallel()
        parallelize_module(model, mesh2["tp"], plan)
        mesh = mesh2["dp"]
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, dim)).sum().backward()
    opt.step()
    return model, opt


def storage(backend: str, path: Path, write: bool):
    import torch.distributed.checkpoint as dcp

    import lean_store.interop.dcp as lsd

    if backend == "dcp-filesystem":
        return dcp.FileSystemWriter(path) if write else dcp.FileSystemReader(path)
    return lsd.StorageWriter(path) if write else lsd.StorageReader(path)


def rank_main(rank: int, port: int, layout: str, dim: int, layers: int, root: Path,
              repeat: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=timedelta(seconds=600))
    model, opt = build(layout, dim, layers)
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, object] = {"layout": layout, "params": params}
    for backend in BACKENDS:
        suffix = {"lean_store-zarr": ".zarr", "lean_store-hdf5": ".h5"}.get(backend, "")
        saves, loads = [], []
        for r in range(repeat):
            path = root / f"{layout}-{backend}-{r}{suffix}"
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=storage(backend, path, True))
            dist.barrier()
            saves.append(time.perf_counter() - t0)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dist.barrier()
            t0 = time.perf_counter()
            dcp.load(state, storage_reader=storage(backend, path, False))
            dist.barrier()
            loads.append(time.perf_counter() - t0)
        if rank == 0:
            nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if (
                path.is_dir()) else path.stat().st_size
            out[backend] = {"save_s": min(saves), "load_s": min(loads),
                            "bytes": nbytes}
    if rank == 0:
        (root / f"{layout}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    sys.stdout.flush()  # then no interpreter finalization, which a gloo worker thread
    os._exit(0)  # can abort (the race in tests/gloo_world.py leave_world)


def run(layout: str, dim: int, layers: int, root: Path, repeat: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                               "--layout", layout, "--dim", str(dim), "--layers", str(layers),
                               "--dir", str(root), "--repeat", str(repeat)], env=env)
             for r in range(4)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a rank failed ({p.returncode})")
    return json.loads((root / f"{layout}.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layout", choices=("fsdp", "tp2x2", "both"), default="both")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.layout, args.dim, args.layers, Path(args.dir),
                  args.repeat)
        return
    root = Path(tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir))
    try:
        layouts = ("fsdp", "tp2x2") if args.layout == "both" else (args.layout,)
        for layout in layouts:
            rec = run(layout, args.dim, args.layers, root, args.repeat)
            print(f"{layout}: {rec['params'] / 1e6:.1f} M parameters + AdamW moments, 4 ranks")
            for backend in BACKENDS:
                r = rec[backend]
                print(f"  {backend:16s} save {r['save_s']:.3f} s  load {r['load_s']:.3f} s  "
                      f"on disk {r['bytes'] / 2**20:.1f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
