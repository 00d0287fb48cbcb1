"""Bad input gets a clear typed error, and the target is left exactly as it was."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import zarr
from helpers import h5_text, raw
from torch_optional import needs_torch, torch

import lean_store as ls


def _model(width: int = 6) -> torch.nn.Module:
    torch.manual_seed(width)
    return torch.nn.Sequential(
        torch.nn.Linear(3, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 2)
    )


def _snapshot(model: torch.nn.Module) -> dict:
    return {k: raw(v) for k, v in model.state_dict().items()}


@pytest.fixture
def saved(tmp_path, suffix):
    path = tmp_path / f"ck{suffix}"
    ls.save(_model(), path)
    return path


@needs_torch
def test_missing_path_and_plain_directory(tmp_path):
    target = _model()
    before = _snapshot(target)
    with pytest.raises(ls.CheckpointError, match="does not exist"):
        ls.load(target, tmp_path / "nope.h5")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ls.IntegrityError, match="not a lean_store checkpoint"):
        ls.load(target, tmp_path / "dir")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(ls.IntegrityError, match="not a lean_store checkpoint"):
        ls.open(tmp_path / "text.h5")
    assert _snapshot(target) == before


@needs_torch
def test_foreign_hdf5_and_zarr_files(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["0.weight"] = np.zeros((6, 3), np.float32)
    zarr.create_array(store=str(tmp_path / "arr.zarr"), shape=(4,), dtype="f4")
    group = zarr.open_group(str(tmp_path / "grp.zarr"), mode="w")
    group.create_array("x", shape=(2,), dtype="f4")
    target = _model()
    before = _snapshot(target)
    for name in ("other.h5", "arr.zarr", "grp.zarr"):
        with pytest.raises(ls.IntegrityError):
            ls.load(target, tmp_path / name)
    assert _snapshot(target) == before


@needs_torch
def test_checkpoint_of_another_model_lists_every_difference(saved):
    target = _model(width=7)
    before = _snapshot(target)
    with pytest.raises(ls.LayoutError) as info:
        ls.load(target, saved)
    kinds = {d.kind for d in info.value.differences}
    assert kinds == {"shape"}
    names = {d.name for d in info.value.differences}
    assert names == {
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "2.weight",
    }
    for name in names:
        assert repr(name) in str(info.value)
    assert _snapshot(target) == before


@needs_torch
def test_missing_and_extra_tensors_strict_and_not(saved):
    target = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.BatchNorm1d(6))
    before = _snapshot(target)
    with pytest.raises(ls.LayoutError) as info:
        ls.load(target, saved)
    assert {d.kind for d in info.value.differences} == {"count", "extra"}
    assert _snapshot(target) == before
    with pytest.warns(UserWarning, match="strict=False"):
        result = ls.load(target, saved, strict=False)
    assert result.unexpected == ["2.weight", "2.bias"] and result.missing == []
    reference = ls.load_state(saved)
    assert raw(target[0].weight) == raw(torch.from_numpy(reference["0.weight"]))


def _truncate(path, fraction):
    if path.is_dir():
        chunk_files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json")
        victim = max(chunk_files, key=lambda p: p.stat().st_size)
    else:
        victim = path
    data = victim.read_bytes()
    victim.write_bytes(data[: int(len(data) * fraction)])


@needs_torch
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.9])
def test_truncated_checkpoint(saved, fraction):
    _truncate(saved, fraction)
    target = _model()
    before = _snapshot(target)
    with pytest.raises(ls.CheckpointError):
        ls.load(target, saved)
    assert _snapshot(target) == before


def _edit_attrs(path, node, **changes):
    if path.is_dir():
        meta_path = path / node / "zarr.json"
        meta = json.loads(meta_path.read_text())
        meta["attributes"].update(changes)
        meta_path.write_text(json.dumps(meta))
    else:
        with h5py.File(path, "r+") as f:
            for key, value in changes.items():
                f[node].attrs[key] = h5_text(value) if isinstance(value, str) else value


def _edit_root_layout(path, name, **changes):
    if path.is_dir():
        meta_path = path / "zarr.json"
        meta = json.loads(meta_path.read_text())
        layout = json.loads(meta["attributes"]["layout"])
    else:
        with h5py.File(path, "r") as f:
            layout = json.loads(f.attrs["layout"])
    for item in layout:
        if item["name"] == name:
            item.update(changes)
    text = json.dumps(layout)
    if path.is_dir():
        meta["attributes"]["layout"] = text
        meta_path.write_text(json.dumps(meta))
    else:
        with h5py.File(path, "r+") as f:
            f.attrs["layout"] = h5_text(text)


@needs_torch
def test_attributes_that_lie_about_shape(saved):
    _edit_attrs(saved, "0.weight", shape=[3, 6] if saved.is_dir() else np.array([3, 6]))
    # Zarr: described from the root's consolidated copy, the array's own zarr.json is checked
    # against it when the tensor is read
    with pytest.raises(ls.IntegrityError, match="attribute shape|consolidated metadata"):
        ls.load_state(saved)


@needs_torch
def test_attributes_and_layout_that_lie_consistently(saved):
    # Both the root layout and the attributes claim 2x9; the payload holds 6x3.
    _edit_root_layout(saved, "0.weight", shape=[2, 9])
    _edit_attrs(saved, "0.weight", shape=[2, 9] if saved.is_dir() else np.array([2, 9]))
    target = _model()
    before = _snapshot(target)
    with pytest.raises(ls.IntegrityError, match="payload shape"):
        ls.load(target, saved)
    assert _snapshot(target) == before


@needs_torch
def test_attributes_that_lie_about_format(saved):
    _edit_root_layout(saved, "0.bias", format="bfloat16", width=16)
    _edit_attrs(saved, "0.bias", format="bfloat16", width=16)
    with pytest.raises(ls.IntegrityError, match="does not encode bfloat16"):
        ls.open(saved)


@needs_torch
def test_width_mismatch_in_layout(saved):
    _edit_root_layout(saved, "0.bias", width=16)
    with pytest.raises(ls.IntegrityError, match="width"):
        ls.open(saved)


@needs_torch
def test_uncommitted_and_future_checkpoints(saved):
    if saved.is_dir():
        meta = json.loads((saved / "zarr.json").read_text())
        meta["attributes"]["complete"] = False
        (saved / "zarr.json").write_text(json.dumps(meta))
    else:
        with h5py.File(saved, "r+") as f:
            del f.attrs["complete"]
    with pytest.raises(ls.IntegrityError, match="incomplete checkpoint"):
        ls.open(saved)


@needs_torch
def test_future_format_version(saved):
    if saved.is_dir():
        meta = json.loads((saved / "zarr.json").read_text())
        meta["attributes"]["format_version"] = 99
        (saved / "zarr.json").write_text(json.dumps(meta))
    else:
        with h5py.File(saved, "r+") as f:
            f.attrs["format_version"] = 99
    with pytest.raises(ls.IntegrityError, match="newer than this lean_store"):
        ls.open(saved)


def test_unsafe_and_colliding_names(tmp_path, suffix):
    path = tmp_path / f"n{suffix}"
    with pytest.raises(ls.LayoutError, match="differ only in letter case.*renamed"):
        ls.save({"Weight": np.zeros(2), "weight": np.zeros(2)}, path)
    with pytest.raises(ls.LayoutError, match="non-empty"):
        ls.save({"": np.zeros(2)}, path)
    # a lone surrogate (os.fsdecode of a name that is not UTF-8): HDF5 raised a raw
    # UnicodeEncodeError mid-save, Zarr wrote JSON that strict parsers (zarrs) refuse
    with pytest.raises(ls.LayoutError, match="not valid Unicode"):
        ls.save({"ok": np.zeros(1), "w\udc80": np.zeros(2)}, path)
    assert not path.exists()
    odd = {
        "../../etc/passwd": np.zeros(2),
        "/abs": np.ones(2),
        "a/b": np.full(2, 2.0),
        ".hidden": np.full(2, 3.0),
        "__reserved": np.full(2, 4.0),
        "naïve name": np.full(2, 5.0),
    }
    ls.save(odd, path)
    back = ls.load_state(path)
    assert list(back) == list(odd)
    for name, value in odd.items():
        np.testing.assert_array_equal(back[name], value)
    inside = {p.name for p in path.iterdir()} if path.is_dir() else set(h5py.File(path, "r"))
    assert all("/" not in n and not n.startswith(".") and n not in ("..", ".") for n in inside)
    assert not (tmp_path.parent / "etc").exists()


def test_duplicate_names_in_a_layout():
    f32 = ls.formats.get("float32")
    with pytest.raises(ls.LayoutError, match="duplicate"):
        ls.Layout.from_specs([("a", (1,), f32), ("a", (2,), f32)])


@needs_torch
def test_unsupported_values_are_refused(tmp_path):
    with pytest.raises(ls.CheckpointError):
        ls.save({"a": [1, 2, 3]}, tmp_path / "x.h5")
    with pytest.raises(ls.FormatError, match="has no lean_store format"):
        ls.save({"a": np.array(["x"])}, tmp_path / "x.h5")
    with pytest.raises(ls.FormatError):
        ls.save({"q": torch.empty(2, dtype=torch.bits8)}, tmp_path / "q.h5")
    assert not any(tmp_path.iterdir())


@needs_torch
def test_slicing_errors(saved):
    with ls.open(saved) as ck:
        with pytest.raises(ls.CheckpointError, match="out of bounds"):
            ck["0.weight"][6]
        with pytest.raises(ls.CheckpointError, match="too many indices"):
            ck["0.bias"][0, 0]
        with pytest.raises(ls.CheckpointError, match="basic indexing"):
            ck["0.bias"][[0, 1]]
        with pytest.raises(KeyError):
            ck["nope"]
