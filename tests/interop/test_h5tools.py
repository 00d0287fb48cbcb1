"""Other readers of lean_store HDF5 files: Debian's h5dump/h5ls 1.10, and h5py without lean_store.

One file holds every standard format plus configured ones. For narrow formats it holds every
code point; for wide ones the special values and random patterns.

* h5dump (run with ``-m %.17g`` so that numbers print exactly) must print the exact value of
  every code point of the IEEE-like formats stored as HDF5 floats, and for the rest (stored as
  unsigned bit patterns) the raw words plus the attributes that say how to read them.
* plain h5py (a subprocess that never imports lean_store) must read the float formats with
  ``f[name][...]`` and get exact values in the dtype documented in docs/INTEROP.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import lean_store as ls
from lean_store.formats import STANDARD, binary, complex_of
from lean_store.naming import node_name
from lean_store.stores.hdf5.types import storage_kind

# No skip: ./dev test installs hdf5-tools; without h5dump these tests must fail, not pass.

CONFIGURED = [
    binary(5, 6),  # 12 bits, IEEE-like: an HDF5 float packed by the N-bit filter
    binary(8, 10),  # 19 bits (TF32-like)
    binary(4, 3, encoding="finite"),  # no inf/NaN: stored as bits
    binary(3, 2, encoding="finite-max-nan"),
    complex_of("bfloat16"),
]

# What plain h5py returns for each format stored as an HDF5 float (documented in INTEROP.md).
H5PY_DTYPES = {
    "float16": "float16", "float32": "float32", "float64": "float64", "bfloat16": "float32",
    "float8_e5m2": "float16", "float8_e4m3": "float16", "float8_e3m4": "float16",
    "binary_5_6_15_ieee": "float16", "binary_8_10_127_ieee": "float32",
    "complex64": "complex64", "complex128": "complex128", "complex(bfloat16)": "complex64",
}


def _codes(fmt: ls.ScalarFormat, rng: np.random.Generator) -> np.ndarray:
    width = fmt.word_width
    if width <= 12:
        return np.arange(1 << width, dtype=fmt.storage_dtype)
    top = (1 << width) - 1
    exp_mask = 0 if not isinstance(fmt, ls.formats.BinaryFormat) else (
        ((1 << fmt.exponent_bits) - 1) << fmt.fraction_bits)
    special = [0, 1, 1 << (width - 1), exp_mask, exp_mask | 1, top, exp_mask - 1,
               (1 << (width - 1)) | exp_mask]
    random = rng.integers(0, top, size=2000, dtype=np.uint64, endpoint=True)
    return np.concatenate([np.array(special, np.uint64), random]).astype(fmt.storage_dtype)


@pytest.fixture(scope="module")
def every_format(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    rng = np.random.default_rng(7)
    state: dict = {}
    for tag, fmt in STANDARD.items():
        if tag == "bool":
            state[tag] = np.array([True, False, True])
        elif fmt.kind == "int":
            info = np.iinfo(fmt.numpy_dtype)
            state[tag] = np.array([info.min, -1 if info.min else 1, 0, info.max], fmt.numpy_dtype)
        elif fmt.words_per_value == 2:
            codes = _codes(fmt.component, rng)[:1000]
            state[tag] = ls.Encoded(np.stack([codes, codes[::-1]], axis=-1), fmt)
        else:
            state[tag] = ls.Encoded(_codes(fmt, rng), fmt)
    for fmt in CONFIGURED:
        if fmt.words_per_value == 2:
            codes = _codes(fmt.component, rng)
            state[fmt.tag] = ls.Encoded(np.stack([codes, codes[::-1]], axis=-1), fmt)
        else:
            state[fmt.tag] = ls.Encoded(_codes(fmt, rng), fmt)
    path = tmp_path_factory.mktemp("h5tools") / "every_format.h5"
    ls.save(state, path)
    return path, state


def _bits(value: object) -> np.ndarray:
    return value.bits if isinstance(value, ls.Encoded) else value


def _h5dump(path: Path, *args: str) -> str:
    result = subprocess.run(["h5dump", *args, str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _blocks(text: str) -> dict[str, str]:
    """Dataset name -> the text of its h5dump block."""
    parts = re.split(r'^\s*DATASET "([^"]+)" \{$', text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _data_tokens(block: str) -> list[str]:
    match = re.search(r"^( *)DATA \{$", block, flags=re.M)
    assert match is not None
    data = block[match.end():].split("\n" + match.group(1) + "}\n", 1)[0]
    data = re.sub(r"\(\d+(,\d+)*\):", " ", data).replace("{", " ").replace("}", " ")
    return [t for t in re.split(r"[\s,]+", data) if t]


def _same(printed: np.ndarray, exact: np.ndarray) -> bool:
    nan = np.isnan(exact)
    return bool(
        np.array_equal(np.isnan(printed), nan)
        and np.array_equal(printed[~nan], exact[~nan])
        and np.array_equal(np.signbit(printed[~nan]), np.signbit(exact[~nan]))
    )


def test_h5ls_lists_every_tensor_with_its_shape(every_format: tuple[Path, dict]) -> None:
    path, state = every_format
    result = subprocess.run(["h5ls", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = dict(re.findall(r"^(\S+)\s+Dataset \{([^}]*)\}", result.stdout, flags=re.M))
    assert len(listed) == len(state)
    for tag, value in state.items():
        shape = value.shape
        assert listed[node_name(tag)].replace(" ", "") == "/".join(str(d) for d in shape) or \
            listed[node_name(tag)] == ", ".join(str(d) for d in shape), tag


def test_h5dump_prints_exact_numbers_or_bits_with_attributes(
    every_format: tuple[Path, dict],
) -> None:
    path, state = every_format
    blocks = _blocks(_h5dump(path, "-m", "%.17g"))
    assert len(blocks) == len(state)
    checked = {"float": 0, "compound": 0, "uint": 0}
    for tag, value in state.items():
        fmt = ls.formats.get(tag)
        block = blocks[node_name(tag)]
        kind = storage_kind(fmt)
        assert f'(0): "{tag}"' in block  # the format attribute, for every dataset
        tokens = _data_tokens(block)
        bits = _bits(value)
        if kind in ("float", "compound"):
            printed = np.array([float(t) for t in tokens])
            exact = fmt.decode(bits)
            if kind == "compound":
                exact = np.stack([exact.real, exact.imag], axis=-1).reshape(-1)
            assert _same(printed, exact.reshape(-1)), tag
            checked[kind] += 1
        elif kind == "uint":
            assert [int(t) for t in tokens] == bits.reshape(-1).tolist(), tag
            assert '(0): "uint"' in block and f"(0): {fmt.width}\n" in block  # storage, width
            if isinstance(fmt, ls.formats.BinaryFormat):
                assert f'(0): "{fmt.encoding}"' in block
            checked[kind] += 1
        elif kind == "bool":
            assert tokens == ["TRUE", "FALSE", "TRUE"]
        else:
            assert [int(t) for t in tokens] == value.tolist(), tag
    # IEEE-like: float64/32/16, bfloat16, e5m2, e4m3, e3m4, 12-bit, 19-bit; complex x3;
    # bits: e4m3fn, e4m3fnuz, e5m2fnuz, fp6 x2, fp4, e8m0 and the two configured finite ones.
    assert checked == {"float": 9, "compound": 3, "uint": 9}


H5PY_ONLY = textwrap.dedent(
    """
    import json, sys
    import h5py, numpy as np
    out = {}
    with h5py.File(sys.argv[1], "r") as f:
        for node in f:
            v = f[node][...]
            flat = v.reshape(-1)
            if v.dtype.kind == "c":
                flat = np.stack([flat.real, flat.imag], axis=-1).reshape(-1)
            if flat.dtype.kind == "f":
                flat = flat.astype(np.float64).view(np.uint64)
            out[node] = {"dtype": str(v.dtype), "words": [int(x) for x in flat]}
    assert "lean_store" not in sys.modules
    print(json.dumps(out))
    """
)


def test_h5py_without_lean_store_reads_float_formats_exactly(
    every_format: tuple[Path, dict],
) -> None:
    path, state = every_format
    result = subprocess.run([sys.executable, "-c", H5PY_ONLY, str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    for tag, value in state.items():
        fmt = ls.formats.get(tag)
        entry = got[node_name(tag)]
        kind = storage_kind(fmt)
        bits = _bits(value)
        if kind in ("float", "compound"):
            assert entry["dtype"] == H5PY_DTYPES[tag], tag
            values = np.array(entry["words"], np.uint64).view(np.float64)
            exact = fmt.decode(bits)
            if kind == "compound":
                exact = np.stack([exact.real, exact.imag], axis=-1)
            assert _same(values, exact.reshape(-1)), tag
        elif kind == "uint":  # raw bit patterns, as unsigned integers of the container size
            assert entry["dtype"] == str(fmt.storage_dtype)
            assert entry["words"] == bits.reshape(-1).tolist(), tag
        elif kind == "bool":
            assert entry["dtype"] == "bool" and entry["words"] == [1, 0, 1]
        else:
            assert entry["dtype"] == tag and entry["words"] == value.tolist()


def test_h5repack_copies_a_checkpoint_whose_manifest_exceeds_64_kib(tmp_path: Path) -> None:
    """Hundreds of tensors make the root ``manifest`` attribute larger than 64 KiB, which only
    files of the HDF5 1.8 format or later hold: ``h5repack -L`` copies such a checkpoint, and
    the copy loads and verifies (docs/INTEROP.md)."""
    import h5py

    state = {f"layer{i}.bias": np.full(64, i, np.float32) for i in range(300)}
    path, copy = tmp_path / "many.h5", tmp_path / "copy.h5"
    ls.save(state, path)
    with h5py.File(path, "r") as f:
        assert f.attrs.get_id("manifest").get_storage_size() > 64 << 10
    subprocess.run(["h5repack", "-L", str(path), str(copy)], check=True, capture_output=True)
    got = ls.load_state(copy)
    assert all(got[k].tobytes() == v.tobytes() for k, v in state.items())
    assert ls.verify(copy).ok
