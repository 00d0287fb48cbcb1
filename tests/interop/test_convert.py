"""Converters: exact bits in every direction, refusal (never a cast) where a target cannot hold a
format, and byte-identical round trips for safetensors, torch and TorchLean files."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from torch_optional import needs_torch, torch

import lean_store as ls
from lean_store.errors import CheckpointError, FormatError, IntegrityError
from lean_store.interop import torchlean as tl
from lean_store.interop.convert import convert, format_of_path, open_input
from lean_store.interop.safetensors_io import SafetensorsSource, write_safetensors


def save_file(*args, **kwargs):
    """safetensors.torch.save_file, imported when used (it imports torch)."""
    from safetensors.torch import save_file as save

    return save(*args, **kwargs)


# Every dtype safetensors and torch share, as random raw bytes (NaN payloads included).
SHARED_DTYPES = [] if torch is None else [
    torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn,
    torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int16,
    torch.uint16, torch.float16, torch.bfloat16, torch.int32, torch.uint32, torch.float32,
    torch.complex64, torch.float64, torch.int64, torch.uint64,
]


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 10),
    )
    model(torch.randn(4, 3, 8, 8))  # a training-mode pass updates the BatchNorm buffers
    model[6].to(torch.bfloat16)
    return model


def random_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    state = {}
    for i, dtype in enumerate(SHARED_DTYPES):
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (3, 5 * size), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            raw %= 2
        name = f"t{(7 * i) % len(SHARED_DTYPES):02d}.{dtype}".replace("torch.", "")
        state[name] = raw.view(dtype)
    state["scalar"] = torch.tensor(1.5, dtype=torch.float64)
    state["empty"] = torch.zeros(0, 3)
    return state


@needs_torch
@pytest.mark.parametrize("mid", ["m.h5", "m.zarr"])
def test_model_safetensors_round_trip_is_byte_identical(tmp_path: Path, mid: str) -> None:
    src = tmp_path / "model.safetensors"
    save_file(small_model().state_dict(), src, metadata={"format": "pt", "note": "é"})
    convert(src, tmp_path / mid)
    convert(tmp_path / mid, tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == src.read_bytes()


@needs_torch
@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_checkpoint_converted_to_safetensors_says_its_format(tmp_path: Path, suffix) -> None:
    """transformers' from_pretrained (older releases, its Flax loader) refuses a safetensors
    file whose metadata has no known ``format``; save_pretrained writes {"format": "pt"}, and
    so does a conversion of anything but a safetensors file (whose own metadata, or its
    absence, is kept)."""
    from safetensors import safe_open

    ls.save(small_model(), tmp_path / f"m{suffix}")
    convert(tmp_path / f"m{suffix}", tmp_path / "model.safetensors")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(small_model().state_dict())
    save_file({"w": torch.ones(2)}, tmp_path / "bare.safetensors")  # no metadata at all
    convert(tmp_path / "bare.safetensors", tmp_path / f"bare{suffix}")
    convert(tmp_path / f"bare{suffix}", tmp_path / "bare_back.safetensors")
    with safe_open(tmp_path / "bare_back.safetensors", "pt") as f:
        assert f.metadata() is None


@needs_torch
def test_every_safetensors_dtype_round_trips_byte_identical(tmp_path: Path) -> None:
    src = tmp_path / "all.safetensors"
    state = random_state()
    save_file(state, src)
    convert(src, tmp_path / "all.h5")
    convert(tmp_path / "all.h5", tmp_path / "all.zarr")
    convert(tmp_path / "all.zarr", tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == src.read_bytes()
    from lean_store.sources.torch_source import format_of_dtype

    with ls.open(tmp_path / "all.h5") as ck:
        for name, tensor in state.items():  # every bit, compared as raw bytes
            assert ck[name].format == format_of_dtype(tensor.dtype)
            stored = np.ascontiguousarray(ck[name].bits()).view(np.uint8).reshape(-1)
            raw = tensor.reshape(-1).contiguous().view(torch.uint8)
            assert stored.tolist() == raw.tolist(), name


@needs_torch
def test_safetensors_writer_matches_the_library_for_arbitrary_names(tmp_path: Path) -> None:
    state = {f"{n}": torch.full((2,), i, dtype=d)
             for i, (n, d) in enumerate([("b", torch.float32), ("a", torch.float32),
                                         ("Z", torch.int64), ("é.x", torch.bfloat16),
                                         ("a.b", torch.uint8)])}
    save_file(state, tmp_path / "ref.safetensors")
    src = SafetensorsSource(tmp_path / "ref.safetensors")
    assert src.metadata is None
    write_safetensors(_reordered(src), tmp_path / "out.safetensors")
    ref = (tmp_path / "ref.safetensors").read_bytes()
    assert (tmp_path / "out.safetensors").read_bytes() == ref


def _reordered(src: SafetensorsSource):
    """The same tensors in reverse layout order: the writer must not depend on it."""
    from lean_store.sources import tensor_source

    words = {e.name: src.words(e) for e in src.layout}
    from lean_store.checkpoint import as_values

    return tensor_source({
        e.name: as_values(words[e.name].reshape(e.shape + ((2,) if e.format.words_per_value == 2
                                                            else ())), e.format)
        for e in reversed(list(src.layout))
    })


@needs_torch
def test_model_torch_round_trip_is_byte_identical(tmp_path: Path) -> None:
    model = small_model()
    src = tmp_path / "model.pt"
    torch.save(model.state_dict(), src)
    convert(src, tmp_path / "m.h5")
    (tmp_path / "out").mkdir()
    convert(tmp_path / "m.h5", tmp_path / "out" / "renamed.bin")  # the archive name is kept
    assert (tmp_path / "out" / "renamed.bin").read_bytes() == src.read_bytes()
    again = torch.load(tmp_path / "out" / "renamed.bin", weights_only=True)
    fresh = small_model()
    fresh.load_state_dict(again)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), name


@needs_torch
def test_torch_file_saved_to_a_file_object_round_trips(tmp_path: Path) -> None:
    state = {k: v for k, v in random_state().items()}
    with open(tmp_path / "a.pt", "wb") as f:
        torch.save(state, f)
    assert zipfile.ZipFile(tmp_path / "a.pt").namelist()[0].startswith("archive/")
    convert(tmp_path / "a.pt", tmp_path / "a.zarr")
    convert(tmp_path / "a.zarr", tmp_path / "b.pt")
    assert (tmp_path / "b.pt").read_bytes() == (tmp_path / "a.pt").read_bytes()


@needs_torch
def test_torch_pickle_with_code_is_refused_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"w": torch.zeros(2), "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(IntegrityError, match="weights_only"):
        convert(tmp_path / "evil.pt", tmp_path / "e.h5")
    assert not marker.exists() and not (tmp_path / "e.h5").exists()


@needs_torch
def test_a_pickled_whole_model_is_refused_saying_what_it_holds(tmp_path: Path) -> None:
    """``torch.save(model)`` (the whole module, common in older code): refused, naming the
    class the pickle needs and what to do with a trusted file; torch's message came through
    as its first line, cut before its advice and with its terminal colour codes."""
    torch.save(torch.nn.Sequential(torch.nn.Linear(3, 2)), tmp_path / "whole.pt")
    with pytest.raises(IntegrityError) as info:
        convert(tmp_path / "whole.pt", tmp_path / "w.h5")
    message = str(info.value)
    assert "holds a pickled torch.nn.modules.container.Sequential" in message
    assert "weights_only=False" in message and "state_dict()" in message
    assert "\x1b" not in message and "\n" not in message
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(IntegrityError) as info:
        convert(tmp_path / "junk.pt", tmp_path / "j.h5")
    assert "weights_only=True) refused it" in str(info.value)
    assert "\x1b" not in str(info.value) and "will likely succeed" not in str(info.value)


@needs_torch
def test_torch_file_that_is_not_a_state_dict_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2), "step": 3}, tmp_path / "mixed.pt")
    # a checkpoint dict (tests/interop/test_torch_checkpoint_dict.py): tensors only for
    # safetensors, which refuses it
    with pytest.raises(FormatError, match="checkpoint dict"):
        convert(tmp_path / "mixed.pt", tmp_path / "m.safetensors")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(FormatError, match="list"):
        convert(tmp_path / "list.pt", tmp_path / "m.h5")


ODD = {
    "w": np.ones(3, np.float32),
    "twelve": ls.Encoded.from_values([1.0, -2.5], ls.formats.binary(5, 6)),
    "e4m3": ls.Encoded.from_values([1.0], "float8_e4m3"),
    "c128": np.array([1 + 2j]),
}


@pytest.mark.parametrize(
    "target, refused",
    [
        ("out.safetensors", ["twelve", "e4m3", "c128"]),
        pytest.param("out.pt", ["twelve", "e4m3"], marks=needs_torch),
        ("out.tlsf32", ["twelve", "e4m3", "c128"]),
        ("out.json", ["float8_e4m3", "binary_5_6_15_ieee"]),
        ("out.tladam", ["TorchLean Adam"]),
    ],
)
def test_unrepresentable_formats_are_refused_not_cast(
    tmp_path: Path, target: str, refused: list[str]
) -> None:
    ls.save(ODD, tmp_path / "odd.h5")
    with pytest.raises(FormatError) as info:
        convert(tmp_path / "odd.h5", tmp_path / target)
    for name in refused:
        assert name in str(info.value)
    assert "never casts" in str(info.value)
    assert list(tmp_path.iterdir()) == [tmp_path / "odd.h5"]  # nothing written, no temp left


def test_bits_survive_every_target_that_holds_them(tmp_path: Path) -> None:
    bits = np.array([0x7FC00001, 0xFFC12345, 0x80000000, 0x00000001, 0x7F800000], np.uint32)
    state = {"x": bits.view(np.float32)}
    ls.save(state, tmp_path / "a.h5")
    torch_file = ["d.pt"] if torch is not None else []  # .pt needs torch; the rest does not
    chain = ["b.zarr", "c.safetensors", *torch_file, "e.tlsf32", "g.h5"]
    prev = tmp_path / "a.h5"
    for name in chain:
        convert(prev, tmp_path / name)
        prev = tmp_path / name
    out = ls.load_state(prev)
    assert out["0"].view(np.uint32).tolist() == bits.tolist()  # TorchLean files drop names
    # TorchLean's JSON float32 tag allows one NaN word only: NaN payloads cannot go there.
    with pytest.raises(FormatError, match="non-canonical NaN"):
        convert(prev, tmp_path / "f.json")
    assert not (tmp_path / "f.json").exists()


def test_sf32_and_json_import_export_are_byte_identical(tmp_path: Path) -> None:
    tl.write_sf32(tmp_path / "s.tlsf32", [np.array([1.0, -2.5], np.float32),
                                          np.arange(6, dtype=np.float32).reshape(2, 3)])
    convert(tmp_path / "s.tlsf32", tmp_path / "s.h5")
    convert(tmp_path / "s.h5", tmp_path / "back.tlsf32")
    assert (tmp_path / "back.tlsf32").read_bytes() == (tmp_path / "s.tlsf32").read_bytes()
    for tag, words in [
        ("torchlean_state_bits_v1", np.array([0x3FF0000000000000, 0x7FF8000000000000], np.uint64)),
        ("torchlean_state_binary_5_6_15_ieee_v1", np.array([0, 1, 0xFFF, 0x7C0], np.uint16)),
        ("torchlean_state_binary_4_3_7_finite_v1", np.array([0x7F, 0xFF], np.uint8)),
        ("torchlean_state_complex_v1(torchlean_state_float32_bits_v1)",
         np.array([[0x3F800000, 0x80000000]], np.uint32)),
    ]:
        tl.write_state_json(tmp_path / "j.json", tl.TLState(tag, [words]))
        convert(tmp_path / "j.json", tmp_path / "j.zarr")
        convert(tmp_path / "j.zarr", tmp_path / "k.json")
        assert (tmp_path / "k.json").read_bytes() == (tmp_path / "j.json").read_bytes(), tag
        (tmp_path / "k.json").unlink()
        import shutil

        shutil.rmtree(tmp_path / "j.zarr")


def _adam(version: int) -> tl.TLAdamFile:
    rng = np.random.default_rng(version)
    shapes = [(3, 2), (2,), (3, 2), ()]
    if version >= 3:
        params = [tl.TLAdamParam(shapes[0], True, 1), tl.TLAdamParam(shapes[1], False, 0),
                  tl.TLAdamParam(shapes[2], True, 1), tl.TLAdamParam(shapes[3], True, 4)]
        owners = [3, 0]
    else:
        params = [tl.TLAdamParam(s, g) for s, g in zip(shapes, (True, False, True, True))]
        owners = [2, 0, 3]
    hyper = (0.9, 0.999, 1e-8, 0.01)
    bits = tuple(struct.unpack("<Q", struct.pack("<d", h))[0] for h in hyper)
    entries = [
        tl.TLAdamEntry(i, 7 + i, rng.standard_normal(shapes[i]).astype(np.float32),
                       rng.random(shapes[i]).astype(np.float32))
        for i in owners
    ]
    return tl.TLAdamFile(version, "adamw", *hyper, bits, 12345 if version >= 4 else None,
                         params, entries)


@pytest.mark.parametrize("version", [2, 3, 4])
def test_adam_file_imports_to_optimizer_datasets_and_exports_byte_identical(
    tmp_path: Path, version: int
) -> None:
    tl.write_adam(tmp_path / "opt.tladam", _adam(version))
    convert(tmp_path / "opt.tladam", tmp_path / "opt.h5")
    with ls.open(tmp_path / "opt.h5") as ck:
        assert ck.kind == "optimizer"
        assert float(ck["hyper.beta2"].read()) == 0.999
        assert ("hyper.random_counter" in ck) == (version >= 4)
        first = _adam(version).entries[0]
        assert np.array_equal(ck[f"state.{first.id}.exp_avg"].read(), first.m)
        assert int(ck[f"state.{first.id}.step"].read()) == first.step
    convert(tmp_path / "opt.h5", tmp_path / "opt.zarr")
    convert(tmp_path / "opt.zarr", tmp_path / "back.tladam")
    assert (tmp_path / "back.tladam").read_bytes() == (tmp_path / "opt.tladam").read_bytes()


def test_corrupt_checkpoint_is_not_converted(tmp_path: Path) -> None:
    ls.save({"w": np.arange(4096, dtype=np.float32)}, tmp_path / "a.h5")
    import h5py

    with h5py.File(tmp_path / "a.h5", "r+") as f:
        f["w"].attrs["crc32c"] = 12345
    with pytest.raises(IntegrityError, match="crc32c"):
        convert(tmp_path / "a.h5", tmp_path / "b.zarr")
    with pytest.raises(IntegrityError, match="crc32c"):
        convert(tmp_path / "a.h5", tmp_path / "b.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.h5"]


def test_format_detection(tmp_path: Path) -> None:
    tl.write_sf32(tmp_path / "weights.bin", [np.zeros(2, np.float32)])  # magic beats suffix
    assert format_of_path(tmp_path / "weights.bin", reading=True) == "torchlean-sf32"
    assert format_of_path(tmp_path / "x.safetensors", reading=False) == "safetensors"
    with pytest.raises(CheckpointError, match="suffix"):
        format_of_path(tmp_path / "x.npz", reading=False)
    with pytest.raises(CheckpointError, match="unknown file format"):
        format_of_path(tmp_path / "x.h5", "npz", reading=False)
    with open_input(tmp_path / "weights.bin") as inp:
        assert inp.layout.names() == ["0"]


@needs_torch
def test_malformed_safetensors_is_rejected(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4)}, tmp_path / "ok.safetensors")
    data = (tmp_path / "ok.safetensors").read_bytes()
    cases = {
        "short": data[:-1],
        "huge_header": struct.pack("<Q", 1 << 40) + data[8:],
        "trailing": data + b"\0",
        "bad_json": data[:8] + b"[" + data[9:],
    }
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    header["a"]["data_offsets"] = [0, 12]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    cases["offsets"] = struct.pack("<Q", len(text)) + text + data[-16:]
    for name, content in cases.items():
        (tmp_path / f"{name}.safetensors").write_bytes(content)
        with pytest.raises(IntegrityError):
            convert(tmp_path / f"{name}.safetensors", tmp_path / f"{name}.h5")
        assert not (tmp_path / f"{name}.h5").exists()


@needs_torch
def test_a_sharded_hdf5_checkpoint_directory_converts(tmp_path: Path) -> None:
    """A sharded HDF5 checkpoint (a directory: lean_store.h5 and per-rank files, as sharded
    saves and the DCP writer make it) was taken for a Zarr store by convert ("not a readable
    Zarr v3 group") although inspect and verify read it."""
    import torch.distributed.checkpoint as dcp

    import lean_store.interop.dcp as lsd

    state = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.ones(4)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=lsd.StorageWriter(tmp_path / "s.h5"), no_dist=True)
    assert (tmp_path / "s.h5").is_dir()
    convert(tmp_path / "s.h5", tmp_path / "s.safetensors")
    convert(tmp_path / "s.h5", tmp_path / "s.zarr")
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "s.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    from lean_store.cli import main

    assert main(["diff", str(tmp_path / "s.h5"), str(tmp_path / "s.zarr")]) == 0
    (tmp_path / "plain").mkdir()
    with pytest.raises(ls.IntegrityError, match="a directory but not a lean_store checkpoint"):
        convert(tmp_path / "plain", tmp_path / "p.h5")
