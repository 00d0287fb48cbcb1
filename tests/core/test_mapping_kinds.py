"""Any mapping of names to tensors is a state: a dict, an OrderedDict, a MappingProxyType, a
UserDict, of numpy arrays or torch tensors. A read-only or user mapping of torch tensors was
refused with "state entry 't' is a Tensor, not an array or tensor" (only a dict was taken for
torch state)."""

from __future__ import annotations

import collections
import types

import numpy as np
import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402

KINDS = [dict, collections.OrderedDict, types.MappingProxyType, collections.UserDict]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_every_mapping_kind_saves_and_loads_torch_and_numpy(tmp_path, kind, suffix) -> None:
    for values in ({"t": torch.arange(3.0), "u": torch.ones(2, dtype=torch.bfloat16)},
                   {"a": np.arange(3.0)}):
        path = tmp_path / f"{next(iter(values))}{suffix}"
        ls.save(kind(values), path)
        like = ls.load_state(path, like=kind(values))
        assert all(type(like[n]) is type(v) for n, v in values.items())
        targets = {n: v.clone().zero_() if isinstance(v, torch.Tensor) else np.zeros_like(v)
                   for n, v in values.items()}
        ls.load(kind(targets), path)
        for name, want in values.items():
            got = targets[name]
            assert (torch.equal(got, want) if isinstance(want, torch.Tensor)
                    else np.array_equal(got, want))
