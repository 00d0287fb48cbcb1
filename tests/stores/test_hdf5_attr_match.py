"""The comparison of a dataset's attributes with its manifest record as stored bytes and
types (stores/hdf5/attrs.py), through libhdf5 directly (stores/hdf5/libhdf5.py) and through
h5py's low-level API: it accepts exactly what the writer wrote, and sends every other
attribute set (changed, retyped, reshaped, longer, missing, extra) to the value-by-value read
that names the difference."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.stores.hdf5 import attrs as attrs_module
from lean_store.stores.hdf5 import libhdf5
from lean_store.stores.hdf5.attrs import attrs_match, encode_attr, read_attrs, write_attrs
from lean_store.stores.hdf5.manifest import parse_manifest
from lean_store.stores.hdf5.store import _written_attrs


@pytest.fixture(params=["libhdf5", "h5py"])
def path_kind(request, monkeypatch) -> str:
    """Each test runs with the direct libhdf5 calls and with h5py's low-level API."""
    if request.param == "libhdf5":
        if libhdf5.library() is None:
            pytest.fail("libhdf5 is not usable here, so its comparison goes untested")
    else:
        monkeypatch.setattr(attrs_module, "library", lambda: None)
    return request.param


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ck.h5"
    ls.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "v": np.ones(1, np.int64),
             "s": np.array(1.5, np.float64)}, path)
    return path


def _expected(path: Path, node: str) -> list:
    with h5py.File(path, "r") as f:
        records = parse_manifest(f.attrs["manifest"].decode(), str(path))
    return _written_attrs(records[node])


def _matches(path: Path, node: str) -> bool:
    expected = _expected(path, node)
    with h5py.File(path, "r") as f:
        return attrs_match(f[node].id, expected)


def test_the_written_attributes_match(tmp_path: Path, path_kind: str) -> None:
    path = _saved(tmp_path)
    for node in ("w", "v", "s"):
        assert _matches(path, node)


# (attribute, how to rewrite it); every one of these must fail the byte comparison
TAMPERS = [
    ("index", lambda v: np.int64(v + 1)),  # another value, same type
    ("index", lambda v: np.int32(v)),  # the same value, another type
    ("index", lambda v: np.uint64(v)),  # the same value and bytes, unsigned
    ("index", lambda v: np.float64(v)),  # the same value, another type class and same size
    ("index", lambda v: np.array([v], np.int64)),  # the same value, shape (1,) not scalar
    ("shape", lambda v: np.asarray(v)[0]),  # (1,) -> scalar, same value (tensor v)
    ("shape", lambda v: np.asarray(v).astype(np.int32)),  # same values, 4-byte ints
    ("name", lambda v: np.array(v + b"x", dtype=h5py.string_dtype("utf-8", len(v) + 1))),
    ("name", lambda v: np.array(v, dtype=h5py.string_dtype("ascii", len(v)))),  # charset
    ("name", lambda v: np.array(v + b"\0", dtype=h5py.string_dtype("utf-8", len(v) + 1))),
    ("format", lambda v: np.array(b"float64", dtype=h5py.string_dtype("utf-8", 7))),
    ("chunk_crc32c", lambda v: np.asarray(v).astype(np.int64)),  # same CRCs, other type
    ("chunk_crc32c", lambda v: np.asarray(v) ^ np.uint32(1)),
]


@pytest.mark.parametrize("key, change", TAMPERS)
def test_any_other_attribute_fails_the_comparison(
    tmp_path: Path, path_kind: str, key: str, change
) -> None:
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        ds = f["v"]
        old = ds.attrs[key]
        del ds.attrs[key]
        ds.attrs[key] = change(old)
    assert not _matches(path, "v")
    assert _matches(path, "w")  # the other datasets are unaffected


@pytest.mark.parametrize("how", ["missing", "extra", "renamed"])
def test_a_missing_or_extra_attribute_fails_the_comparison(
    tmp_path: Path, path_kind: str, how: str
) -> None:
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        ds = f["w"]
        if how != "extra":
            value = ds.attrs["bias"]
            del ds.attrs["bias"]
        if how == "renamed":
            ds.attrs["Bias"] = value
        if how == "extra":
            ds.attrs["note"] = np.int64(1)
    assert not _matches(path, "w")


