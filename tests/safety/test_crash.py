"""SIGKILL writers at random moments during saves (both backends, >= 50 kills in all): the
previous checkpoint always survives bit-exact, the new one is bit-exact or absent/rejected,
and nothing ever loads silently wrong. ``tools/crash_soak.py`` runs the long version."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import crash_soak  # noqa: E402

KILLS_PER_BACKEND = 30


def _scratch(tmp_path: Path) -> Path:
    """tmpfs when there is one: a SIGKILL keeps the page cache, so a process crash behaves the
    same there, and saves take milliseconds instead of waiting for fsync."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="lean_store-crash-", dir=shm))
    return tmp_path


def test_sigkill_during_saves_never_yields_wrong_data(tmp_path):
    root = _scratch(tmp_path)
    dirs = {b: root / b for b in ("hdf5", "zarr")}
    for d in dirs.values():
        d.mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:  # one writer server per backend, 2 cores
        futures = {
            b: pool.submit(crash_soak.soak, b, KILLS_PER_BACKEND, 7, dirs[b]) for b in dirs
        }
        tallies = {b: f.result() for b, f in futures.items()}
    if root != tmp_path:
        shutil.rmtree(root, ignore_errors=True)
    total = 0
    for backend, tally in tallies.items():
        assert tally.failures == [], f"{backend}: {tally.failures}"
        assert tally.kills >= KILLS_PER_BACKEND
        # the kills really interrupted saves: the previous state survived some of them
        assert tally.outcomes["overwrite killed: previous state"] > 0, tally.outcomes
        total += tally.kills
    assert total >= 50
