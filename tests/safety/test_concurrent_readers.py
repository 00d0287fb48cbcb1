"""Readers while a writer replaces the path (issue 11, items 3 and 4).

An open checkpoint reads the checkpoint it opened, or raises ``CheckpointReplacedError``; it
never returns data of another checkpoint and never calls a valid checkpoint corrupt. Every
state saved here is a function of a generation number, so each value read can be traced to
exactly one generation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import SUFFIX
from torch_optional import require_torch

import lean_store as ls
import lean_store.checkpoint as checkpoint_mod
from lean_store import CheckpointReplacedError
from lean_store.stores.zarr.store import ZarrReader

ROOT = Path(__file__).resolve().parents[2]
CHUNK_BYTES = 4096  # "b": 64 chunks (a sharded Zarr array), "a": 2 chunks (plain chunk files)
N_A, N_B = 2048, 1 << 16
STEP_B = 1 << 17  # "b" of generation g holds g * STEP_B + arange: no two generations overlap


def state(gen: int) -> dict[str, np.ndarray]:
    """The checkpoint of generation ``gen``."""
    return {
        "a": np.full(N_A, gen, np.float32) + np.arange(N_A, dtype=np.float32) / N_A,
        "b": np.arange(N_B, dtype=np.int64) + gen * STEP_B,
    }


def generation_of(name: str, values: np.ndarray, start: int = 0) -> int:
    """The one generation ``values`` (``name``'s elements from ``start``) belong to; fails
    the test when they mix generations or match none."""
    values = np.asarray(values)
    gen = int(values[0]) if name == "a" else int(values[0] - start) // STEP_B
    expected = state(gen)[name][start: start + len(values)]
    assert values.tobytes() == expected.tobytes(), f"{name!r}: data of no single generation"
    return gen


def _save(gen: int, path: Path, compression: object = None) -> None:
    ls.save(state(gen), path, chunk_bytes=CHUNK_BYTES, compression=compression)


def _swap_keeping_old(gen: int, path: Path) -> Path:
    """Replace the store at ``path`` with generation ``gen`` the way a save does (a new tree
    renamed into place), but keep the old tree alive elsewhere; returns where it went."""
    fresh = path.with_name(f"fresh-{gen}.zarr")
    _save(gen, fresh)
    aside = path.with_name(f"old-{gen}.zarr")
    os.rename(path, aside)
    os.rename(fresh, path)
    return aside


def _original_or_replaced(read, gen: int, name: str, start: int = 0) -> str:
    """Run ``read``: it must return generation ``gen``'s data or raise the replaced error."""
    try:
        values = read()
    except CheckpointReplacedError as exc:
        assert "replaced" in str(exc)
        return "replaced"
    assert generation_of(name, values, start) == gen
    return "original"


# ------------------------------------------------------------------ Zarr, one process


def _zarr_sources(tmp_path: Path, kind: str) -> tuple[Path, str | Path, object]:
    """(store path, what ``ls.open`` is given, compression) for each Zarr read path."""
    path = tmp_path / "run.zarr"
    if kind == "direct":  # lean_store's uncompressed layout: files read directly
        return path, path, None
    if kind == "compressed":  # zarr-python's codec pipeline, local directory
        return path, path, "zstd"
    return path, f"file://{path}", None  # an fsspec URL: zarr-python through FsspecStore


@pytest.mark.parametrize("kind", ["direct", "compressed", "url"])
def test_zarr_open_then_save_never_reads_the_new_checkpoint(tmp_path, kind):
    path, source, compression = _zarr_sources(tmp_path, kind)
    _save(1, path, compression)
    with ls.open(source) as ck:
        assert generation_of("b", ck["b"][:10]) == 1
        _save(2, path, compression)  # the old tree is swapped out and deleted
        with pytest.raises(CheckpointReplacedError, match="replaced"):
            ck["b"][40000:40010]
        with pytest.raises(CheckpointReplacedError, match="replaced"):
            ck["b"].read()  # a whole read: not "corrupt"
        with pytest.raises(CheckpointReplacedError):
            ck.verify()
    with ls.open(source) as ck:  # opened again: the new checkpoint, whole
        assert generation_of("b", ck["b"].read()) == 2


def test_zarr_direct_reads_keep_reading_the_tree_opened(tmp_path):
    """While the replaced tree still exists, the direct reader reads it: the original data,
    not an error."""
    path = tmp_path / "run.zarr"
    _save(1, path)
    with ls.open(path) as ck:
        _swap_keeping_old(2, path)
        assert generation_of("b", ck["b"][30000:30100], 30000) == 1
        assert generation_of("b", ck["b"].read()) == 1
        assert generation_of("a", np.asarray(ck["a"])) == 1
        ck.verify()
    assert generation_of("b", ls.load_state(path)["b"]) == 2


@pytest.mark.parametrize("kind", ["compressed", "url"])
def test_zarr_python_reads_after_a_swap_are_original_or_refused(tmp_path, kind):
    path, source, compression = _zarr_sources(tmp_path, kind)
    _save(1, path, compression)
    with ls.open(source) as ck:
        fresh = tmp_path / "fresh.zarr"
        _save(2, fresh, compression)
        os.rename(path, tmp_path / "old.zarr")
        os.rename(fresh, path)
        assert _original_or_replaced(lambda: ck["b"][30000:30100], 1, "b", 30000) == "replaced"
        assert _original_or_replaced(lambda: ck["b"].read(), 1, "b") == "replaced"


@pytest.mark.parametrize("kind", ["direct", "compressed", "url"])
def test_zarr_save_in_the_middle_of_a_whole_read(tmp_path, monkeypatch, kind):
    """A save landing after a few chunks of a whole read: the original data or the replaced
    error, never "corrupt" and never a mix (the url path checks once, at the end)."""
    path, source, compression = _zarr_sources(tmp_path, kind)
    _save(1, path, compression)
    real = ZarrReader.read
    calls = []

    def save_after_three(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            _save(2, path, compression)
        return real(self, *args, **kwargs)

    with ls.open(source) as ck:
        monkeypatch.setattr(ZarrReader, "read", save_after_three)
        assert _original_or_replaced(lambda: ck["b"].read(), 1, "b") == "replaced"
        assert len(calls) >= 4  # the save happened during the read


def test_zarr_url_whole_read_checks_the_root_once(tmp_path, monkeypatch):
    """Through a URL every check rereads the root metadata (a request on a remote store): a
    whole read of 64 chunks checks once, a partial read once per read."""
    from lean_store.replacement import SaveIdWatch

    path = tmp_path / "run.zarr"
    _save(1, path)
    checks = []
    real = SaveIdWatch.replaced
    monkeypatch.setattr(SaveIdWatch, "replaced", lambda self: checks.append(1) or real(self))
    with ls.open(f"file://{path}") as ck:
        checks.clear()
        assert generation_of("b", ck["b"].read()) == 1
        assert len(checks) == 1
        ck["b"][100:200]
        ck["b"][30000:30001]
        assert len(checks) == 3


def test_zarr_removed_while_open_is_reported_as_such(tmp_path):
    import shutil

    path = tmp_path / "run.zarr"
    _save(1, path)
    with ls.open(path) as ck:
        shutil.rmtree(path)
        with pytest.raises(CheckpointReplacedError, match="removed"):
            ck["b"][:5]


def test_zarr_open_during_a_save_reads_one_checkpoint(tmp_path, monkeypatch):
    """A save landing while ``open`` reads the metadata: open starts over and sees one
    checkpoint (here the new one, of another shape), never a mix called corrupt."""
    path = tmp_path / "run.zarr"
    _save(1, path)
    real = checkpoint_mod.check_stored
    calls = []

    def save_midway(reader, layout, where):
        if not calls:  # root metadata read; array metadata not yet
            ls.save({"a": np.zeros(7, np.float32), "b": np.arange(5, dtype=np.int64)}, path)
        calls.append(1)
        return real(reader, layout, where)

    monkeypatch.setattr(checkpoint_mod, "check_stored", save_midway)
    with ls.open(path) as ck:
        assert len(calls) == 2
        assert ck["b"].shape == (5,)
        assert ck["b"].read().tolist() == [0, 1, 2, 3, 4]


def test_zarr_saves_record_a_fresh_save_id(tmp_path):
    path = tmp_path / "run.zarr"
    ids = set()
    for gen in (1, 2):
        _save(gen, path)
        with ls.open(path) as ck:
            ids.add(ck.root_attrs["save_id"])
    assert len(ids) == 2 and all(isinstance(i, str) and len(i) == 32 for i in ids)


def test_zarr_load_state_reads_one_checkpoint(tmp_path, monkeypatch):
    """A save between ``load_state``'s open and its reads: the result is one generation."""
    path = tmp_path / "run.zarr"
    _save(1, path)
    real = ZarrReader.read
    saved = []

    def save_first(self, *args, **kwargs):
        if not saved:
            saved.append(1)
            _save(2, path)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ZarrReader, "read", save_first)
    out = ls.load_state(path)
    gens = {generation_of("a", out["a"]), generation_of("b", out["b"])}
    assert saved and len(gens) == 1


def test_zarr_load_reads_one_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "run.zarr"
    _save(1, path)
    real = ZarrReader.read
    saved = []

    def save_first(self, *args, **kwargs):
        if not saved:
            saved.append(1)
            _save(2, path)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ZarrReader, "read", save_first)
    target = {k: np.zeros_like(v) for k, v in state(0).items()}
    ls.load(target, path)
    assert saved
    assert generation_of("a", target["a"]) == generation_of("b", target["b"])


