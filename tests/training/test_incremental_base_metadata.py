"""How an incremental step knows its base's arrays (issue 15: fixed costs of a step): from what
the Checkpointer's previous save wrote (no document of the base read), else from the base's
root ``zarr.json`` (one read per save), else from each array's own ``zarr.json``. Either only
narrows which files are compared: a file is linked only when its bytes equal the new ones, so
an altered base still gives an exact, standalone step."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import frozen_backbone_model
from torch_optional import require_torch

import lean_store as ls
from lean_store.naming import node_name
from lean_store.stores.zarr import incremental

torch = require_torch()





def _train(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model[1].weight.add_(0.01)


def _node(name: str) -> str:
    return node_name("model/" + name)


def _chunk(step: Path, name: str) -> Path:
    """The first chunk file of the model parameter ``name`` (weights 2-D, biases 1-D)."""
    return step / _node(name) / ("c.0.0" if name.endswith("weight") else "c.0")


def _check_exact(step: Path, model: torch.nn.Module) -> None:
    assert ls.verify(step).ok
    got = {k[len("model/"):]: np.asarray(v) for k, v in ls.load_state(step).items()
           if k.startswith("model/")}
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(got[name], value.numpy())
    group = zarr.open_group(step, mode="r")  # standalone for stock zarr too
    np.testing.assert_array_equal(group[_node("0.weight")][...],
                                  model[0].weight.detach().numpy())


class _Reads:
    """Counts the metadata documents of a base read by the linker."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.arrays: list[Path] = []
        self.roots: list[Path] = []
        real_metadata, real_root = incremental._metadata, incremental._consolidated

        def metadata(array_dir: Path):
            self.arrays.append(array_dir)
            return real_metadata(array_dir)

        def root(path: Path):
            self.roots.append(path)
            return real_root(path)

        monkeypatch.setattr(incremental, "_metadata", metadata)
        monkeypatch.setattr(incremental, "_consolidated", root)


def test_consecutive_steps_read_no_document_of_the_base(scratch, monkeypatch):
    model = frozen_backbone_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True, keep_last=2)
    ck.save(0, model=model, rng=False)
    reads = _Reads(monkeypatch)
    for step in (1, 2, 3):
        _train(model)
        path = ck.save(step, model=model, rng=False)
        assert ck.last_save_stats.linked_files >= 2  # the frozen layer
        assert _chunk(path, "0.weight").stat().st_ino == _chunk(
            ck.path(step - 1), "0.weight").stat().st_ino
    assert reads.arrays == [] and reads.roots == []
    _check_exact(ck.path(3), model)


def test_a_new_checkpointer_reads_the_base_root_once(scratch, monkeypatch):
    model = frozen_backbone_model()
    ls.Checkpointer(scratch, backend="zarr", incremental=True).save(0, model=model, rng=False)
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)  # e.g. after a restart
    reads = _Reads(monkeypatch)
    _train(model)
    path = ck.save(1, model=model, rng=False)
    assert [p.name for p in reads.roots] == [ck.path(0).name] and reads.arrays == []
    assert _chunk(path, "0.weight").stat().st_ino == _chunk(ck.path(0), "0.weight").stat().st_ino
    _check_exact(path, model)


def test_a_replaced_base_is_not_described_by_the_earlier_save(scratch, monkeypatch):
    """The record of the previous save is for its directory: a step replaced by another
    directory (another inode) is read again."""
    model = frozen_backbone_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    first = ck.save(0, model=model, rng=False)
    copy = scratch / "copy"
    shutil.copytree(first, copy)
    shutil.rmtree(first)
    os.rename(copy, first)
    reads = _Reads(monkeypatch)
    _train(model)
    path = ck.save(1, model=model, rng=False)
    assert [p.name for p in reads.roots] == [first.name]
    _check_exact(path, model)


def test_root_copy_altered_to_another_chunk_grid_links_nothing_of_it(scratch):
    model = frozen_backbone_model()
    ls.Checkpointer(scratch, backend="zarr", incremental=True).save(0, model=model, rng=False)
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    root_file = ck.path(0) / "zarr.json"
    root = json.loads(root_file.read_text())
    copy = root["consolidated_metadata"]["metadata"][_node("0.weight")]
    copy["chunk_grid"]["configuration"]["chunk_shape"] = [1, 96]
    root_file.write_text(json.dumps(root, indent=2))
    _train(model)
    path = ck.save(1, model=model, rng=False)
    assert _chunk(path, "0.weight").stat().st_nlink == 1  # written, not linked
    assert _chunk(path, "0.bias").stat().st_nlink == 2  # the bias still linked
    _check_exact(path, model)


