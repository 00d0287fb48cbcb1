"""Fuzz over mutated checkpoints, run by ``tools/fuzz_soak.py`` in its guarded worker
(RLIMIT_AS + timeout).

No crash, no untyped error, no unbounded allocation (MemoryError under the address-space limit
counts as a crash), and never silently different data. A case that makes libhdf5 hang is
stopped by the timeout guard and counted separately (``--allow-hangs``; ``verify(isolate=True)``
turns it into a reported problem, see docs/SECURITY.md). Without ``--cases 120`` the same tool
runs the long version.
"""

from __future__ import annotations

import re

from tool_runner import run_tool

CASES = 120
SEED = 0  # the same mutations every run


def test_fuzz_mutated_checkpoints(backend):
    done = run_tool("fuzz_soak.py", "--backend", backend, "--cases", CASES, "--seed", SEED,
                    "--allow-hangs", "--timeout", 10)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    head, *rows = done.stdout.strip().splitlines()
    assert re.fullmatch(rf"{backend}: {CASES} cases in [0-9.]+ s", head), head
    counts = {}
    for row in rows:
        assert not row.lstrip().startswith(("FAIL", f"{backend} case")), row  # no failure listed
        n, verdict = row.split(maxsplit=1)
        counts[verdict] = int(n)
    assert sum(counts.values()) == CASES
    assert not [v for v in counts if v.startswith("FAIL")], counts
    assert counts.get("detected", 0) > 0
