"""CUDA check: save and load a >= 8 GiB CUDA state, check every bit, report GiB/s and host
peak RSS, next to safetensors.torch and torch.save. Exits cleanly without CUDA.

    .venv/bin/python tools/gpu_check.py                 # 8 GiB of bfloat16/float32 on cuda:0
    .venv/bin/python tools/gpu_check.py --size-gib 1    # a quick run
    .venv/bin/python tools/gpu_check.py --json gpu.json

Each method runs in its own process so the host peak RSS (``VmHWM``, counted from just before
the save) belongs to that method alone. lean_store saves stream the device state through its
pinned staging pool (``--buffer-bytes``); loads go into existing CUDA tensors (``ls.load``)
and, for the peers, ``load_file(device="cuda")`` / ``torch.load(map_location="cuda")``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20
METHODS = ["lean_store hdf5", "lean_store zarr", "lean_store hdf5 async", "safetensors.torch",
           "torch.save"]

CHILD = r"""
import json, os, sys, time, torch
method, size, path, buffer_bytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

import lean_store as ls

def make_state(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    state, left, i = {}, size, 0
    while left > 0:
        big = i % 16 == 0
        n = min(left, (512 << 20) if big else (8 << 20))
        dtype = torch.bfloat16 if i % 2 else torch.float32
        numel = n // (2 if dtype == torch.bfloat16 else 4)
        value = torch.randn(numel, device="cuda", generator=g, dtype=torch.float32)
        state[f"t{i}"] = value.to(dtype)
        left -= n
        i += 1
    torch.cuda.synchronize()
    return state

state = make_state(0)
nbytes = sum(t.numel() * t.element_size() for t in state.values())
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
t0 = time.perf_counter()
if method.startswith("lean_store"):
    suffix = ".h5" if "hdf5" in method else ".zarr"
    target = path + suffix
    if method.endswith("async"):
        handle = ls.save(state, target, blocking=False, buffer_bytes=buffer_bytes, progress=False)
        t_return = time.perf_counter() - t0
        handle.wait()
    else:
        ls.save(state, target, buffer_bytes=buffer_bytes, progress=False)
elif method == "safetensors.torch":
    from safetensors.torch import save_file
    target = path + ".safetensors"
    save_file(state, target)
else:
    target = path + ".pt"
    torch.save(state, target)
t_save = time.perf_counter() - t0
save_peak = status("VmHWM:") - before

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
torch.cuda.synchronize()
t0 = time.perf_counter()
if method.startswith("lean_store"):
    like = {k: torch.empty_like(v) for k, v in state.items()}
    ls.load(like, target, progress=False)
    loaded = like
elif method == "safetensors.torch":
    from safetensors.torch import load_file
    loaded = load_file(target, device="cuda")
else:
    loaded = torch.load(target, map_location="cuda", weights_only=True)
torch.cuda.synchronize()
t_load = time.perf_counter() - t0
load_peak = status("VmHWM:") - before
ok = all(loaded[k].device.type == "cuda" and loaded[k].dtype == v.dtype
         and torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8))
         for k, v in state.items())
out = {"bytes": nbytes, "save_s": t_save, "load_s": t_load, "save_extra_rss": save_peak,
       "load_extra_rss": load_peak, "bits_equal": ok}
if method.endswith("async"):
    out["async_return_s"] = t_return
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=8.0)
    parser.add_argument("--buffer-bytes", type=int, default=64 * MiB)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default="gpu_check.json")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; nothing to check")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this on a machine with a GPU")
        return 0
    size = int(args.size_gib * GiB)
    print(f"{torch.cuda.get_device_name(0)}: {size / GiB:.1f} GiB CUDA state, "
          f"buffer_bytes {args.buffer_bytes / MiB:.0f} MiB")
    print(f"{'method':24s}{'save GiB/s':>11s}{'load GiB/s':>11s}{'save +RSS MiB':>15s}"
          f"{'load +RSS MiB':>15s}  bits")
    results, failed = {}, False
    for method in args.methods:
        with tempfile.TemporaryDirectory(prefix="lean_store-gpu-", dir=args.dir) as tmp:
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, method, str(size), os.path.join(tmp, "ck"),
                 str(args.buffer_bytes)],
                capture_output=True, text=True, check=False,
            )
        if proc.returncode != 0:
            print(f"{method:24s} FAILED\n{proc.stderr[-2000:]}")
            failed = True
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[method] = r
        failed |= not r["bits_equal"]
        gib = r["bytes"] / GiB
        print(f"{method:24s}{gib / r['save_s']:11.2f}{gib / r['load_s']:11.2f}"
              f"{r['save_extra_rss'] / MiB:15.0f}{r['load_extra_rss'] / MiB:15.0f}  "
              f"{'ok' if r['bits_equal'] else 'MISMATCH'}", flush=True)
    Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                           "results": results}, indent=2))
    print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
