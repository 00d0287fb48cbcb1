"""Debian's h5dump 1.10 (the reference "other reader") prints the right numbers."""

from __future__ import annotations

import shutil
import subprocess

import ml_dtypes
import numpy as np

import lean_store as ls

H5DUMP = shutil.which("h5dump")


def _dump(path, dataset: str) -> str:
    assert H5DUMP, "h5dump is required: ./dev test installs Debian's hdf5-tools"
    out = subprocess.run(
        [H5DUMP, "-A", "0", "-d", dataset, str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _data(text: str) -> str:
    return text.split("DATA {", 1)[1]


def test_h5dump_prints_float32_bfloat16_12bit_and_complex64(tmp_path):
    path = tmp_path / "tools.h5"
    twelve = ls.formats.binary(5, 6)
    ls.save(
        {
            "f32": np.array([1.5, -2.25, 1e-3], dtype=np.float32),
            "bf16": np.array([3.140625, -0.5, 256.0], dtype=ml_dtypes.bfloat16),
            "b12": ls.Encoded.from_values([0.75, -6.5, 1024.0], twelve),
            "c64": np.array([1.5 + 2j, -0.25 - 8j], dtype=np.complex64),
            "fn": np.array([448.0, -1.0], dtype=ml_dtypes.float8_e4m3fn),
        },
        path,
    )
    f32 = _dump(path, "/f32")
    assert "H5T_IEEE_F32LE" in f32 and "1.5, -2.25, 0.001" in _data(f32)
    bf16 = _dump(path, "/bf16")
    assert "16-bit little-endian floating-point 16-bit precision" in bf16
    assert "3.14062, -0.5, 256" in _data(bf16)
    b12 = _dump(path, "/b12")
    assert "12-bit precision" in b12 and "0.75, -6.5, 1024" in _data(b12)
    c64 = _dump(path, "/c64")
    assert 'H5T_IEEE_F32LE "r"' in c64 and 'H5T_IEEE_F32LE "i"' in c64
    numbers = " ".join(_data(c64).split())
    assert "1.5, 2" in numbers and "-0.25, -8" in numbers
    # e4m3fn would be misread as a float (448 prints as nan): it is stored as bit patterns.
    fn = _dump(path, "/fn")
    assert "H5T_STD_U8LE" in fn and "126, 184" in _data(fn)
    attrs = subprocess.run(
        [H5DUMP, "-a", "/fn/format", str(path)], capture_output=True, text=True, timeout=60
    ).stdout
    assert '"float8_e4m3fn"' in attrs


def test_h5ls_lists_every_dataset(tmp_path):
    path = tmp_path / "ls.h5"
    ls.save({"layer.weight": np.zeros((2, 3), np.float32), "layer.bias": np.zeros(2)}, path)
    h5ls = shutil.which("h5ls")
    assert h5ls
    out = subprocess.run([h5ls, str(path)], capture_output=True, text=True, timeout=60).stdout
    assert "layer.weight" in out and "Dataset {2, 3}" in out and "layer.bias" in out
