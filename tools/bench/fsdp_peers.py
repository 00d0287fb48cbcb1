"""The 4-rank sharded workload of tools/bench/peers.py: DCP against lean_store HDF5 and Zarr.

FSDP2 (``fully_shard`` per block and on the whole model) shards a small transformer (~3.7 M
parameters: an embedding, ``--layers`` pre-norm blocks of width ``--dim`` with fused QKV,
output projection and a 4x MLP, a final LayerNorm and head) over ``--world`` gloo ranks on the
CPU, started with ``torch.multiprocessing``. One AdamW step creates the moments, so the state
is ~3x the parameters (~44 MB). Every round saves and loads it with each method, between
barriers, timed on rank 0; one warm-up round is not counted, then the median of ``--repeat``
rounds (methods interleaved within a round, a fresh directory per save; a full collection of
Python's collector before each timed save and load, so that no method pays for the collections
the allocations of the one timed before it set off: lean_store pauses the collector while a
sharded save or load runs, and would otherwise leave its count of allocations to the next):

- ``dcp``: ``dcp.save`` / ``dcp.load`` of ``{"model": ..., "optim": ...}`` from
  ``get_state_dict`` with DCP's ``FileSystemWriter`` / ``FileSystemReader``;
- ``lean_store hdf5`` / ``lean_store zarr``: ``ls.save`` / ``ls.load`` of
  ``lean_store.distributed.training_state(model, optimizer)`` (DTensors kept: every rank writes
  its own shards; the load verifies every shard's digest and installs in place).

    .venv/bin/python tools/bench/fsdp_peers.py --repeat 3          # or: peers.py --workload sharded
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

METHODS = ("dcp", "lean_store hdf5", "lean_store zarr")


def build(dim: int, layers: int, vocab: int) -> tuple[Any, Any]:
    """The FSDP2-sharded model and its AdamW optimizer after one step."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.ln2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)

        def forward(self, x: Any) -> Any:
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            att = torch.softmax(q @ k.transpose(-1, -2) / dim ** 0.5, dim=-1)
            x = x + self.proj(att @ v)
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, vocab, (2, 16))).float().mean().backward()
    opt.step()
    return model, opt


def _dcp(model: Any, opt: Any, path: Path, save: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if save:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
    else:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))


def _lean(model: Any, opt: Any, path: Path, save: bool) -> None:
    import lean_store as ls
    from lean_store.distributed import training_state

    state = training_state(model, opt)
    if save:
        ls.save(state, path, progress=False)
    else:
        ls.load(state, path, progress=False)


def rank_main(rank: int, world: int, port: int, root: str, dim: int, layers: int, vocab: int,
              repeat: int, profile: str | None = None) -> None:
    """One rank: build the state, run warm-up + ``repeat`` rounds, rank 0 writes results.json.
    ``profile``: a directory where each rank writes the cProfile stats of its lean_store saves
    and loads after the warm-up (``<method>-<save|load>-rank<r>.prof``)."""
    import cProfile
    import gc

    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    try:
        model, opt = build(dim, layers, vocab)
        params = sum(p.numel() for p in model.parameters())
        nbytes = sum(v.numel() * v.element_size() for v in
                     _full_sizes(model, opt))
        times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in METHODS}
        cpu: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in METHODS}
        for r in range(repeat + 1):
            for method in METHODS:
                suffix = {"lean_store hdf5": ".h5", "lean_store zarr": ".zarr"}.get(method, "")
                path = Path(root) / f"r{r}-{method.replace(' ', '_')}{suffix}"
                fn = _dcp if method == "dcp" else _lean
                for i, save in enumerate((True, False)):
                    gc.collect()  # no collector debt left by the method timed before
                    dist.barrier()
                    prof = (cProfile.Profile(time.process_time)
                            if profile and r and method != "dcp" else None)
                    t0, c0 = time.perf_counter(), time.process_time()
                    if prof is not None:
                        prof.runcall(fn, model, opt, path, save)
                    else:
                        fn(model, opt, path, save)
                    c1 = time.process_time()
                    dist.barrier()
                    if prof is not None:
                        what = ("save", "load")[i]
                        prof.dump_stats(str(Path(profile) / f"{method.replace(' ', '_')}-"
                                                             f"{what}-r{r}-rank{rank}.prof"))
                    if r:  # round 0 is the warm-up
                        times[method][i].append(time.perf_counter() - t0)
                        cpu[method][i].append(c1 - c0)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
        (Path(root) / f"cpu-{rank}.json").write_text(json.dumps(
            {m: [statistics.median(s), statistics.median(lo)] for m, (s, lo) in cpu.items()}))
        dist.barrier()
        if rank == 0:
            ranks = [json.loads((Path(root) / f"cpu-{q}.json").read_text()) for q in range(world)]
            out = {"params": params, "bytes": nbytes, "world": world,
                   "medians": {m: [statistics.median(s), statistics.median(lo)]
                               for m, (s, lo) in times.items()},
                   "cpu": {m: [sum(c[m][0] for c in ranks), sum(c[m][1] for c in ranks)]
                           for m in METHODS}}
            (Path(root) / "results.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()  # then no interpreter finalization, which a gloo worker thread
    os._exit(0)  # can abort (the race in tests/gloo_world.py leave_world)


def _full_sizes(model: Any, opt: Any) -> list[Any]:
    """Global tensors of the state (DTensors by their global shape), for its size in bytes."""
    import torch

    from lean_store.distributed import training_state

    out = []
    for v in training_state(model, opt).values():
        out.append(torch.empty(tuple(v.shape), dtype=v.dtype, device="meta"))
    return out


def _spawned(rank: int, *args: Any) -> None:
    rank_main(rank, *args)


def run(world: int = 4, dim: int = 256, layers: int = 4, vocab: int = 1024, repeat: int = 3,
        directory: str | None = None, profile: str | None = None) -> dict[str, Any]:
    """Spawn ``world`` ranks, return {"params", "bytes", "world", "medians": {method: [save s,
    load s]}}."""
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix="lean_store-fsdp-", dir=directory)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_spawned, args=(world, port, root, dim, layers, vocab, repeat, profile),
                 nprocs=world,
                 join=True)
        return json.loads((Path(root) / "results.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(res: dict[str, Any]) -> str:
    """A markdown table: medians and ratios DCP time / method time (> 1: faster than DCP)."""
    med = res["medians"]
    ds, dl = med["dcp"]
    cpu = res["cpu"]
    lines = [f"sharded: FSDP2 transformer, {res['params'] / 1e6:.2f} M parameters + AdamW moments "
             f"({res['bytes'] / 1e6:.1f} MB), {res['world']} gloo ranks on the CPU; medians of "
             "the rounds after a warm-up; CPU: the ranks' process times added up",
             "| method | save s | load s | save ratio (DCP / it) | load ratio (DCP / it) "
             "| save CPU s | load CPU s |",
             "|---|---|---|---|---|---|---|"]
    for m in METHODS:
        s, lo = med[m]
        lines.append(f"| {m} | {s:.4f} | {lo:.4f} | {ds / s:.2f} | {dl / lo:.2f} "
                     f"| {cpu[m][0]:.3f} | {cpu[m][1]:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--profile", metavar="DIR",
                    help="write each rank's cProfile stats of the lean_store saves and loads")
    args = ap.parse_args(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    res = run(args.world, args.dim, args.layers, args.vocab, args.repeat, args.dir,
              str(Path(args.profile).resolve()) if args.profile else None)
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
