"""``Checkpointer(..., incremental=True)``: unchanged Zarr chunk/shard files are hard-linked to
the previous step's; every step stays standalone, deleting a step never damages another, and a
SIGKILL mid-step leaves the previous steps intact."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import to_slash_layout
from torch_optional import require_torch

import lean_store as ls
from lean_store.errors import CheckpointError
from lean_store.naming import node_name

torch = require_torch()  # Checkpointer steps hold a torch model

ROOT = Path(__file__).resolve().parents[2]


def _frozen_model() -> torch.nn.Module:
    """~90 % of the parameters frozen: a frozen 96x96 'backbone' and a trainable 32x32 head."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 32),
                                torch.nn.Linear(32, 32))
    for p in list(model.parameters())[:4]:
        p.requires_grad_(False)
    return model


def _train_step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)


def _files(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _weights(path: Path) -> dict[str, np.ndarray]:
    """The model's tensors of a training checkpoint, by state-dict name."""
    return {k[len("model/"):]: np.asarray(v)
            for k, v in ls.load_state(path).items() if k.startswith("model/")}


def _node(name: str) -> str:
    """The array directory of the model parameter ``name`` (e.g. ``0.weight``)."""
    return node_name("model/" + name)


def test_hdf5_incremental_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="zarr"):
        ls.Checkpointer(tmp_path, backend="hdf5", incremental=True)


def test_unchanged_files_are_linked_and_steps_read_alone(scratch):
    model = _frozen_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    first = ck.save(0, model=model, rng=False)
    before = _files(first)
    _train_step(model)
    second = ck.save(1, model=model, rng=False)
    stats = ck.last_save_stats
    assert stats.linked_files > 0 and stats.written_files > 0
    assert stats.written_bytes <= 0.15 * (stats.written_bytes + stats.linked_bytes)
    assert _files(first) == before  # the base is never written into
    frozen = second / _node("0.weight") / "c.0.0"
    assert frozen.stat().st_nlink == 2
    assert frozen.stat().st_ino == (first / _node("0.weight") / "c.0.0").stat().st_ino
    head = second / _node("2.weight") / "c.0.0"
    assert head.stat().st_nlink == 1  # changed: written afresh
    # each step is complete for lean_store and for stock zarr
    for path, params in ((first, None), (second, model.state_dict())):
        assert ls.verify(path).ok
        group = zarr.open_group(path, mode="r")
        assert group[_node("0.weight")].shape == (96, 96)
        if params is not None:
            got = _weights(path)
            for name, value in params.items():
                np.testing.assert_array_equal(got[name], value.numpy())
    # deleting the base leaves the linked step whole
    shutil.rmtree(first)
    assert ls.verify(second).ok
    fresh = _frozen_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    ls.load_training(second, model=fresh, rng=False)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_hundred_steps_keep_last_three(scratch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False),
                                torch.nn.Linear(64, 8, bias=False))
    model[0].weight.requires_grad_(False)
    ck = ls.Checkpointer(scratch, backend="zarr", keep_last=3, incremental=True)
    states = {}
    for step in range(100):
        _train_step(model)
        ck.save(step, model=model, rng=False)
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert ck.steps() == [97, 98, 99]
    ck.finish_deletions()  # the dropped steps' files, removed in the background
    assert sorted(p.name for p in scratch.iterdir()) == [
        f"step_{s:010d}.zarr" for s in (97, 98, 99)]
    # each survivor is standalone: alone in a directory of its own, it verifies and loads
    for step in ck.steps():
        alone = scratch.parent / f"{scratch.name}-alone-{step}"
        shutil.copytree(ck.path(step), alone / "ck.zarr")
        try:
            for s in ck.steps():
                if s != step:
                    assert ck.path(s).exists()
            assert ls.verify(alone / "ck.zarr").ok
            got = _weights(alone / "ck.zarr")
            for name, value in states[step].items():
                np.testing.assert_array_equal(got[name], value.numpy())
        finally:
            shutil.rmtree(alone)
    # removing any one step by hand damages no other
    shutil.rmtree(ck.path(98))
    for step in (97, 99):
        assert ls.verify(ck.path(step)).ok


def test_a_changed_frozen_tensor_is_written_and_a_corrupt_base_is_not_linked(scratch):
    model = _frozen_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    first = ck.save(0, model=model, rng=False)
    shard = first / _node("0.bias") / "c.0"
    data = bytearray(shard.read_bytes())
    data[5] ^= 1  # the base's chunk no longer matches its CRC: never to be linked
    shard.write_bytes(bytes(data))
    with torch.no_grad():
        model[0].weight[3, 4] += 1.0  # a "frozen" tensor changes anyway
    second = ck.save(1, model=model, rng=False)
    assert (second / _node("0.weight") / "c.0.0").stat().st_nlink == 1
    assert (second / _node("0.bias") / "c.0").stat().st_nlink == 1
    assert ls.verify(second).ok
    np.testing.assert_array_equal(_weights(second)["0.weight"],
                                  model[0].weight.detach().numpy())


def test_incremental_with_weights_compression(scratch):
    model = _frozen_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    first = ck.save(0, model=model, rng=False, compression="weights")
    _train_step(model)
    second = ck.save(1, model=model, rng=False, compression="weights")
    assert ck.last_save_stats.linked_files > 0
    assert (second / _node("0.weight") / "c.0.0").stat().st_ino == (
        first / _node("0.weight") / "c.0.0").stat().st_ino
    assert ls.verify(second).ok and ls.verify(first).ok
    got = _weights(second)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(got[name], value.numpy())