def test_a_retyped_attribute_of_equal_value_is_judged_by_its_value(tmp_path: Path) -> None:
    """The byte comparison refuses an int32 ``index``; the value-by-value read that follows
    sees the same number and accepts it, as lean_store always did; a different number is
    named."""
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        index = int(f["v"].attrs["index"])
        del f["v"].attrs["index"]
        f["v"].attrs["index"] = np.int32(index)
    assert not _matches(path, "v")
    assert ls.load_state(path)["v"].tolist() == [1]
    with h5py.File(path, "r+") as f:
        f["v"].attrs.modify("index", np.int32(index + 5))
    with pytest.raises(ls.IntegrityError, match=r"tensor 'v'.*attribute index is"):
        ls.load_state(path)


@pytest.mark.parametrize("key, value", [("shape", np.int64(1)), ("index", np.array([1]))])
def test_a_reshaped_attribute_is_named_on_load_and_by_verify(
    tmp_path: Path, path_kind: str, key: str, value: np.ndarray
) -> None:
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["v"].attrs[key]
        f["v"].attrs[key] = value
    with pytest.raises(ls.IntegrityError, match=rf"tensor 'v'.*attribute {key}"):
        ls.load_state(path)
    report = ls.verify(path)
    assert not report.ok and f"attribute {key}" in str(report)


def test_written_attributes_read_back_as_h5py_writes_them(tmp_path: Path, path_kind: str
                                                          ) -> None:
    """write_attrs (libhdf5 or h5py) stores what h5py's ``attrs[key] = value`` stores: the
    same types, shapes and values; and encode_attr gives back what reading returns."""
    values = {"i": 7, "big": 2**62, "neg": -3, "s": "héllo", "e": "", "t": (4, 5), "t0": (),
              "b": True, "f": 0.25, "table": np.array([1, 2**32 - 1], np.uint32)}
    with h5py.File(tmp_path / "a.h5", "w") as f:
        ours, theirs = f.create_group("ours"), f.create_group("theirs")
        write_attrs(ours.id, values)
        for key, value in values.items():
            theirs.attrs[key] = attrs_module.to_hdf5_attr(value)
        for key in values:
            a, b = ours.attrs.get_id(key), theirs.attrs.get_id(key)
            assert a.get_type() == b.get_type() and a.shape == b.shape, key
            assert np.array_equal(ours.attrs[key], theirs.attrs[key]), key
        assert attrs_match(ours.id, [encode_attr(k, v) for k, v in values.items()])
        assert attrs_match(theirs.id, [encode_attr(k, v) for k, v in values.items()])
        assert read_attrs(ours.id, "ours") == {**values, "table": (1, 2**32 - 1)}


def test_the_library_is_the_one_h5py_uses() -> None:
    lib = libhdf5.library()
    assert lib is not None  # h5py's wheels on Linux: a single bundled libhdf5
    with h5py.File("mem.h5", "w", driver="core", backing_store=False) as f:
        f.attrs["x"] = np.int64(3)
        assert lib.attrs_equal(f.id.id, [encode_attr("x", 3)])
        assert not lib.attrs_equal(f.id.id, [encode_attr("x", 4)])
        assert not lib.attrs_equal(f.id.id, [encode_attr("y", 3)])


def test_an_environment_switch_turns_the_direct_calls_off(monkeypatch) -> None:
    monkeypatch.setenv("LEAN_STORE_HDF5_CTYPES", "0")
    assert libhdf5._load() is None


def test_a_failed_direct_write_falls_back_to_h5py_and_its_error(tmp_path: Path) -> None:
    """An attribute libhdf5 refuses (here: one that exists) is written through h5py, which
    raises its own error; nothing is left half-written by the direct call."""
    with h5py.File(tmp_path / "a.h5", "w") as f:
        g = f.create_group("g")
        write_attrs(g.id, {"a": 1})
        with pytest.raises((RuntimeError, OSError, KeyError)):
            write_attrs(g.id, {"b": 2, "a": 1})
        assert dict(g.attrs) == {"a": 1, "b": 2}


