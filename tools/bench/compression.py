"""Size and speed of ``compression="weights"`` and of incremental steps, side by side.

    .venv/bin/python tools/bench/compression.py                  # defaults (a few minutes)
    .venv/bin/python tools/bench/compression.py --width 256 --train-steps 50 --rounds 1  # quick

Weights are real trained weights: a small residual MLP (``--layers`` blocks of
width x 4width x width) trained with AdamW for ``--train-steps`` steps on a synthetic regression
task. Its parameters are saved as float32, bfloat16, float16 and float8_e4m3fn (bf16 and fp16 by
torch casts, fp8 by an ml_dtypes cast), on both backends, uncompressed and with
``compression="weights"`` (Blosc on both), and on HDF5 with the plugin-free
``compression="weights-gzip"``. Each round saves (fsynced, atomic, as ``ls.save`` always does) then
loads (``ls.load_state``, warm page cache, every chunk CRC-checked) each setting in turn; the
table gives the fastest round (the machine is shared: interference only adds time), sizes on
disk and the ratios the targets are stated in.

Incremental: a larger MLP of the same shape (``--incremental-width``) fine-tuned with only its
last Linear layer trainable (~90 % of its parameters frozen), saved as Zarr training checkpoints
by ``Checkpointer(incremental=True)`` against full steps of the same state, with and without
its AdamW moments: each step's state is saved both ways, in alternating order, each save after
the steps its Checkpointer pruned before are removed (in training, the time between saves lets
the background removal finish). ``--incremental-only`` runs this part alone.
``--stages`` also times each codec stage alone on the same weights (single calls, fastest of
5): Blosc zstd level 1 with its byte shuffle and 1 MiB blocks on one thread (as on the save's
pool threads) and on Blosc's own two threads, its decompression, the byte shuffle alone
(numpy), zstd level 1 on each byte plane alone (speed and stored fraction), and CRC-32C.
Results also go to a JSON file (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import google_crc32c
import ml_dtypes
import numpy as np
import torch
from numcodecs import blosc, zstd

import lean_store as ls

MiB = 1 << 20
COMPRESSIONS = {"hdf5": (None, "weights", "weights-gzip"), "zarr": (None, "weights")}


def mlp(width: int, layers: int, seed: int = 0) -> torch.nn.Sequential:
    """``layers`` blocks of LayerNorm, width x 4width, GELU, 4width x width."""
    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                   torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(*blocks)


def train(width: int, layers: int, steps: int, seed: int = 0) -> torch.nn.Module:
    """The MLP trained ``steps`` AdamW steps to fit a fixed random tanh map."""
    model = mlp(width, layers, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    target = torch.randn(width, width) / width**0.5
    for _ in range(steps):
        x = torch.randn(64, width)
        loss = (model(x) - torch.tanh(x @ target)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def formats_of(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    params = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    return {
        "float32": params,
        "bfloat16": {k: v.to(torch.bfloat16) for k, v in params.items()},
        "float16": {k: v.to(torch.float16) for k, v in params.items()},
        "float8_e4m3fn": {k: v.numpy().astype(ml_dtypes.float8_e4m3fn)
                          for k, v in params.items()},
    }


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() if hasattr(v, "element_size") else v.nbytes
               for v in state.values())


def bench_formats(model: torch.nn.Module, work: Path, rounds: int) -> list[dict[str, Any]]:
    rows = []
    states = formats_of(model)
    settings = [(fmt, backend, comp) for fmt in states for backend in ("hdf5", "zarr")
                for comp in COMPRESSIONS[backend]]
    times: dict[tuple, dict[str, list[float]]] = {s: {"save": [], "load": []} for s in settings}
    sizes: dict[tuple, int] = {}
    for _ in range(rounds):
        for fmt, backend, comp in settings:
            path = work / f"{fmt}-{comp}{'.h5' if backend == 'hdf5' else '.zarr'}"
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            t0 = time.perf_counter()
            ls.save(states[fmt], path, compression=comp)
            t1 = time.perf_counter()
            ls.load_state(path)
            t2 = time.perf_counter()
            times[(fmt, backend, comp)]["save"].append(t1 - t0)
            times[(fmt, backend, comp)]["load"].append(t2 - t1)
            sizes[(fmt, backend, comp)] = disk_bytes(path)
    for fmt, backend, comp in settings:
        raw = raw_bytes(states[fmt])
        # min of the rounds: the machine is shared, and interference only ever adds time
        save = min(times[(fmt, backend, comp)]["save"])
        load = min(times[(fmt, backend, comp)]["load"])
        rows.append({"format": fmt, "backend": backend, "compression": comp or "none",
                     "raw_bytes": raw, "disk_bytes": sizes[(fmt, backend, comp)],
                     "save_s": save, "load_s": load,
                     "save_MiB_s": raw / MiB / save, "load_MiB_s": raw / MiB / load})
    base = {(r["format"], r["backend"]): r for r in rows if r["compression"] == "none"}
    for r in rows:
        b = base[(r["format"], r["backend"])]
        r["size_vs_uncompressed"] = r["disk_bytes"] / b["disk_bytes"]
        r["saving_vs_raw"] = 1 - r["disk_bytes"] / r["raw_bytes"]
        r["save_speed_vs_uncompressed"] = b["save_s"] / r["save_s"]
        r["load_speed_vs_uncompressed"] = b["load_s"] / r["load_s"]
    return rows


def print_side_by_side(rows: list[dict[str, Any]]) -> None:
    """Per format, each compressed setting's saving and save/load speed relative to the same
    backend uncompressed (the targets: save >= 0.5x, load >= 0.7x)."""
    columns = [(b, c) for b, comps in COMPRESSIONS.items() for c in comps if c]
    by = {(r["format"], r["backend"], r["compression"]): r for r in rows}
    print("\nsaving / save x / load x against the same backend uncompressed:")
    print(f"{'format':14} " + " ".join(f"{b + ' ' + c:>24}" for b, c in columns))
    for fmt in dict.fromkeys(r["format"] for r in rows):
        cells = []
        for b, c in columns:
            r = by[(fmt, b, c)]
            cells.append(f"{r['saving_vs_raw']:6.1%} {r['save_speed_vs_uncompressed']:5.2f}x "
                         f"{r['load_speed_vs_uncompressed']:5.2f}x")
        print(f"{fmt:14} " + " ".join(f"{cell:>24}" for cell in cells))


def _fastest(run: Any, *args: Any, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        run(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def _compress_all(chunks: list[np.ndarray], itemsize: int) -> list[bytes]:
    return [blosc.compress(c, b"zstd", 1, blosc.SHUFFLE, 1 << 20, typesize=itemsize)
            for c in chunks]


def _decompress_all(frames: list[bytes], chunks: list[np.ndarray], out: np.ndarray) -> None:
    for frame, chunk in zip(frames, chunks):
        blosc.decompress(frame, out[: chunk.size])


def _shuffle_all(words: list[np.ndarray]) -> None:
    for w in words:
        w.T.copy()


def _zstd_all(codec: Any, planes: list[np.ndarray]) -> list[bytes]:
    return [codec.encode(p) for p in planes]


def _crc_all(chunks: list[np.ndarray]) -> None:
    for c in chunks:
        google_crc32c.value(c)


def _stages(words: np.ndarray, itemsize: int) -> dict[str, float]:
    """The stages on ``words`` (flat uint8) cut into 4 MiB chunks."""
    chunks = [words[i: i + (4 << 20)] for i in range(0, words.size, 4 << 20)]
    mib = words.size / MiB
    row: dict[str, float] = {}
    frames = _compress_all(chunks, itemsize)
    out = np.empty(4 << 20, np.uint8)
    for n in (1, 2):
        blosc.set_nthreads(n)
        row[f"blosc compress {n} thread(s)"] = mib / _fastest(_compress_all, chunks, itemsize)
        row[f"blosc decompress {n} thread(s)"] = mib / _fastest(_decompress_all, frames,
                                                                chunks, out)
    row["stored fraction"] = sum(len(f) for f in frames) / words.size
    whole = [c[: c.size // itemsize * itemsize].reshape(-1, itemsize) for c in chunks]
    row["numpy byte shuffle"] = mib / _fastest(_shuffle_all, whole)
    codec = zstd.Zstd(1)
    for k in range(itemsize):
        planes = [np.ascontiguousarray(w[:, k]) for w in whole]
        size = sum(p.size for p in planes)
        row[f"zstd 1 plane {k}"] = size / MiB / _fastest(_zstd_all, codec, planes, repeat=3)
        row[f"zstd 1 plane {k} stored fraction"] = sum(
            len(f) for f in _zstd_all(codec, planes)) / size
    row["crc32c"] = mib / _fastest(_crc_all, chunks)
    return row


def bench_codec_stages(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """MiB/s of each stage of ``compression="weights"`` alone, per format, over all of the
    weights cut into 4 MiB chunks (the default chunk size)."""
    result: dict[str, dict[str, float]] = {}
    threads = blosc.get_nthreads()
    try:
        for fmt, state in formats_of(model).items():
            arrays = [v if isinstance(v, np.ndarray) else v.view(torch.uint8).numpy()
                      for v in state.values()]
            words = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                                    for a in arrays])
            first = next(iter(state.values()))
            itemsize = first.itemsize if isinstance(first, np.ndarray) else first.element_size()
            result[fmt] = _stages(words, itemsize)
    finally:
        blosc.set_nthreads(threads)
    return result


def print_codec_stages(stages: dict[str, dict[str, Any]]) -> None:
    print("\ncodec stages alone (MiB/s of the stage's input; fastest of 5):")
    for fmt, row in stages.items():
        print(f"  {fmt}: " + ", ".join(
            f"{k} {v:.3f}" if "fraction" in k else f"{k} {v:.0f}" for k, v in row.items()))


def bench_incremental(model: torch.nn.Module, width: int, work: Path, steps: int
                      ) -> dict[str, Any]:
    """Fine-tune only the last Linear layer (the rest frozen); full vs incremental Zarr steps,
    of the model alone and of the model with its AdamW state (moments of the trainable 10 %)."""
    params = list(model.parameters())
    head = [m for m in model if isinstance(m, torch.nn.Linear)][-1]
    trainable = list(head.parameters())
    ids = {id(p) for p in trainable}
    for p in params:
        p.requires_grad_(id(p) in ids)
    total = sum(p.numel() for p in params)
    result: dict[str, Any] = {
        "frozen_fraction": 1 - sum(p.numel() for p in trainable) / total}
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    for what in ("model", "model+adamw"):
        cks = {mode: ls.Checkpointer(work / f"{what}-{mode}", backend="zarr", keep_last=3,
                                     incremental=mode == "incremental")
               for mode in ("full", "incremental")}
        times: dict[str, list[float]] = {mode: [] for mode in cks}
        written: dict[str, list[float]] = {mode: [] for mode in cks}
        for step in range(steps):
            loss = model(torch.randn(16, width)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            # the same state saved both ways, alternating which goes first (a shared machine's
            # interference falls on both); the steps pruned before are removed first, as a
            # training step's time would let the background removal finish
            for mode in (("full", "incremental") if step % 2 else ("incremental", "full")):
                ck = cks[mode]
                ck.finish_deletions()
                t0 = time.perf_counter()
                path = ck.save(step, model=model, rng=False,
                               optimizer=opt if what == "model+adamw" else None)
                times[mode].append(time.perf_counter() - t0)
                stats = ck.last_save_stats
                written[mode].append(disk_bytes(path) if stats is None or step == 0
                                     else stats.written_bytes)
        later = slice(1, None)  # step 0 of an incremental run has nothing to link to
        for mode, ck in cks.items():
            ck.finish_deletions()
            result[f"{what} {mode}"] = {
                "save_s": min(times[mode][later]),
                "save_s_median": statistics.median(times[mode][later]),
                "written_bytes": statistics.median(written[mode][later]),
                "steps_left": ck.steps(),
                "all_verify": all(ls.verify(ck.path(s)).ok for s in ck.steps())}
        full, inc = result[f"{what} full"], result[f"{what} incremental"]
        result[f"{what} bytes_ratio"] = inc["written_bytes"] / full["written_bytes"]
        result[f"{what} time_ratio"] = inc["save_s"] / full["save_s"]
        result[f"{what} time_ratio_median"] = inc["save_s_median"] / full["save_s_median"]
    return result


def print_incremental(inc: dict[str, Any], n_params: int, steps: int) -> None:
    print(f"\nincremental Zarr steps, {n_params / 1e6:.0f}M parameters, "
          f"{inc['frozen_fraction']:.0%} frozen (fastest of steps 1..{steps - 1}, median in "
          "brackets; bytes: chunk/shard files written):")
    for what in ("model", "model+adamw"):
        full, part = inc[f"{what} full"], inc[f"{what} incremental"]
        print(f"  {what:12} full step {full['written_bytes'] / MiB:8.2f} MiB "
              f"{full['save_s']:7.3f} s ({full['save_s_median']:.3f}) | incremental "
              f"{part['written_bytes'] / MiB:8.2f} MiB {part['save_s']:7.3f} s "
              f"({part['save_s_median']:.3f}) | bytes x{inc[f'{what} bytes_ratio']:.3f} "
              f"time x{inc[f'{what} time_ratio']:.3f} "
              f"({inc[f'{what} time_ratio_median']:.3f}) | steps left {part['steps_left']}, "
              f"all verify {part['all_verify']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--incremental-steps", type=int, default=6)
    ap.add_argument("--incremental-width", type=int, default=1024,
                    help="width of the (untrained) model of the incremental run")
    ap.add_argument("--incremental-only", action="store_true",
                    help="only the incremental steps (no training, no format table)")
    ap.add_argument("--cache", default=None,
                    help="a .pt file of the trained weights: loaded when present, else written")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stages", action="store_true",
                    help="also time each codec stage alone (shuffle, zstd per byte plane, ...)")
    ap.add_argument("--hdf5-compressions", default="weights,weights-gzip",
                    help="comma-separated HDF5 settings to compare with uncompressed (e.g. "
                         "'weights' alone, to measure a lean_store without 'weights-gzip')")
    args = ap.parse_args()
    if args.incremental_only:
        work = Path(tempfile.mkdtemp(prefix="lean_store-bench-", dir=args.dir))
        try:
            big = mlp(args.incremental_width, args.layers)
            inc = bench_incremental(big, args.incremental_width, work, args.incremental_steps)
            print_incremental(inc, sum(p.numel() for p in big.parameters()),
                              args.incremental_steps)
            if args.json:
                Path(args.json).write_text(json.dumps({"incremental": inc}, indent=1))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    COMPRESSIONS["hdf5"] = (None, *args.hdf5_compressions.split(","))
    t0 = time.perf_counter()
    if args.cache and Path(args.cache).exists():
        model = mlp(args.width, args.layers)
        model.load_state_dict(torch.load(args.cache, weights_only=True))
        how = f"loaded from {args.cache}"
    else:
        model = train(args.width, args.layers, args.train_steps)
        how = f"trained {args.train_steps} steps in {time.perf_counter() - t0:.0f} s"
        if args.cache:
            torch.save(model.state_dict(), args.cache)
    n = sum(p.numel() for p in model.parameters())
    print(f"{n / 1e6:.1f}M parameters, {how} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores)")
    work = Path(tempfile.mkdtemp(prefix="lean_store-bench-", dir=args.dir))
    try:
        (work / "formats").mkdir()
        stages = bench_codec_stages(model) if args.stages else None
        if stages is not None:
            print_codec_stages(stages)
        rows = bench_formats(model, work / "formats", rounds=args.rounds)
        print(f"\n{'format':14} {'backend':7} {'comp':12} {'MiB':>8} {'saving':>7} "
              f"{'save MiB/s':>10} {'load MiB/s':>10} {'save x':>7} {'load x':>7}")
        for r in rows:
            print(f"{r['format']:14} {r['backend']:7} {r['compression']:12} "
                  f"{r['disk_bytes'] / MiB:8.2f} {r['saving_vs_raw']:7.1%} "
                  f"{r['save_MiB_s']:10.0f} {r['load_MiB_s']:10.0f} "
                  f"{r['save_speed_vs_uncompressed']:7.2f} {r['load_speed_vs_uncompressed']:7.2f}")
        print_side_by_side(rows)
        inc = None
        if args.incremental_steps > 0:  # 0: the formats table alone
            big = mlp(args.incremental_width, args.layers)
            inc = bench_incremental(big, args.incremental_width, work, args.incremental_steps)
            print_incremental(inc, sum(p.numel() for p in big.parameters()),
                              args.incremental_steps)
        if args.json:
            Path(args.json).write_text(json.dumps({"formats": rows, "incremental": inc,
                                                   "codec_stages": stages},
                                                  indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
