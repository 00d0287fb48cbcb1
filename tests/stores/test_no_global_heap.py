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
