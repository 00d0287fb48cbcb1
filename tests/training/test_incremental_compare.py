"""How an incremental step decides a unit file is unchanged: the CRC-32C words, then every
byte against the base's file (read in bounded windows); a chunk's CRC comes from the save's own
pass over its bytes (no second pass in the Zarr writer), and a linked file's stored word must
equal it."""

from __future__ import annotations

import os

import google_crc32c
import numpy as np
import pytest
import zarr

import lean_store as ls
from lean_store.stores.zarr import direct_write
from lean_store.stores.zarr.incremental import IncrementalStats, UnitLinker


def _word(data: bytes) -> bytes:
    return int(google_crc32c.value(data)).to_bytes(4, "little")


@pytest.fixture
def linker(tmp_path):
    base, new = tmp_path / "base", tmp_path / "new"
    base.mkdir()
    new.mkdir()
    data = bytes(range(256)) * 64
    (base / "c0").write_bytes(data + _word(data))
    return UnitLinker(base, new, IncrementalStats()), data


def test_equal_bytes_are_linked_once_their_crc_word_matches(linker, tmp_path):
    """A chunk whose bytes equal the base file's is linked when the base's stored CRC word
    equals the CRC of the new bytes (the callable, asked once, after the bytes compared
    equal)."""
    unit, data = linker
    calls = []
    word = unit.link_or_write(tmp_path / "new" / "c0", "c0", [
        np.frombuffer(data, np.uint8), lambda: (calls.append(1), _word(data))[1]])
    assert os.path.samefile(tmp_path / "new" / "c0", tmp_path / "base" / "c0")
    assert word == _word(data) and calls == [1]
    assert unit.stats.linked_files == 1 and unit.stats.written_files == 0


def test_equal_bytes_with_a_damaged_base_word_are_written(linker, tmp_path):
    """Equal data bytes but a base word that is not their CRC: written afresh with the right
    word, never linked (the new step would carry the base's damage)."""
    unit, data = linker
    wrong = bytes(b ^ 0xFF for b in _word(data))
    word = unit.link_or_write(tmp_path / "new" / "c0", "c0", [
        np.frombuffer(data, np.uint8), lambda: wrong])
    path = tmp_path / "new" / "c0"
    assert word is None and not os.path.samefile(path, tmp_path / "base" / "c0")
    assert path.read_bytes() == data + wrong
    assert unit.stats.written_files == 1 and unit.stats.linked_files == 0


def test_same_crc_word_different_bytes_is_written_not_linked(linker, tmp_path):
    """A CRC match alone never links: the bytes are compared too (as after a collision)."""
    unit, data = linker
    changed = bytearray(data)
    changed[5000] ^= 1
    unit.link_or_write(tmp_path / "new" / "c0", "c0", [bytes(changed), _word(data)])
    path = tmp_path / "new" / "c0"
    assert not os.path.samefile(path, tmp_path / "base" / "c0")
    assert path.read_bytes() == bytes(changed) + _word(data)
    assert unit.stats.written_files == 1 and unit.stats.linked_files == 0


def test_changed_bytes_with_a_lazy_crc_are_written_with_it(linker, tmp_path):
    unit, data = linker
    changed = bytes([data[0] ^ 1]) + data[1:]
    assert unit.link_or_write(tmp_path / "new" / "c0", "c0",
                              [changed, lambda: _word(changed)]) is None
    assert (tmp_path / "new" / "c0").read_bytes() == changed + _word(changed)
    assert unit.stats.written_files == 1


def test_a_base_file_of_another_size_is_not_compared(linker, tmp_path):
    unit, data = linker
    unit.link_or_write(tmp_path / "new" / "c0", "c0", [data[:-1], _word(data[:-1])])
    assert unit.stats.written_files == 1


@pytest.mark.parametrize("shape", [(64, 256), (67, 256)])  # aligned, and an edge chunk
def test_zarr_chunks_take_the_save_crc_instead_of_a_second_pass(tmp_path, monkeypatch, shape):
    passes = []
    real = direct_write._crc_bytes
    monkeypatch.setattr(direct_write, "_crc_bytes", lambda d: (passes.append(1), real(d))[1])
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    path = tmp_path / "w.zarr"
    ls.save({"w": w}, path, chunk_bytes=16 << 10)  # 16 rows a chunk, unsharded
    assert passes == []
    np.testing.assert_array_equal(ls.load_state(path)["w"], w)  # every chunk CRC-checked
    assert ls.verify(path).ok
    np.testing.assert_array_equal(zarr.open_group(str(path), mode="r")["w"][...], w)


