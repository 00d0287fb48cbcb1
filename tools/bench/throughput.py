"""Save/load throughput of lean_store against its peers, side by side in one process.

    .venv/bin/python tools/bench/throughput.py                 # 1 GiB state, 3 rounds
    .venv/bin/python tools/bench/throughput.py --size-gib 0.25 --rounds 1   # a quick run

The state is model-like: a few 256 MiB float32 tensors (half the bytes) and many 4 MiB ones.
Each round runs every method once, in turn, on the same state, and the table reports medians.
Every save is timed up to durable bytes: lean_store fsyncs before its atomic rename, so the
peers' files are fsynced too (``--no-fsync`` times the peers without it, and lean_store with its
fsync regardless). Loads read from a warm page cache right after the save; loaders that return
memory-mapped tensors (safetensors) have every page touched, so all methods deliver the bytes.
Results go to a JSON file (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import lean_store as ls

MiB = 1 << 20
GiB = 1 << 30


def make_state(size_gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    total = int(size_gib * GiB)
    big = min(256 * MiB, max(4 * MiB, total // 4))
    n_big = max(1, (total // 2) // big)
    n_small = max(1, (total - n_big * big) // (4 * MiB))
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for i in range(n_small):
        state[f"layers.{i}.weight"] = torch.randn(1024, 1024, generator=g)
    for i in range(n_big):
        state[f"embed.{i}.weight"] = torch.randn(big // 4096, 1024, generator=g)
    return state


def nbytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def fsync_path(path: Path) -> None:
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def touch(value: Any) -> None:
    """Fault in every page of a (possibly memory-mapped) tensor or array."""
    arr = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size:
        int(flat[::4096].sum())


# --------------------------------------------------------------------------------- methods


def numpy_raw(state: dict[str, torch.Tensor]) -> tuple[Callable, Callable]:
    arrays = {k: v.numpy() for k, v in state.items()}

    def save(path: Path) -> None:
        with open(path, "wb") as f:
            for a in arrays.values():
                a.tofile(f)

    def load(path: Path) -> dict[str, np.ndarray]:
        flat = np.fromfile(path, dtype=np.float32)
        out, at = {}, 0
        for k, a in arrays.items():
            out[k] = flat[at : at + a.size].reshape(a.shape)
            at += a.size
        return out

    return save, load


def safetensors_numpy(state: dict[str, torch.Tensor]) -> tuple[Callable, Callable]:
    from safetensors.numpy import load_file, save_file

    arrays = {k: v.numpy() for k, v in state.items()}
    return (lambda path: save_file(arrays, str(path))), (lambda path: load_file(str(path)))


def safetensors_torch(state: dict[str, torch.Tensor]) -> tuple[Callable, Callable]:
    from safetensors.torch import load_file, save_file

    return (lambda path: save_file(state, str(path))), (lambda path: load_file(str(path)))


def torch_save(state: dict[str, torch.Tensor]) -> tuple[Callable, Callable]:
    return (lambda path: torch.save(state, path)), (
        lambda path: torch.load(path, weights_only=True)
    )


def lean_store_method(backend: str) -> Callable:
    def make(state: dict[str, torch.Tensor]) -> tuple[Callable, Callable]:
        return (lambda path: ls.save(state, path, backend=backend, progress=False)), (
            lambda path: ls.load_state(path)
        )

    return make


METHODS: dict[str, tuple[str, Callable]] = {
    "numpy tofile/fromfile": (".bin", numpy_raw),
    "safetensors.numpy": (".safetensors", safetensors_numpy),
    "safetensors.torch": (".safetensors", safetensors_torch),
    "torch.save/load": (".pt", torch_save),
    "lean_store hdf5": (".h5", lean_store_method("hdf5")),
    "lean_store zarr": (".zarr", lean_store_method("zarr")),
}
LEAN = ("lean_store hdf5", "lean_store zarr")


def check_bits(state: dict[str, torch.Tensor], loaded: dict[str, Any], method: str) -> None:
    for k, v in state.items():
        got = loaded[k]
        got = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
        if not np.array_equal(got.view(np.uint32), v.numpy().view(np.uint32)):
            raise SystemExit(f"{method}: tensor {k} does not round-trip bit-exactly")


def run(args: argparse.Namespace) -> dict[str, Any]:
    state = make_state(args.size_gib)
    size = nbytes(state)
    print(f"state: {len(state)} float32 tensors, {size / GiB:.2f} GiB; "
          f"{args.rounds} rounds in {args.dir}", flush=True)
    methods = {m: METHODS[m] for m in args.methods}
    prepared = {m: make(state) for m, (_, make) in methods.items()}
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in methods}
    work = Path(tempfile.mkdtemp(prefix="lean_store-bench-", dir=args.dir))
    try:
        for r in range(args.rounds):
            for m, (suffix, _) in methods.items():
                save, load = prepared[m]
                path = work / f"ck{suffix}"
                t0 = time.perf_counter()
                save(path)
                if args.fsync and m not in LEAN:
                    fsync_path(path)
                t1 = time.perf_counter()
                loaded = load(path)
                for v in loaded.values():
                    touch(v)
                t2 = time.perf_counter()
                if r == 0:
                    check_bits(state, loaded, m)
                del loaded
                times[m]["save"].append(t1 - t0)
                times[m]["load"].append(t2 - t1)
                print(f"  round {r + 1} {m:24s} save {size / GiB / (t1 - t0):6.2f} GiB/s   "
                      f"load {size / GiB / (t2 - t1):6.2f} GiB/s", flush=True)
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        m: {op: size / GiB / statistics.median(ts) for op, ts in ops.items()}
        for m, ops in times.items()
    }
    ratios = {
        lean: {
            peer: {op: results[lean][op] / results[peer][op] for op in ("save", "load")}
            for peer in results if peer not in LEAN
        }
        for lean in LEAN if lean in results
    }
    return {
        "state_bytes": size,
        "tensors": len(state),
        "rounds": args.rounds,
        "fsync_peers": args.fsync,
        "directory": str(args.dir),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "torch": torch.__version__},
        "gib_per_s": results,
        "ratios": ratios,
        "raw_seconds": times,
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"\nmedian GiB/s over {report['rounds']} rounds, {report['state_bytes'] / GiB:.2f} GiB")
    print(f"{'method':26s}{'save':>9s}{'load':>9s}")
    for m, r in report["gib_per_s"].items():
        print(f"{m:26s}{r['save']:9.2f}{r['load']:9.2f}")
    for lean, peers in report["ratios"].items():
        print(f"\n{lean} / peer{'save':>14s}{'load':>9s}")
        for peer, r in peers.items():
            print(f"  / {peer:30s}{r['save']:6.2f}x{r['load']:8.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--json", default="throughput.json", help="results file")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false",
                        help="do not fsync the peers' files (lean_store always does)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args(argv)
    report = run(args)
    print_table(report)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