def test_threads_saving_loading_and_using_h5py_at_once(tmp_path: Path) -> None:
    """The direct calls hold h5py's lock: loads (attribute comparisons), a save (attribute
    writes) and plain h5py use in other threads at the same time all give the right data.
    With h5py 3.12-3.15 this needs lean_store to take h5py's lock around the direct-chunk
    calls too (h5py takes it there only from 3.16): without it the save failed in most runs."""
    from concurrent.futures import ThreadPoolExecutor

    states = [{f"t{i}.{k}": np.full(16, i * 100 + k, np.float32) for k in range(40)}
              for i in range(3)]
    for i, state in enumerate(states):
        ls.save(state, tmp_path / f"{i}.h5")
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        for k in range(40):
            f.create_dataset(f"d{k}", data=np.arange(k + 1)).attrs["k"] = k

    def load(i: int) -> bool:
        for _ in range(5):
            got = ls.load_state(tmp_path / f"{i % 3}.h5")
            if any(got[n].tobytes() != v.tobytes() for n, v in states[i % 3].items()):
                return False
        return True

    def save(n: int) -> bool:
        for j in range(5):
            ls.save(states[j % 3], tmp_path / f"new{n}.{j}.h5")
        return all(ls.verify(tmp_path / f"new{n}.{j}.h5").ok for j in range(5))

    def plain(_: int) -> bool:
        with h5py.File(tmp_path / "plain.h5", "r") as f:
            return all(int(f[f"d{k}"].attrs["k"]) == k and f[f"d{k}"][-1] == k
                       for _ in range(5) for k in range(40))

    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(load, i) for i in range(3)] + [
            pool.submit(save, n) for n in range(2)] + [
            pool.submit(plain, i) for i in range(2)]
        assert all(job.result() for job in jobs)


def test_files_from_either_path_read_through_the_other(tmp_path: Path) -> None:
    """A save and a load in a process without the direct calls (LEAN_STORE_HDF5_CTYPES=0)
    and in one with them give the same attributes: each reads the other's file."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    script = (
        "import sys, numpy as np, lean_store as ls\n"
        "from lean_store.stores.hdf5.libhdf5 import library\n"
        "mode, src, dst = sys.argv[1:]\n"
        "assert (library() is None) == (mode == 'off'), mode\n"
        "state = {f'l{i}.w': np.arange(i, i + 5, dtype=np.float32) for i in range(20)}\n"
        "state['b'] = np.array(True)\n"
        "got = ls.load_state(src)\n"
        "assert all(got[k].tobytes() == v.tobytes() for k, v in state.items())\n"
        "assert ls.verify(src).ok\n"
        "ls.save(state, dst)\n"
    )
    state = {f"l{i}.w": np.arange(i, i + 5, dtype=np.float32) for i in range(20)}
    state["b"] = np.array(True)
    ls.save(state, tmp_path / "here.h5")
    paths = [str(root), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    for mode, src, dst in [("off", "here.h5", "off.h5"), ("on", "off.h5", "on.h5"),
                           ("off", "on.h5", "off2.h5")]:
        run_env = dict(env, LEAN_STORE_HDF5_CTYPES="0" if mode == "off" else "1")
        subprocess.run([sys.executable, "-c", script, mode, str(tmp_path / src),
                        str(tmp_path / dst)], env=run_env, check=True, timeout=120)
    with h5py.File(tmp_path / "off.h5", "r") as a, h5py.File(tmp_path / "on.h5", "r") as b:
        for node in a:
            ka, kb = a[node].attrs, b[node].attrs
            assert list(ka) == list(kb)
            for key in ka:
                assert ka.get_id(key).get_type() == kb.get_id(key).get_type(), (node, key)
                assert np.array_equal(ka[key], kb[key]), (node, key)


def test_only_short_values_are_remembered() -> None:
    """Remembered encodings stay small: a long JSON string (a sharded record) is encoded each
    time, and the memory is bounded by a count."""
    long_text = "x" * (attrs_module.MAX_REMEMBERED_LEN + 1)
    assert encode_attr("doc", long_text) is not encode_attr("doc", long_text)
    assert encode_attr("format", "float32") is encode_attr("format", "float32")
    for i in range(attrs_module.MAX_ENCODED + 10):
        encode_attr("index", i)
    assert len(attrs_module._ENCODED) <= attrs_module.MAX_ENCODED