CHILD = textwrap.dedent("""
    import sys, time, torch
    import lean_store as ls
    from lean_store.stores.zarr import incremental

    directory, marker = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    ck = ls.Checkpointer(directory, backend="zarr", incremental=True)
    ck.save(0, model=model, rng=False)
    ck.save(1, model=model, rng=False)
    real = incremental.UnitLinker.link_or_write
    calls = []

    def slow(self, *args):  # after a few files of step 2: tell the parent, then wait for death
        real(self, *args)
        calls.append(1)
        if len(calls) == 5:
            open(marker, "w").close()
            time.sleep(60)

    incremental.UnitLinker.link_or_write = slow
    with torch.no_grad():
        model[7].weight.add_(1.0)
    ck.save(2, model=model, rng=False)
""")


def test_sigkill_during_incremental_step_leaves_previous_steps(scratch):
    directory, marker = scratch / "run", scratch / "marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the child ended before the kill"
            assert time.monotonic() < deadline, "the child never reached step 2"
            time.sleep(0.05)
        snapshot = {p.name: _files(p) for p in directory.iterdir() if p.name.startswith("step")}
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".")]
    assert leftovers  # the killed step's temporary, with links into step 1
    ck = ls.Checkpointer(directory, backend="zarr", incremental=True)
    assert ck.steps() == [0, 1]
    for name, files in snapshot.items():
        assert _files(directory / name) == files
        assert ls.verify(directory / name).ok
    ck.clean_incomplete()
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]
    for name, files in snapshot.items():  # removing the temporary kept the linked data
        assert _files(directory / name) == files
        assert ls.verify(directory / name).ok
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    ck.save(2, model=model, rng=False)
    assert ck.steps() == [0, 1, 2] and ls.verify(ck.path(2)).ok


def test_first_step_has_no_stats_and_non_incremental_links_nothing(scratch):
    model = _frozen_model()
    ck = ls.Checkpointer(scratch / "inc", backend="zarr", incremental=True)
    ck.save(0, model=model, rng=False)
    assert ck.last_save_stats is None  # nothing to link to yet
    plain = ls.Checkpointer(scratch / "plain", backend="zarr")
    plain.save(0, model=model, rng=False)
    second = plain.save(1, model=model, rng=False)
    assert plain.last_save_stats is None
    assert all(p.stat().st_nlink == 1 for p in second.rglob("*") if p.is_file())


def test_a_base_of_the_slash_layout_still_gives_links(scratch):
    """A step over a base saved before chunk keys took "." (``c/0/0``, e.g. by the previous
    release): its new ``c.0.0`` files are compared with the base's at the old keys and linked;
    both steps read alone."""
    model = _frozen_model()
    first = ls.Checkpointer(scratch, backend="zarr", incremental=True).save(
        0, model=model, rng=False)
    to_slash_layout(first)
    want_first = _weights(first)
    _train_step(model)
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)  # reads the base's root
    second = ck.save(1, model=model, rng=False)
    assert ck.last_save_stats.linked_files > 0
    frozen = second / _node("0.weight") / "c.0.0"
    assert frozen.stat().st_ino == (first / _node("0.weight") / "c" / "0" / "0").stat().st_ino
    assert (second / _node("2.weight") / "c.0.0").stat().st_nlink == 1  # trained: written
    got = _weights(second)
    for name, value in model.state_dict().items():
        assert np.array_equal(got[name], value.numpy()), name
    assert {k: v.tobytes() for k, v in _weights(first).items()} == {
        k: v.tobytes() for k, v in want_first.items()}
    for step in (first, second):
        with ls.open(step) as opened:
            opened.verify()


NO_HARD_LINKS = """
#include <errno.h>
int link(const char *a, const char *b) { (void)a; (void)b; errno = EPERM; return -1; }
int linkat(int fa, const char *a, int fb, const char *b, int flags) {
    (void)fa; (void)a; (void)fb; (void)b; (void)flags; errno = EPERM; return -1; }
"""

NO_LINKS_CHILD = textwrap.dedent("""
    import os, sys, torch, lean_store as ls
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 32))
    for p in list(model.parameters())[:2]:
        p.requires_grad_(False)
    try:
        os.link(sys.argv[2], sys.argv[2] + ".link")
    except OSError as e:
        print("link", e.errno)
    ck = ls.Checkpointer(sys.argv[1], keep_last=3, backend="zarr", incremental=True)
    for step in range(5):
        with torch.no_grad():
            model[1].weight.add_(0.01)
        ck.save(step, model=model, rng=False)
        stats = ck.last_save_stats
        print(step, None if stats is None else (stats.linked_files, stats.written_files > 0))
    print(ck.steps(), all(ls.verify(ck.path(s)).ok for s in ck.steps()))
""")


def test_a_file_system_without_hard_links_gets_whole_steps(tmp_path):
    """Where ``link`` fails (EPERM: a file system without hard links), every file of a step is
    written: the steps are as complete and standalone, only not smaller."""
    from helpers import preload_library

    library = preload_library(tmp_path, NO_HARD_LINKS)
    (tmp_path / "probe").write_text("x")
    run = subprocess.run(
        [sys.executable, "-c", NO_LINKS_CHILD, str(tmp_path / "run"), str(tmp_path / "probe")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "LD_PRELOAD": str(library),
             "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == f"link {1}"  # EPERM: the preload is in force
    assert lines[1:] == ["0 None", "1 (0, True)", "2 (0, True)", "3 (0, True)", "4 (0, True)",
                         "[2, 3, 4] True"]
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert files and all(p.stat().st_nlink == 1 for p in files)
    for step in (2, 3, 4):  # the frozen layer in every step, exactly
        back = ls.load_state(tmp_path / "run" / f"step_{step:010d}.zarr")
        assert np.array_equal(back["model/0.weight"], _frozen_weight())


def _frozen_weight() -> np.ndarray:
    torch.manual_seed(0)
    return torch.nn.Linear(96, 96).weight.detach().numpy()