def test_incremental_step_makes_one_crc_pass_per_chunk(tmp_path, monkeypatch):
    """Every chunk's bytes are CRC'd once in an incremental step, linked or written (a
    linked chunk's CRC is checked against the base's stored word); every step verifies
    (each chunk's CRC and the tensors' digests) and loads exactly."""
    from torch_optional import require_torch

    from lean_store import writing
    from lean_store.stores.zarr import direct_write

    torch = require_torch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    ck = ls.Checkpointer(tmp_path / "run", backend="zarr", incremental=True)
    ck.save(0, model=model, rng=False)
    with torch.no_grad():
        model[1].weight.add_(1.0)
    passes: list[int] = []
    real = writing.crc32c_of
    counted = lambda b, *a: (passes.append(b.nbytes), real(b, *a))[1]  # noqa: E731
    monkeypatch.setattr(writing, "crc32c_of", counted)  # units written in order
    monkeypatch.setattr(direct_write, "crc32c_of", counted)  # units written behind
    path = ck.save(1, model=model, rng=False)
    monkeypatch.undo()
    weight = 1024 * 1024 * 4
    assert ck.last_save_stats.linked_bytes >= weight  # the unchanged first layer
    assert sum(n for n in passes if n >= 1 << 20) == 2 * weight  # each layer's chunk once
    assert ls.verify(path).ok and ls.verify(ck.path(0)).ok
    got = ls.load_state(path)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(got[f"model/{name}"], value.numpy())


def test_a_base_file_truncated_while_compared_is_a_difference(tmp_path, monkeypatch):
    """Another process truncates the base file during the comparison: the step writes its
    own file (the base is read, not mapped: a mapping would end the process with SIGBUS)."""
    base, new = tmp_path / "base", tmp_path / "new"
    base.mkdir()
    new.mkdir()
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    (base / "c0").write_bytes(data + _word(data))
    real = os.preadv
    calls = []

    def truncating(fd, buffers, offset):
        if not calls:
            os.truncate(base / "c0", 1 << 20)
        calls.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", truncating)
    unit = UnitLinker(base, new, IncrementalStats())
    unit.link_or_write(new / "c0", "c0", [np.frombuffer(data, np.uint8), _word(data)])
    monkeypatch.undo()
    assert calls  # compared through reads
    assert not os.path.samefile(new / "c0", base / "c0")
    assert (new / "c0").read_bytes() == data + _word(data)
    assert unit.stats.written_files == 1 and unit.stats.linked_files == 0


def test_a_base_file_replaced_after_the_comparison_is_not_the_one_linked(linker, tmp_path,
                                                                         monkeypatch):
    """Another process puts a different file at the base's name once the bytes compared
    equal: the link is made to the file compared (through its open descriptor), never to
    the one now at that name."""
    from lean_store.stores.zarr import incremental

    unit, data = linker
    compared = os.stat(tmp_path / "base" / "c0").st_ino
    os.link(tmp_path / "base" / "c0", tmp_path / "kept")  # the compared file outlives its name
    real = incremental._link_open

    def replace_then_link(fd, base, link_to):
        other = tmp_path / "other"
        other.write_bytes(bytes(len(data)) + _word(bytes(len(data))))
        os.replace(other, base)  # the name now holds other bytes
        return real(fd, base, link_to)

    monkeypatch.setattr(incremental, "_link_open", replace_then_link)
    unit.link_or_write(tmp_path / "new" / "c0", "c0", [np.frombuffer(data, np.uint8),
                                                       _word(data)])
    got = tmp_path / "new" / "c0"
    assert got.read_bytes() == data + _word(data)  # the compared bytes, linked or written
    if incremental._ROOT_FD is not None:  # Linux: linked through /proc/self/fd
        assert unit.stats.linked_files == 1 and os.stat(got).st_ino == compared


def test_a_base_file_deleted_after_the_comparison_is_written(linker, tmp_path, monkeypatch):
    """The compared file is gone (replaced, its last name removed) before the link: the
    unit is written with the new bytes, never linked to what is at the name now."""
    from lean_store.stores.zarr import incremental

    unit, data = linker
    real = incremental._link_open

    def replace_then_link(fd, base, link_to):
        other = tmp_path / "other"
        other.write_bytes(bytes(len(data)) + _word(bytes(len(data))))
        os.replace(other, base)
        return real(fd, base, link_to)

    monkeypatch.setattr(incremental, "_link_open", replace_then_link)
    unit.link_or_write(tmp_path / "new" / "c0", "c0", [np.frombuffer(data, np.uint8),
                                                       _word(data)])
    got = tmp_path / "new" / "c0"
    assert got.read_bytes() == data + _word(data)
    assert not os.path.samefile(got, tmp_path / "base" / "c0")