# ------------------------------------------------------------------ HDF5, one process


def _save_while_h5py_opens(monkeypatch, path: Path, gen: int) -> list[int]:
    """Make the next read-only ``h5py.File`` of ``path`` be followed at once by a save of
    generation ``gen`` to the same path (the window between opening the file and reading)."""
    real = h5py.File
    done: list[int] = []

    def file(name, mode="r", *args, **kwargs):
        handle = real(name, mode, *args, **kwargs)
        if mode == "r" and not done and Path(name) == path:
            done.append(1)
            _save(gen, path)
        return handle

    monkeypatch.setattr(h5py, "File", file)
    return done


def test_hdf5_reads_one_file_when_saved_over_while_opening(tmp_path, monkeypatch):
    """The reader opened the path twice (h5py, then os.open for pread): a save in between
    paired one file's chunk index and CRC table with the other file's bytes."""
    path = tmp_path / "latest.h5"
    _save(1, path)
    done = _save_while_h5py_opens(monkeypatch, path, 2)
    with ls.open(path) as ck:
        assert done
        assert generation_of("b", ck["b"][1000:3000], 1000) == 1
        assert generation_of("b", ck["b"].read()) == 1
        ck.verify()
    monkeypatch.undo()
    assert generation_of("b", ls.load_state(path)["b"]) == 2


