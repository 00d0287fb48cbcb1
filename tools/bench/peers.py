"""Per-tensor cost of lean_store against its peers: many-tensor states, side by side in one process.

    .venv/bin/python tools/bench/peers.py                  # every workload, median of 3
    .venv/bin/python tools/bench/peers.py --quick          # tiny sizes, one round (a smoke run)
    .venv/bin/python tools/bench/peers.py --workload tiny --repeat 5

Workloads (float32 unless said): ``resnet50`` (320 tensors, ~100 MB: conv kernels, BN vectors),
``llm`` (~1,000 tensors, ~200 MB: matrices plus many LayerNorm/bias vectors), ``tiny`` (1,000
tensors of 64 values), ``big`` (128 x 4 MiB) and ``sharded`` (an FSDP2 transformer state on 4
gloo ranks against DCP: tools/bench/fsdp_peers.py, run in its own processes). Peers: lean_store
HDF5 and Zarr (``save`` / ``load_state``), safetensors (``safetensors.torch.save_file``, numpy
``load_file``), ``torch.save`` / ``torch.load``, DCP in one process
(``FileSystemWriter`` / ``FileSystemReader``, ``no_dist=True``) and raw numpy (``np.save`` /
``np.load`` of each tensor in one directory). Files go to ``--dir`` (default /dev/shm); every
peer writes as it does by default (lean_store's saves are durable, which costs nothing on
tmpfs; DCP's ``FileSystemWriter`` fsyncs; safetensors and torch.save do not). The table
gives medians in seconds and ratios *peer time / lean_store HDF5 time* (> 1: lean_store
faster); the fitted per-tensor cost is the least-squares slope of time
against tensor count over the workloads run (with a per-byte term when there are three or more).

``--overwrite``: every round of a peer saves over the checkpoint its previous round wrote
(the path a job rewrites as its "latest" checkpoint), so that each save also replaces a file
or tree of the same size: safetensors and torch.save truncate the old file when they open it,
lean_store renames its new file or tree over the old one (docs/PERFORMANCE.md, "Saves over an
existing checkpoint"); without it every save goes to a new directory.

The rounds above run in one process after a warm-up, as a process that loads again and again
does. ``--first-load`` also times each peer's first load in a new process (its libraries
imported first, not timed), as a job that resumes once does: one subprocess per peer and
workload, the file written by this process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Method = tuple[Callable[[dict[str, Any], Path], None], Callable[[Path, dict[str, Any]], None]]


def workloads(quick: bool) -> dict[str, dict[str, np.ndarray]]:
    """name -> {tensor name: float32 array}. ``quick``: the same shapes, far smaller."""
    rng = np.random.default_rng(0)
    d = 8 if quick else 1  # quick: narrower tensors and a tenth of the tensors
    n = 10 if quick else 1

    def arr(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    resnet: dict[str, np.ndarray] = {}
    widths = [64, 128, 256, 320]  # ~110 MB of float32
    for i in range(64 // n):  # 64 conv + 64 BN (4 tensors) + ... = 320 tensors
        w = max(2, widths[min(3, i // 16)] // d)
        resnet[f"layer{i}.conv.weight"] = arr(w, w, 3, 3)
        for k in ("weight", "bias", "running_mean", "running_var"):
            resnet[f"layer{i}.bn.{k}"] = arr(w)
    llm: dict[str, np.ndarray] = {}
    h = 320 // d
    llm["embed.weight"] = arr(8000 // d, h)
    for i in range(100 // n):  # 10 tensors per block: 4 matrices, 6 vectors
        p = f"blocks.{i}."
        llm[p + "attn.qkv.weight"] = arr(3 * h, h)
        llm[p + "attn.proj.weight"] = arr(h, h)
        llm[p + "mlp.fc1.weight"] = arr(h, h // 2)
        llm[p + "mlp.fc2.weight"] = arr(h // 2, h)
        for k in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.qkv.bias",
                  "mlp.fc1.bias"):
            llm[p + k] = arr(h)
    for k in range(10):
        llm[f"head.{k}"] = arr(h)
    tiny = {f"t{i}": arr(64) for i in range(100 if quick else 1000)}
    big = {f"b{i}": arr((1 << 20) // d) for i in range(16 if quick else 128)}
    return {"resnet50": resnet, "llm": llm, "tiny": tiny, "big": big}


def _lean(backend: str) -> Method:
    import importlib

    import lean_store as ls

    # the backend's modules (h5py, numcodecs, zarr), which lean_store imports at first use:
    # imported here as every peer's libraries are, so a first load times the load alone
    for module in {"hdf5": ("store", "sharded"), "zarr": ("store",)}[backend]:
        importlib.import_module(f"lean_store.stores.{backend}.{module}")

    suffix = ".h5" if backend == "hdf5" else ".zarr"

    def save(state: dict[str, Any], d: Path) -> None:
        ls.save(state, d / f"ckpt{suffix}", progress=False)

    def load(d: Path, like: dict[str, Any]) -> None:
        ls.load_state(d / f"ckpt{suffix}")

    return save, load


def _safetensors() -> Method:
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    def save(state: dict[str, Any], d: Path) -> None:
        save_file({k: torch.from_numpy(v) for k, v in state.items()}, str(d / "m.safetensors"))

    def load(d: Path, like: dict[str, Any]) -> None:
        load_file(str(d / "m.safetensors"))

    return save, load


def _torch() -> Method:
    import torch

    def save(state: dict[str, Any], d: Path) -> None:
        torch.save({k: torch.from_numpy(v) for k, v in state.items()}, d / "m.pt")

    def load(d: Path, like: dict[str, Any]) -> None:
        torch.load(d / "m.pt", weights_only=True)

    return save, load


def _dcp() -> Method:
    import torch
    import torch.distributed.checkpoint as dcp

    def save(state: dict[str, Any], d: Path) -> None:
        dcp.save({k: torch.from_numpy(v) for k, v in state.items()},
                 storage_writer=dcp.FileSystemWriter(str(d / "dcp")), no_dist=True)

    def load(d: Path, like: dict[str, Any]) -> None:
        target = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in like.items()}
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(d / "dcp")), no_dist=True)

    return save, load


def _numpy() -> Method:
    def save(state: dict[str, Any], d: Path) -> None:
        (d / "np").mkdir(exist_ok=True)  # --overwrite: the same files written again
        for i, v in enumerate(state.values()):
            np.save(d / "np" / f"{i}.npy", v)

    def load(d: Path, like: dict[str, Any]) -> None:
        for i in range(len(like)):
            np.load(d / "np" / f"{i}.npy")

    return save, load


PEERS: dict[str, Callable[[], Method]] = {
    "lean_store hdf5": lambda: _lean("hdf5"),
    "lean_store zarr": lambda: _lean("zarr"),
    "safetensors": _safetensors,
    "torch.save": _torch,
    "dcp 1 proc": _dcp,
    "numpy": _numpy,
}
BASELINE = "lean_store hdf5"


def measure(states: dict[str, dict[str, np.ndarray]], peers: list[str], repeat: int,
            root: Path, overwrite: bool = False) -> dict[tuple[str, str], tuple[float, float]]:
    """(workload, peer) -> (median save s, median load s); rounds interleave the peers.
    ``overwrite``: each peer saves over its previous round's checkpoint (the "latest" file
    a training job rewrites), not into a new directory."""
    methods: dict[str, Method] = {}
    for name in peers:
        try:
            methods[name] = PEERS[name]()
        except ImportError as exc:
            print(f"{name}: not available ({exc})", file=sys.stderr)
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for wname, state in states.items():
        times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in methods}
        kept = {n: Path(tempfile.mkdtemp(dir=root, prefix="peers-")) for n in methods}
        for r in range(repeat + (1 if overwrite else 0)):  # overwrite: round 0 makes the file
            for name, (save, load) in methods.items():
                d = kept[name] if overwrite else Path(tempfile.mkdtemp(dir=root, prefix="peers-"))
                try:
                    t0 = time.perf_counter()
                    save(state, d)
                    t1 = time.perf_counter()
                    _settle(name)
                    t2 = time.perf_counter()
                    load(d, state)
                    t3 = time.perf_counter()
                finally:
                    if not overwrite:
                        shutil.rmtree(d, ignore_errors=True)
                if overwrite and r == 0:
                    continue
                times[name][0].append(t1 - t0)
                times[name][1].append(t3 - t2)
        for d in kept.values():
            shutil.rmtree(d, ignore_errors=True)
        for name, (s, lo) in times.items():
            out[wname, name] = (statistics.median(s), statistics.median(lo))
    return out


def _settle(peer: str) -> None:
    """Untimed, after a save: lean_store frees the blocks of a file it replaced on a
    background thread after its save returned (lean_store.stores.old_files); that work is
    waited for here so that it is not charged to the peer timed next."""
    if peer.startswith("lean_store"):
        from lean_store.stores import old_files

        old_files.wait_released()


def first_loads(states: dict[str, dict[str, np.ndarray]], peers: list[str], root: Path,
                quick: bool) -> dict[tuple[str, str], float]:
    """(workload, peer) -> seconds of one load in a new process (``--time-first-load``)."""
    out: dict[tuple[str, str], float] = {}
    for wname, state in states.items():
        for name in peers:
            try:
                save, _load = PEERS[name]()
            except ImportError:
                continue
            d = Path(tempfile.mkdtemp(dir=root, prefix="first-"))
            try:
                save(state, d)
                done = subprocess.run(
                    [sys.executable, __file__, "--time-first-load", name, str(d), wname,
                     *(["--quick"] if quick else [])],
                    capture_output=True, text=True, timeout=600, check=True)
                out[wname, name] = float(done.stdout.strip().splitlines()[-1])
            finally:
                shutil.rmtree(d, ignore_errors=True)
    return out


def first_load_report(results: dict[tuple[str, str], float]) -> str:
    peers = list(dict.fromkeys(p for _, p in results))
    lines = ["first load in a new process (s; ratio: peer time / lean_store HDF5 time):",
             "| workload | " + " | ".join(peers) + " |", "|---" * (len(peers) + 1) + "|"]
    for wname in dict.fromkeys(w for w, _ in results):
        base = results.get((wname, BASELINE))
        cells = []
        for p in peers:
            t = results.get((wname, p))
            cells.append("-" if t is None else f"{t:.4f}" + (
                f" ({t / base:.2f})" if base else ""))
        lines.append(f"| {wname} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _time_first_load(name: str, directory: str, wname: str, quick: bool) -> None:
    """In the subprocess: the peer's libraries imported, then one load timed, printed."""
    like = workloads(quick)[wname]
    _save, load = PEERS[name]()
    t0 = time.perf_counter()
    load(Path(directory), like)
    print(f"{time.perf_counter() - t0:.6f}")


