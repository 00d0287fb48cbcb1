"""lean_store HDF5 files keep no global heap, and readers refuse variable-length strings.

libhdf5 can loop forever on a corrupted global heap (found by tools/fuzz_soak.py); variable-length
strings are what would put one in our files.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from torch_optional import needs_torch, torch

import lean_store as ls


def _all_attrs(f: h5py.File):
    yield "/", f.attrs
    for name in f:
        yield name, f[name].attrs


@needs_torch
def test_every_string_attribute_is_fixed_length(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    path = tmp_path / "train.h5"
    ls.save_training(path, model=model, optimizer=opt, step=1, extra={"note": "naïve ✓"})
    strings = 0
    with h5py.File(path, "r") as f:
        for where, attrs in _all_attrs(f):
            for key in attrs:
                info = h5py.check_string_dtype(attrs.get_id(key).dtype)
                if info is not None:
                    strings += 1
                    assert info.length is not None, f"{where}:{key} is variable-length"
    assert strings > 10
    assert ls.load_training(path, model=model, optimizer=opt).extra == {"note": "naïve ✓"}


def test_variable_length_string_attributes_are_refused(tmp_path):
    path = tmp_path / "x.h5"
    ls.save({"w": np.zeros(3)}, path)
    with h5py.File(path, "r+") as f:
        f["w"].attrs["format"] = "float64"  # h5py writes a str as a variable-length string
    with pytest.raises(ls.UnsafeFileError, match="variable-length"), ls.open(path) as ck:
        ck["w"].read()  # dataset attributes are read when its data is (the manifest at open)


def test_root_attributes_of_other_tools_are_ignored_unread(tmp_path):
    """An analyst annotating a checkpoint with h5py (``f.attrs["note"] = "..."``: a
    variable-length string, or any other type h5py writes) made every load refuse it
    (UnsafeFileError) although readers ignore root attributes they do not use (FORMAT.md
    2.2): they are now skipped without being read, so no global heap is touched; a
    variable-length string under a name lean_store reads is still refused."""
    from lean_store.stores.hdf5.checks import ROOT_ATTRS

    state = {"w": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.float16)}
    path = tmp_path / "x.h5"
    ls.save(state, path)
    with h5py.File(path, "r+") as f:
        f.attrs["note"] = "good run, keep"  # variable-length
        f.attrs["notes"] = ["a", "b"]  # a variable-length string array
        f.attrs["confusion"] = np.eye(3)  # two dimensions
        f.attrs.create("pair", np.zeros(2, [("x", "<f4"), ("y", "<i2")]))  # compound
    got = ls.load_state(path)
    assert all(got[k].tobytes() == v.tobytes() for k, v in state.items())
    assert ls.verify(path).ok
    with ls.open(path) as ck:
        assert not set(ck.root_attrs) - ROOT_ATTRS
    with h5py.File(path, "r+") as f:
        f.attrs["writer"] = "someone else"  # a name lean_store reads, now variable-length
    with pytest.raises(ls.UnsafeFileError, match="'writer' is a variable-length"):
        ls.load_state(path)


def test_root_attribute_names_are_those_of_the_format_spec():
    """ROOT_ATTRS is every root attribute docs/FORMAT.md names (2.2, and section 5's
    conversion attributes): one the spec adds and the reader skipped would be lost."""
    import re
    from pathlib import Path

    from lean_store.stores.hdf5.checks import ROOT_ATTRS

    spec = (Path(__file__).parents[2] / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    root = spec[spec.index("### 2.2 Root attributes"):spec.index("### 2.3")]
    conversions = spec[spec.index("## 5."):spec.index("## 6.")]
    named = set()
    for section in (root, conversions):
        for row in re.findall(r"^\| (`[^|]+)\|", section, re.M):
            named |= set(re.findall(r"`([a-z_0-9]+)`", row))
    named |= {"master_manifest", "lean_store_shard", "optimizer"}  # sections 6.1.1, 7.1
    assert named == ROOT_ATTRS