def test_hdf5_load_and_load_state_read_one_file(tmp_path, monkeypatch):
    path = tmp_path / "latest.h5"
    _save(1, path)
    done = _save_while_h5py_opens(monkeypatch, path, 2)
    out = ls.load_state(path)
    assert done and generation_of("a", out["a"]) == generation_of("b", out["b"]) == 1
    done = _save_while_h5py_opens(monkeypatch, path, 3)
    target = {k: np.zeros_like(v) for k, v in state(0).items()}
    ls.load(target, path)
    assert done and generation_of("a", target["a"]) == generation_of("b", target["b"]) == 2


def test_hdf5_open_handle_keeps_its_file(tmp_path):
    path = tmp_path / "latest.h5"
    _save(1, path)
    with ls.open(path) as ck:
        _save(2, path)
        assert generation_of("b", ck["b"][5:50], 5) == 1
        assert generation_of("b", ck["b"].read()) == 1


def test_hdf5_pread_uses_the_descriptor_h5py_has_open(tmp_path):
    from lean_store.stores.hdf5.store import HDF5Reader

    path = tmp_path / "latest.h5"
    _save(1, path)
    reader = HDF5Reader(path)
    try:
        assert reader._fd == reader._file.id.get_vfd_handle()
        assert os.fstat(reader._fd).st_ino == os.stat(path).st_ino
    finally:
        reader.close()


# ------------------------------------------------ checkpoints saved by lean_store.distributed


SHARDED_SAVES = """
import sys
import numpy as np
import torch.distributed as dist
import lean_store as ls
from lean_store.distributed.local_state import LocalShard

dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
for path, gen in zip(sys.argv[2::2], sys.argv[3::2]):
    values = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + 1000 * int(gen)
    ls.save({"w": LocalShard(values, (64, 8), (0, 0))}, path)
dist.destroy_process_group()
import os, sys; sys.stdout.flush(); os._exit(0)  # why: tests/gloo_world.py leave_world
"""


