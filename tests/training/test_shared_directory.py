"""Two processes saving into one Checkpointer directory (a job requeued while the old one still
runs, a launcher started twice): each save's ``clean_incomplete`` removed every temporary in
the directory, the other process's live saves included, so those saves failed with
``SaveIOError ... ENOENT`` or committed a Zarr tree with files missing (listed as "not a
lean_store checkpoint"), and a prune racing the other process's raised a raw
``FileNotFoundError`` after a successful save. Now a temporary is removed only when its writer
is known to be gone (or, unjudgeable, after a day untouched), a step already pruned by the other
process is skipped, and every save succeeds with every committed step whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402
from lean_store.stores import leftovers  # noqa: E402

_SAVER = textwrap.dedent("""
    import json, os, sys, warnings
    import torch
    import lean_store as ls
    directory, who, backend, rounds = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    torch.manual_seed(who)
    model = torch.nn.Linear(256, 256)
    run = ls.Checkpointer(directory, keep_last=4, backend=backend)
    errors, damaged = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(rounds):
            step = 2 * i + who
            try:
                path = run.save(step, model=model, rng=False)
            except Exception as exc:
                errors.append(f"{step}: {type(exc).__name__}: {exc}")
                continue
            try:
                ls.verify(path)
            except ls.CheckpointError as exc:
                if os.path.lexists(path):  # else pruned by the other process meanwhile
                    damaged.append(f"{step}: {exc}")
    print(json.dumps({"errors": errors, "damaged": damaged,
                      "warnings": [str(w.message) for w in caught]}))
""")


@pytest.mark.parametrize("backend", ["hdf5", "zarr"])
def test_two_processes_save_into_one_directory(tmp_path, backend) -> None:
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    directory = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, str(script), str(directory), str(who), backend,
                               "25"], stdout=subprocess.PIPE, text=True)
             for who in (0, 1)]
    records = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])
               for p in procs]
    for rec in records:
        assert rec["errors"] == [] and rec["damaged"] == [], rec
        assert not [w for w in rec["warnings"] if "not pruning" in w], rec["warnings"]
    run = ls.Checkpointer(directory, backend=backend)
    assert run.steps() == [46, 47, 48, 49]
    for step in run.steps():
        ls.verify(run.path(step))
    assert sorted(os.listdir(directory)) == [run.path(s).name for s in run.steps()]


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_clean_incomplete_keeps_what_may_still_be_written_or_needed(tmp_path) -> None:
    run = ls.Checkpointer(tmp_path, backend="hdf5")
    run.save(3, model=torch.nn.Linear(2, 2), rng=False)
    tag = leftovers.owner_tag()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    gone = _dead_pid()
    try:
        def leftover(name: str, age: float = 0.0) -> Path:
            path = tmp_path / name
            path.write_bytes(b"x")
            if age:
                then = time.time() - age
                os.utime(path, (then, then))
            return path

        removed = {
            leftover(f".step_0000000005.h5.lean_store-tmp-{tag}{gone:08x}{'0' * 16}"),  # dead
            leftover(".step_0000000006.h5.lean_store-tmp-0123abcd", age=2 * 86400),  # stale
            leftover(".step_0000000003.h5.lean_store-old-" + "1" * 32),  # its step is there
            leftover(".step_0000000002.h5.lean_store-dead-" + "2" * 32),  # a pruned step
        }
        kept = [
            leftover(f".step_0000000007.h5.lean_store-tmp-{tag}{sleeper.pid:08x}{'3' * 16}"),
            leftover(f".step_0000000008.h5.lean_store-tmp-{'0' * 8}{gone:08x}{'4' * 16}"),
            leftover(".step_0000000009.h5.lean_store-tmp-4567ef"),  # unjudged, fresh
            leftover(".step_0000000004.h5.lean_store-old-" + "5" * 32),  # step 4's only copy
        ]
        assert set(run.clean_incomplete()) == removed
        assert all(p.exists() for p in kept) and not any(p.exists() for p in removed)
        assert run.steps() == [3]
    finally:
        sleeper.kill()
        sleeper.wait()
