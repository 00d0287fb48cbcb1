"""Peak extra host memory while saving the same torch state, one fresh process per method.

    .venv/bin/python tools/bench/memory.py                  # 2 GiB state
    .venv/bin/python tools/bench/memory.py --size-gib 0.5   # a quick run

Each child builds the state (every page touched), reads its resident set size, resets the
kernel's peak counter (``/proc/self/clear_refs``), saves, and reports the peak RSS (``VmHWM``)
minus the RSS before the save: the memory the save needed on top of the state itself.
Linux only. Results go to a JSON file (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
METHODS = ["lean_store hdf5", "lean_store zarr", "safetensors.torch", "torch.save"]

CHILD = r"""
import json, os, sys, torch
method, size, path, buffer_bytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

import lean_store as ls
from safetensors.torch import save_file

state, left, i = {}, size, 0
while left > 0:  # a few 256 MiB tensors, the rest 4 MiB ones; arange touches every page
    n = min(left, (256 << 20) if i % 8 == 0 else (4 << 20))
    state[f"t{i}"] = torch.arange(n // 4, dtype=torch.int32).view(torch.float32)
    left -= n
    i += 1
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
if method == "lean_store hdf5":
    ls.save(state, path + ".h5", buffer_bytes=buffer_bytes, progress=False)
elif method == "lean_store zarr":
    ls.save(state, path + ".zarr", buffer_bytes=buffer_bytes, progress=False)
elif method == "safetensors.torch":
    save_file(state, path + ".safetensors")
else:
    torch.save(state, path + ".pt")
print(json.dumps({"before": before, "peak": status("VmHWM:")}))
"""


def measure(method: str, size: int, directory: str, buffer_bytes: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory(prefix="lean_store-mem-", dir=directory) as tmp:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, method, str(size), os.path.join(tmp, "ck"),
             str(buffer_bytes)],
            capture_output=True, text=True, check=False,
        )
    if out.returncode != 0:
        raise SystemExit(f"{method} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--buffer-bytes", type=int, default=64 * MiB)
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--json", default="memory.json")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    args = parser.parse_args(argv)
    size = int(args.size_gib * GiB)
    bound = max(64 * MiB, args.buffer_bytes) + 0.05 * size
    print(f"state {size / GiB:.2f} GiB; target for lean_store: extra <= {bound / MiB:.0f} MiB")
    print(f"{'method':22s}{'extra MiB':>11s}{'x state':>9s}")
    results = {}
    for method in args.methods:
        r = measure(method, size, args.dir, args.buffer_bytes)
        extra = r["peak"] - r["before"]
        results[method] = {"extra_bytes": extra, "extra_over_state": extra / size, **r}
        print(f"{method:22s}{extra / MiB:11.0f}{extra / size:9.2f}", flush=True)
    report = {"state_bytes": size, "buffer_bytes": args.buffer_bytes, "target_bytes": bound,
              "results": results}
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