@pytest.fixture(scope="module")
def sharded_pairs(tmp_path_factory) -> Path:
    """Generations 1 and 2 of a sharded checkpoint per backend (``run`` and ``fresh``), saved
    by a one-rank torch.distributed world in a child process."""
    require_torch()  # sharded saves need torch.distributed
    where = tmp_path_factory.mktemp("sharded")
    paths = []
    for suffix in SUFFIX.values():
        paths += [str(where / f"run{suffix}"), "1", str(where / f"fresh{suffix}"), "2"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", SHARDED_SAVES, str(where / "pg"), *paths], env=env,
                   check=True, timeout=600)
    return where


def test_sharded_checkpoint_replaced_while_open(sharded_pairs, suffix):
    """A sharded HDF5 checkpoint is a directory whose master file reads shard files by name
    (HDF5 virtual datasets): a replaced directory must not hand out the new shards."""
    from lean_store.stores.commit import replace_atomically

    path = sharded_pairs / f"run{suffix}"
    fresh = sharded_pairs / f"fresh{suffix}"
    with ls.open(path) as ck:
        assert float(ck["w"][0, 0]) == 1000
        replace_atomically(fresh, path)  # what a save does: exchange, delete the old tree
        with pytest.raises(CheckpointReplacedError):
            ck["w"][1, :3]
        with pytest.raises(CheckpointReplacedError):
            ck["w"].read()
    assert float(ls.load_state(path)["w"][0, 0]) == 2000


# ------------------------------------------------------------- a live writer process


def writer_main(path: str, stop: str, compression: str | None) -> None:
    """Child process: save generation 1, 2, ... to ``path`` until ``stop`` exists."""
    gen = 1
    while not os.path.exists(stop) and gen < 5000:
        _save(gen, Path(path), compression)
        gen += 1


def _start_writer(path: Path, stop: Path, compression: str | None) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
        + env.get("PYTHONPATH", "").split(os.pathsep)
    )
    code = (
        "import sys; from test_concurrent_readers import writer_main; "
        "writer_main(sys.argv[1], sys.argv[2], sys.argv[3] or None)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(path), str(stop), compression or ""], env=env,
    )


@pytest.mark.parametrize(("backend", "compression"), [
    ("hdf5", None), ("zarr", None), ("zarr", "zstd"),
])
def test_readers_under_a_live_writer(tmp_path, backend, compression):
    """Open, partial and whole reads, load and load_state in a loop while another process
    keeps replacing the checkpoint: every result is one generation's data, or the replaced
    error; never an IntegrityError, never a mix."""
    path = tmp_path / f"latest{SUFFIX[backend]}"
    stop = tmp_path / "stop"
    _save(0, path, compression)
    writer = _start_writer(path, stop, compression)
    outcomes = {"original": 0, "replaced": 0}
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 30  # bounds the loop; nothing asserts on time
        rounds = 0
        while rounds < 400 and time.monotonic() < deadline and (rounds < 40 or len(seen) < 4):
            rounds += 1
            try:
                with ls.open(path) as ck:
                    gen = generation_of("a", ck["a"][:16])
                    seen.add(gen)
                    start = (rounds * 4099) % (N_B - 600)
                    for read, name, at in (
                        (lambda ck=ck, s=start: ck["b"][s: s + 600], "b", start),
                        (lambda ck=ck: ck["b"].read(), "b", 0),
                        (lambda ck=ck: np.asarray(ck["a"]), "a", 0),
                    ):
                        outcomes[_original_or_replaced(read, gen, name, at)] += 1
            except CheckpointReplacedError:
                outcomes["replaced"] += 1
            try:
                out = ls.load_state(path)
                gen = generation_of("a", out["a"])
                assert generation_of("b", out["b"]) == gen
                seen.add(gen)
            except CheckpointReplacedError:
                outcomes["replaced"] += 1
            if rounds % 5 == 0:
                target = {k: np.zeros_like(v) for k, v in state(0).items()}
                try:
                    ls.load(target, path)
                    assert generation_of("a", target["a"]) == generation_of("b", target["b"])
                except CheckpointReplacedError:
                    outcomes["replaced"] += 1
    finally:
        stop.touch()
        try:
            writer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
    assert writer.returncode == 0
    assert len(seen) >= 2, f"the writer never replaced the checkpoint while read: {seen}"
    assert outcomes["original"] > 0, outcomes
