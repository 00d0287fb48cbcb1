"""SIGKILL writers at random moments during saves (both backends, >= 50 kills in all): the
previous checkpoint always survives bit-exact, the new one is bit-exact or absent/rejected,
and nothing ever loads silently wrong. The kills are ``tools/crash_soak.py``'s, run here with
few kills per backend; with more it is the long version."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tool_runner import tool_command, tool_env

KILLS_PER_BACKEND = 30
SEED = 7


def _scratch(tmp_path: Path) -> Path:
    """tmpfs when there is one: a SIGKILL keeps the page cache, so a process crash behaves the
    same there, and saves take milliseconds instead of waiting for fsync."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="lean_store-crash-", dir=shm))
    return tmp_path


def _tally(backend: str, out: str, err: str) -> tuple[int, dict[str, int], list[str]]:
    """(kills, outcome -> count, failures) from the soak's report of one backend."""
    head, *rows = out.strip().splitlines() or [""]
    found = re.fullmatch(rf"{backend}: (\d+) kills in [0-9.]+ s", head)
    assert found, f"{backend} soak: no report\n{out}\n{err[-4000:]}"
    outcomes: dict[str, int] = {}
    failures: list[str] = []
    for row in rows:
        if row.lstrip().startswith("FAIL"):
            failures.append(row.strip())
        else:
            n, outcome = row.split(maxsplit=1)
            outcomes[outcome] = int(n)
    return int(found[1]), outcomes, failures


def test_sigkill_during_saves_never_yields_wrong_data(tmp_path):
    root = _scratch(tmp_path)
    runs = {}  # one soak per backend, side by side (2 cores)
    for backend in ("hdf5", "zarr"):
        command = tool_command("crash_soak.py", "--backend", backend, "--kills",
                               KILLS_PER_BACKEND, "--seed", SEED, "--dir", root)
        runs[backend] = subprocess.Popen(command, env=tool_env(), stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
    try:
        done = {b: (p.communicate(timeout=900), p.returncode) for b, p in runs.items()}
    finally:
        for p in runs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if root != tmp_path:
            shutil.rmtree(root, ignore_errors=True)
    total = 0
    for backend, ((out, err), code) in done.items():
        kills, outcomes, failures = _tally(backend, out, err)
        assert failures == [], f"{backend}: {failures}"
        assert code == 0, f"{backend}: exit status {code}\n{err[-4000:]}"
        assert kills >= KILLS_PER_BACKEND
        # the kills really interrupted saves: the previous state survived some of them
        assert outcomes.get("overwrite killed: previous state", 0) > 0, outcomes
        total += kills
    assert total >= 50
