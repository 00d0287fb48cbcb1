"""Fuzz soak: open, verify and load mutated checkpoints in a guarded worker process.

The worker runs with an address-space limit (``RLIMIT_AS``), and every case has a timeout, so
a crash (the worker dies), a hang (no answer in time) or an unbounded allocation
(``MemoryError`` under the limit) is caught and reported as a failure. Every other outcome must
be a typed ``CheckpointError`` or the original bits, exactly.

    .venv/bin/python tools/fuzz_soak.py --cases 5000            # both backends
    .venv/bin/python tools/fuzz_soak.py --check --original ORIG CASE...  # given cases

``--allow-hangs`` counts a case that makes libhdf5 hang (stopped by the timeout) as
``timeout guard`` instead of a failure: ``verify(isolate=True)`` turns such a hang into a
reported problem (docs/SECURITY.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

SUFFIX = {"hdf5": ".h5", "zarr": ".zarr"}
MEMORY_LIMIT = 3 << 30  # address space of the worker: imports need ~1.5 GiB of it
TIMEOUT = 20.0  # seconds per case


def make_state(seed: int = 0) -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((40, 24)).astype(np.float32),
        "bf": rng.standard_normal((30, 7)).astype(ml_dtypes.bfloat16),
        "i": rng.integers(-1000, 1000, 90).astype(np.int64),
        "c": (rng.standard_normal(20) + 1j).astype(np.complex128),
        "s": np.float64(1.5) * np.ones(()),
    }


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        arr = np.ascontiguousarray(np.asarray(state[name]))
        h.update(f"{name}|{arr.dtype}|{arr.shape}|".encode())
        h.update(arr.view(np.uint8).tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------- the worker


def check(path: str) -> dict:
    """verify + load_state of one checkpoint; what happened, as plain JSON."""
    import lean_store as ls

    out: dict = {}
    try:
        report = ls.verify(path)
        out["verify"] = "ok" if report.ok else "problems"
        out["verify_problems"] = [str(p)[:300] for p in report.problems[:5]]
    except ls.CheckpointError as exc:  # verify reports, but a typed raise is acceptable too
        out["verify"] = f"error {type(exc).__name__}"
    except BaseException as exc:  # noqa: BLE001 - the point is to report everything else
        out["crash"] = f"verify: {type(exc).__name__}: {exc}"[:500]
        return out
    try:
        state = ls.load_state(path)
        out["load"] = "ok"
        out["digest"] = digest(state)
    except ls.CheckpointError as exc:
        out["load"] = f"error {type(exc).__name__}"
        out["load_message"] = str(exc)[:300]
    except BaseException as exc:  # noqa: BLE001
        out["crash"] = f"load: {type(exc).__name__}: {exc}"[:500]
    return out


def serve(memory_limit: int) -> None:
    import resource

    import zarr  # noqa: F401

    import lean_store  # noqa: F401 - import everything before the limit applies

    resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        print(json.dumps(check(path)), flush=True)


class Worker:
    """Driver side: restarts the worker after a crash or a hang."""

    def __init__(self, memory_limit: int = MEMORY_LIMIT, timeout: float = TIMEOUT) -> None:
        self.memory_limit, self.timeout = memory_limit, timeout
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, HDF5_USE_FILE_LOCKING="FALSE")
        return subprocess.Popen(
            [sys.executable, __file__, "--serve", "--memory-limit", str(self.memory_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1, env=env,
        )

    def check(self, path: Path) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(f"{path}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.proc = None
            return {"crash": "worker died"}
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return {"hang": f"no answer in {self.timeout} s"}
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            return {"crash": f"worker died (exit status {code})"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def classify(result: dict, original: str, allow_hangs: bool = False) -> str:
    """'detected' (typed error), 'harmless' (original bits), 'timeout guard' (a hang, where
    allowed), or a failure description."""
    if allow_hangs and "hang" in result:
        return "timeout guard"
    if "crash" in result or "hang" in result:
        return "FAIL " + result.get("crash", result.get("hang", ""))
    if result.get("load") == "ok" and result.get("digest") != original:
        return "FAIL silently wrong data"
    if result.get("verify") != "ok" or result.get("load") != "ok":
        return "detected"
    return "harmless"


# --------------------------------------------------------------------------------- mutation


def files_of(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def copy_checkpoint(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)


def mutate(path: Path, rng: random.Random) -> str:
    """Apply one random mutation to one file of the checkpoint; returns what was done."""
    target = rng.choice(files_of(path))
    data = bytearray(target.read_bytes())
    what = rng.choice(["bit", "byte", "bytes", "truncate", "zero", "extend"])
    rel = target.name if path.is_file() else target.relative_to(path).as_posix()
    if not data:
        what = "extend"
    if what == "bit":
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    elif what == "byte":
        i = rng.randrange(len(data))
        data[i] = rng.randrange(256)
    elif what == "bytes":
        i = rng.randrange(len(data))
        n = rng.randint(1, 16)
        data[i : i + n] = bytes(rng.randrange(256) for _ in range(n))[: len(data) - i]
    elif what == "truncate":
        i = rng.randrange(len(data))
        del data[i:]
    elif what == "zero":
        i = rng.randrange(len(data))
        n = rng.randint(1, 64)
        data[i : i + n] = bytes(min(n, len(data) - i))
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        i = len(data)
    target.write_bytes(bytes(data))
    return f"{what} {rel}@{i}"


def soak(backend: str, cases: int, seed: int = 0, allow_hangs: bool = False,
         timeout: float = TIMEOUT) -> tuple[Counter, list[str]]:
    import lean_store as ls

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix=f"fuzz-{backend}-"))
    worker = Worker(timeout=timeout)
    counts: Counter = Counter()
    failures: list[str] = []
    try:
        original = work / f"orig{SUFFIX[backend]}"
        state = make_state()
        ls.save(state, original, chunk_bytes=1024)
        want = digest(ls.load_state(original))
        for case in range(cases):
            path = work / f"case{case}{SUFFIX[backend]}"
            copy_checkpoint(original, path)
            done = [mutate(path, rng) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
            verdict = classify(worker.check(path), want, allow_hangs)
            counts[verdict] += 1
            if verdict.startswith("FAIL"):
                failures.append(f"{backend} case {case} {done}: {verdict}")
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    finally:
        worker.close()
        shutil.rmtree(work, ignore_errors=True)
    return counts, failures


def check_cases(original: Path, cases: list[Path], allow_hangs: bool, timeout: float) -> None:
    """Print one JSON line per case: its path and its verdict against ``original``."""
    import lean_store as ls

    want = digest(ls.load_state(original))
    worker = Worker(timeout=timeout)
    try:
        for case in cases:
            verdict = classify(worker.check(case), want, allow_hangs)
            print(json.dumps({"case": str(case), "verdict": verdict}), flush=True)
    finally:
        worker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-limit", type=int, default=MEMORY_LIMIT)
    parser.add_argument("--cases", type=int, default=2000, help="cases per backend")
    parser.add_argument("--backend", choices=("hdf5", "zarr", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-hangs", action="store_true",
                        help="count a hang stopped by the timeout as 'timeout guard', not failed")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per case")
    parser.add_argument("--check", nargs="+", type=Path, metavar="CASE",
                        help="check these checkpoints (no mutation) against --original and "
                             "print one JSON line each")
    parser.add_argument("--original", type=Path, help="the unmutated checkpoint, for --check")
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.memory_limit)
        return 0
    if args.check:
        if args.original is None:
            parser.error("--check needs --original")
        check_cases(args.original, args.check, args.allow_hangs, args.timeout)
        return 0
    failed = False
    for backend in ("hdf5", "zarr") if args.backend == "both" else (args.backend,):
        start = time.perf_counter()
        counts, failures = soak(backend, args.cases, args.seed, args.allow_hangs,
                                args.timeout)
        print(f"{backend}: {sum(counts.values())} cases in {time.perf_counter() - start:.1f} s")
        for verdict, n in sorted(counts.items()):
            print(f"  {n:6d}  {verdict}")
        for failure in failures[:50]:
            print(f"  {failure}")
        failed |= bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