def test_altered_own_documents_of_the_base_still_give_an_exact_step(scratch):
    """The base's arrays are taken from the record (or root) while their own zarr.json say
    otherwise: only files whose bytes equal the new ones are linked, so the step is exact."""
    model = frozen_backbone_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    first = ck.save(0, model=model, rng=False)
    doc_file = first / _node("0.weight") / "zarr.json"
    doc = json.loads(doc_file.read_text())
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [1, 96]
    doc_file.write_text(json.dumps(doc, indent=2))
    chunk = _chunk(first, "0.bias")
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0x10  # same size, other bytes
    chunk.unlink()
    chunk.write_bytes(bytes(data))
    _train(model)
    path = ck.save(1, model=model, rng=False)
    assert _chunk(path, "0.bias").stat().st_nlink == 1
    assert _chunk(path, "0.weight").stat().st_ino == _chunk(first, "0.weight").stat().st_ino
    _check_exact(path, model)


def test_a_base_chunk_that_is_a_symlink_is_never_linked(scratch):
    model = frozen_backbone_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    first = ck.save(0, model=model, rng=False)
    chunk = _chunk(first, "0.weight")
    outside = scratch / "outside"
    shutil.copyfile(chunk, outside)  # the same bytes, through a link
    chunk.unlink()
    chunk.symlink_to(outside)
    _train(model)
    path = ck.save(1, model=model, rng=False)
    new = _chunk(path, "0.weight")
    assert not new.is_symlink() and new.stat().st_nlink == 1
    assert new.stat().st_ino != outside.stat().st_ino
    _check_exact(path, model)


def test_a_failed_save_forgets_the_record(scratch, monkeypatch):
    model = frozen_backbone_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    ck.save(0, model=model, rng=False)

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(incremental.UnitLinker, "link_or_write", broken)
        with pytest.raises(ls.CheckpointError):
            ck.save(1, model=model, rng=False)
    assert ck.steps() == [0]
    reads = _Reads(monkeypatch)
    _train(model)
    path = ck.save(1, model=model, rng=False)
    assert len(reads.roots) == 1  # step 0's root read again: nothing kept from the failure
    _check_exact(path, model)


@pytest.mark.parametrize("memory", [False, True])
def test_written_files_start_their_writeback_and_linked_ones_do_not(scratch, monkeypatch,
                                                                    memory):
    """Each unit file an incremental step writes asks the kernel to start writing it to disk
    (the commit's syncfs then waits for less); a linked file is already durable; on a file
    system kept in memory nothing is asked."""
    from lean_store.stores import fs_sync

    model = frozen_backbone_model()
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    ck.save(0, model=model, rng=False)
    started: list[int] = []

    def record(fd, offset, nbytes, flags):
        assert (offset, nbytes, flags) == (0, 0, 2)  # the whole file, SYNC_FILE_RANGE_WRITE
        started.append(os.fstat(fd).st_size)
        return 0

    monkeypatch.setattr(incremental, "_SYNC_FILE_RANGE", record)
    monkeypatch.setattr(fs_sync, "in_memory", lambda path: memory)
    _train(model)
    path = ck.save(1, model=model, rng=False)
    stats = ck.last_save_stats
    assert stats.written_files >= 1 and stats.linked_files >= 2
    if memory:
        assert started == []
    else:
        assert len(started) == stats.written_files and sum(started) == stats.written_bytes
    _check_exact(path, model)


def test_a_base_document_nested_absurdly_deep_is_not_parsed_and_links_nothing(scratch):
    """The base's root has no copy of an array and its own zarr.json nests 200,000 levels
    deep: the step writes that array whole (before, the save raised Python's RecursionError)."""
    model = frozen_backbone_model()
    ls.Checkpointer(scratch, backend="zarr", incremental=True).save(0, model=model, rng=False)
    ck = ls.Checkpointer(scratch, backend="zarr", incremental=True)
    root_file = ck.path(0) / "zarr.json"
    root = json.loads(root_file.read_text())
    del root["consolidated_metadata"]["metadata"][_node("0.weight")]
    root_file.write_text(json.dumps(root, indent=2))
    (ck.path(0) / _node("0.weight") / "zarr.json").write_text("[" * 200_000 + "]" * 200_000)
    _train(model)
    path = ck.save(1, model=model, rng=False)
    assert _chunk(path, "0.weight").stat().st_nlink == 1  # written, not linked
    assert _chunk(path, "0.bias").stat().st_nlink == 2  # the bias still linked
    _check_exact(path, model)