def per_tensor_cost(points: list[tuple[int, int, float]]) -> float | None:
    """Least-squares seconds per tensor from (tensors, bytes, seconds) points: time ~ a +
    b*tensors (+ c*bytes with three or more points). None with fewer than two counts."""
    if len({n for n, _, _ in points}) < 2:
        return None
    cols = [[1.0, float(n)] + ([float(b)] if len(points) >= 3 else []) for n, b, _ in points]
    coef, *_ = np.linalg.lstsq(np.array(cols), np.array([t for _, _, t in points]), rcond=None)
    return float(coef[1])


def report(states: dict[str, dict[str, np.ndarray]],
           results: dict[tuple[str, str], tuple[float, float]]) -> str:
    peers = list(dict.fromkeys(p for _, p in results))
    lines = ["| workload | tensors | MB | peer | save s | load s | save ratio | load ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for wname, state in states.items():
        base = results.get((wname, BASELINE))
        mb = sum(v.nbytes for v in state.values()) / 1e6
        for p in peers:
            if (wname, p) not in results:
                continue
            s, lo = results[wname, p]
            ratio = (f"{s / base[0]:.2f} | {lo / base[1]:.2f}" if base else "- | -")
            lines.append(f"| {wname} | {len(state)} | {mb:.1f} | {p} | {s:.4f} | {lo:.4f} | "
                         f"{ratio} |")
    lines.append("")
    lines.append("fitted per-tensor cost (ms), save / load:")
    for p in peers:
        pts_s = [(len(st), sum(v.nbytes for v in st.values()), results[w, p][0])
                 for w, st in states.items() if (w, p) in results]
        pts_l = [(n, b, results[w, p][1]) for (n, b, _), w in zip(pts_s, states)]
        fs, fl = per_tensor_cost(pts_s), per_tensor_cost(pts_l)
        tiny = results.get(("tiny", p))
        fit = "-" if fs is None or fl is None else f"{fs * 1e3:.3f} / {fl * 1e3:.3f}"
        per = "" if tiny is None else (
            f"  (tiny workload / its count: {tiny[0] / len(states['tiny']) * 1e3:.3f} / "
            f"{tiny[1] / len(states['tiny']) * 1e3:.3f})")
        lines.append(f"  {p}: {fit}{per}")
    return "\n".join(lines)


FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
"""glibc allocator settings the benchmark re-executes itself with (unless ``--malloc-as-is``).
With glibc's default, the mmap threshold moves with what was freed last, so one peer's
allocations decide whether the next peer's new arrays take fresh zeroed pages (page faults)
or reused heap: safetensors' numpy load of the same resnet50 file took 0.03 or 0.09 s
depending on the peer run before it. Fixed, every peer reuses heap pages alike."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (median reported)")
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    parser.add_argument("--workload", action="append",
                        choices=["resnet50", "llm", "tiny", "big", "sharded"])
    parser.add_argument("--peer", action="append", choices=list(PEERS))
    parser.add_argument("--first-load", action="store_true",
                        help="also time each peer's first load in a new process")
    parser.add_argument("--time-first-load", nargs=3, metavar=("PEER", "DIR", "WORKLOAD"),
                        help=argparse.SUPPRESS)  # the subprocess of --first-load
    parser.add_argument("--overwrite", action="store_true",
                        help="each peer saves over its previous checkpoint (a 'latest' file)")
    parser.add_argument("--malloc-as-is", action="store_true",
                        help="keep glibc's dynamic mmap threshold (see FIXED_MALLOC)")
    args = parser.parse_args(argv)
    if args.time_first_load:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _time_first_load(*args.time_first_load, quick=args.quick)
        return 0
    if argv is None and not args.malloc_as_is and any(
            os.environ.get(k) != v for k, v in FIXED_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **FIXED_MALLOC})
    print("allocator: " + (" ".join(f"{k}={os.environ[k]}" for k in FIXED_MALLOC
                                    if k in os.environ) or "glibc's defaults"))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    states = workloads(args.quick)
    if args.workload:
        states = {k: v for k, v in states.items() if k in args.workload}
    repeat = 1 if args.quick and args.repeat == 3 else args.repeat
    if states:
        root = Path(tempfile.mkdtemp(dir=args.dir, prefix="lean_store-peers-"))
        try:
            results = measure(states, args.peer or list(PEERS), repeat, root, args.overwrite)
            first = first_loads(states, args.peer or list(PEERS), root, args.quick) if (
                args.first_load) else {}
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(report(states, results))
        if first:
            print()
            print(first_load_report(first))
    if not args.workload or "sharded" in args.workload:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import fsdp_peers

        size = {"dim": 64, "layers": 2, "vocab": 256} if args.quick else {}
        print()
        print(fsdp_peers.report(fsdp_peers.run(repeat=repeat, directory=args.dir, **size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
