"""Hypothesis fuzz over mutated checkpoints, run in a guarded worker (RLIMIT_AS + timeout).

No crash, no untyped error, no unbounded allocation (MemoryError under the address-space limit
counts as a crash), and never silently different data. A case that makes libhdf5 hang is
stopped by the timeout guard and counted separately (``verify(isolate=True)`` turns it into a
reported problem; see docs/SECURITY.md). tools/fuzz_soak.py runs the long version.
"""

from __future__ import annotations

import random
import shutil
import sys
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import fuzz_soak  # noqa: E402

import lean_store as ls  # noqa: E402

CASES = 120


def test_fuzz_mutated_checkpoints(tmp_path_factory, backend, suffix):
    work = tmp_path_factory.mktemp(f"fuzz-{backend}")
    original = work / f"orig{suffix}"
    ls.save(fuzz_soak.make_state(), original, chunk_bytes=1024)
    want = fuzz_soak.digest(ls.load_state(original))
    worker = fuzz_soak.Worker(timeout=10.0)
    counts: Counter = Counter()
    failures: list[str] = []

    @settings(max_examples=CASES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3))
    def case(seed: int, n: int) -> None:
        rng = random.Random(seed)
        path = work / f"case{suffix}"
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        fuzz_soak.copy_checkpoint(original, path)
        done = [fuzz_soak.mutate(path, rng) for _ in range(n)]
        result = worker.check(path)
        verdict = "timeout guard" if "hang" in result else fuzz_soak.classify(result, want)
        counts[verdict] += 1
        if verdict.startswith("FAIL"):
            failures.append(f"{done}: {verdict}")

    try:
        case()
    finally:
        worker.close()
    print(f"\n{backend}: {sum(counts.values())} fuzz cases: {dict(counts)}")
    assert failures == []
    assert sum(counts.values()) >= CASES
    assert counts["detected"] > 0
