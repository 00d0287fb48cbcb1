"""False alarms and misleading errors (issue 11, items 6-9): valid files read as valid, and every
refusal is a CheckpointError that names the thing and says what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import damage_stored_bytes

import lean_store as ls
from lean_store import UnsupportedValueError

ROOT = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(11)
W = RNG.standard_normal((300, 1000)).astype(np.float32)  # incompressible: LZF gives up
Z = np.zeros((300, 1000), np.float32)  # compresses to almost nothing
STATE = {"w": W, "z": Z}
SMALL_CHUNKS = 1 << 16  # chunks of (16, 1000) float32: 19 per tensor


def _cli(*args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "lean_store", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (Debian hdf5-tools) is not installed")
    return path


def _masks(path: Path, node: str) -> list[int]:
    with h5py.File(path, "r") as f:
        ds = f[node]
        return [ds.id.get_chunk_info(i).filter_mask for i in range(ds.id.get_num_chunks())]


# ------------------------------------------------------------------ 6: optional filters skipped


def test_lzf_chunks_lzf_could_not_shrink_are_not_damage(tmp_path) -> None:
    path = tmp_path / "lzf.h5"
    ls.save(STATE, path, compression="lzf", chunk_bytes=SMALL_CHUNKS)
    masks = _masks(path, "w")  # HDF5 skipped LZF for every random chunk (not the padded edge)
    assert len(masks) == 19 and masks.count(1) == 18
    assert set(_masks(path, "z")) == {0}  # and applied it to the zeros
    report = ls.verify(path)
    assert report.ok, str(report)
    assert report.chunks == 38
    done = _cli("verify", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    # every read path: whole, partial, strided, and a chunk straddling read
    state = ls.load_state(path)
    assert state["w"].tobytes() == W.tobytes() and state["z"].tobytes() == Z.tobytes()
    with ls.open(path) as ck:
        assert np.array_equal(ck["w"][5:40, 3:700], W[5:40, 3:700])
        assert np.array_equal(ck["w"][::7, ::13], W[::7, ::13])
        assert np.array_equal(ck["z"][290:, -3:], Z[290:, -3:])


def test_gzip_with_fletcher32_fresh_file_verifies(tmp_path) -> None:
    path = tmp_path / "gz.h5"
    ls.save(STATE, path, compression="gzip", chunk_bytes=SMALL_CHUNKS,
            checksum="fletcher32+crc32c")
    assert ls.verify(path).ok
    assert ls.load_state(path)["w"].tobytes() == W.tobytes()


def test_skipped_fletcher32_is_still_damage(tmp_path) -> None:
    """A chunk whose mask skips a filter that may not be skipped (fletcher32 is mandatory) was
    written by something else: verify names the filter."""
    path = tmp_path / "f32.h5"
    ls.save({"w": W}, path, chunk_bytes=SMALL_CHUNKS, checksum="fletcher32+crc32c")
    with h5py.File(path, "r+") as f:
        f["w"].id.write_direct_chunk((16, 0), np.ascontiguousarray(W[16:32]).tobytes(), 1)
    report = ls.verify(path)
    assert not report.ok
    [problem] = report.problems
    assert problem.tensor == "w" and problem.chunk == (1, 0)
    assert "fletcher32" in problem.message


# ------------------------------------------------------------------ 7: a user block (h5jam)


def _jammed(tmp_path: Path, size: int = 512) -> Path:
    h5jam = _tool("h5jam")
    plain, block, out = tmp_path / "plain.h5", tmp_path / "ub.bin", tmp_path / "jammed.h5"
    ls.save(STATE, plain, chunk_bytes=SMALL_CHUNKS)
    block.write_bytes(b"#!user block, not HDF5\n".ljust(size - 1, b"x") + b"\n")
    subprocess.run([h5jam, "-i", str(plain), "-u", str(block), "-o", str(out)], check=True)
    with h5py.File(out, "r") as f:
        assert f.userblock_size == size
    return out


@pytest.mark.parametrize("size", [512, 4096])
def test_hdf5_with_a_user_block_reads_bit_exactly(tmp_path, size) -> None:
    path = _jammed(tmp_path, size)
    assert path.read_bytes()[:8] != b"\x89HDF\r\n\x1a\n"
    state = ls.load_state(path)
    assert state["w"].tobytes() == W.tobytes() and state["z"].tobytes() == Z.tobytes()
    with ls.open(path) as ck:
        assert ck.backend == "hdf5"
        assert np.array_equal(ck["w"][17:41, 999:], W[17:41, 999:])
        assert np.array_equal(ck["w"][::9, 5::11], W[::9, 5::11])
    assert ls.verify(path).ok
    target = {"w": np.empty_like(W), "z": np.empty_like(Z)}
    ls.load(target, path)
    assert target["w"].tobytes() == W.tobytes()
    done = _cli("inspect", str(path))
    assert done.returncode == 0, done.stderr


def test_not_hdf5_at_any_user_block_offset_says_where_it_looked(tmp_path) -> None:
    path = tmp_path / "junk.h5"
    path.write_bytes(b"x" * 5000)
    with pytest.raises(ls.IntegrityError, match="user block"):
        ls.open(path)


# ------------------------------------------------------------------ 8: re-chunked by h5repack


def _repacked(tmp_path: Path, layout: str, filters: str | None = None) -> Path:
    h5repack = _tool("h5repack")
    plain, out = tmp_path / "plain.h5", tmp_path / "repacked.h5"
    ls.save(STATE, plain, chunk_bytes=SMALL_CHUNKS)
    extra = ["-f", filters] if filters else []
    subprocess.run([h5repack, "-l", layout, *extra, str(plain), str(out)], check=True)
    return out


@pytest.mark.parametrize("layout", ["CHUNK=10x10", "CHUNK=300x53"])  # 3000 chunks; 19 chunks
def test_rechunked_file_is_named_as_rechunked_not_corrupt(tmp_path, layout) -> None:
    path = _repacked(tmp_path, layout)
    with pytest.raises(ls.IntegrityError) as info:
        ls.load_state(path)
    message = str(info.value)
    assert "re-chunked" in message and "corrupt" not in message
    assert "'w'" in message and "(16, 1000)" in message  # the tensor and the table's chunks
    assert f"of ({layout[6:].replace('x', ', ')})" in message  # the stored chunks
    assert "h5repack -l w:CHUNK=16x1000" in message  # what to do
    report = ls.verify(path)
    assert not report.ok and "re-chunked" in str(report)


def test_h5repack_keeping_the_chunking_keeps_the_file_readable(tmp_path) -> None:
    path = _repacked(tmp_path, "w,z:CHUNK=16x1000", "GZIP=4")
    with h5py.File(path, "r") as f:
        assert f["w"].compression == "gzip" and f["w"].chunks == (16, 1000)
    assert ls.verify(path).ok
    assert ls.load_state(path)["w"].tobytes() == W.tobytes()


def test_rechunking_back_as_suggested_restores_a_verified_file(tmp_path) -> None:
    path = _repacked(tmp_path, "CHUNK=10x10")
    back = tmp_path / "back.h5"
    subprocess.run([_tool("h5repack"), "-l", "w,z:CHUNK=16x1000", str(path), str(back)],
                   check=True)
    assert ls.verify(back).ok
    assert ls.load_state(back)["w"].tobytes() == W.tobytes()


def test_contiguous_file_is_named_with_the_command_that_rechunks_it(tmp_path) -> None:
    """``h5repack -l CONTI`` stores every dataset without chunks: refused as laid out again
    (not as corrupt), naming the chunks its checksum table was written for and the h5repack
    command that restores them; that command gives back a verified file."""
    path = _repacked(tmp_path, "CONTI")
    with h5py.File(path, "r") as f:
        assert f["w"].chunks is None
    with pytest.raises(ls.IntegrityError) as info:
        ls.load_state(path)
    message = str(info.value)
    assert "not chunked" in message and "h5repack -l CONTI" in message
    assert "corrupt" not in message
    node = "w" if "'w'" in message else "z"
    assert f"h5repack -l {node}:CHUNK=16x1000" in message  # what to do
    assert "not chunked" in str(ls.verify(path))
    back = tmp_path / "back.h5"
    subprocess.run([_tool("h5repack"), "-l", "w,z:CHUNK=16x1000", str(path), str(back)],
                   check=True)
    assert ls.verify(back).ok
    assert ls.load_state(back)["w"].tobytes() == W.tobytes()


# ------------------------------------------------------------------ 9: what cannot be saved


def _refused(tmp_path: Path, state, *, names: str, hint: str) -> None:
    path = tmp_path / "out.h5"
    with pytest.raises(UnsupportedValueError) as info:
        ls.save(state, path)
    message = str(info.value)
    assert names in message and hint in message, message
    assert isinstance(info.value, ls.CheckpointError)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left


def test_numpy_state_with_a_plain_number_names_it(tmp_path) -> None:
    _refused(tmp_path, {"w": np.ones(3), "epoch": 3}, names="'epoch'", hint="save_training")


def test_torch_state_with_a_plain_number_names_it(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    _refused(tmp_path, {"w": torch.ones(3), "epoch": 3}, names="'epoch'", hint="save_training")


def test_quantized_module_is_refused_with_what_to_do(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with warnings.catch_warnings():  # torch deprecates eager quantization in favour of torchao
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear},
                                                           dtype=torch.qint8)
    _refused(tmp_path, quantized, names="_packed_params", hint="float model")
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    _refused(tmp_path, {"q": q}, names="'q'", hint="dequantize")


def test_module_with_non_tensor_extra_state_names_it(tmp_path) -> None:
    torch = pytest.importorskip("torch")

    class WithExtra(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def get_extra_state(self) -> dict:
            return {"step": 3}

        def set_extra_state(self, state: dict) -> None:
            pass

    module = torch.nn.Sequential(WithExtra())
    _refused(tmp_path, module, names="'0._extra_state'", hint="get_extra_state")
    with pytest.raises(UnsupportedValueError, match="_extra_state"):
        ls.load(module, tmp_path / "never.h5")


@pytest.mark.parametrize("kind", ["coo", "csr"])
def test_sparse_tensor_is_refused_with_to_dense(tmp_path, kind) -> None:
    torch = pytest.importorskip("torch")
    dense = torch.eye(3)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore")
        sparse = dense.to_sparse() if kind == "coo" else dense.to_sparse_csr()
    _refused(tmp_path, {"w": dense, "s": sparse}, names="'s'", hint="to_dense()")


def test_meta_tensor_save_is_refused_naming_the_load(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    _refused(tmp_path, torch.nn.Linear(3, 3, device="meta"), names="'weight'",
             hint="lean_store.load")


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_name_too_long_for_a_path_component_is_refused_up_front(tmp_path, suffix) -> None:
    name = "é" * 100  # 200 UTF-8 bytes, 600 bytes once percent-escaped
    out = tmp_path / f"long{suffix}"
    with pytest.raises(ls.LayoutError) as info:
        ls.save({"ok": np.ones(2), name: np.ones(3)}, out)
    message = str(info.value)
    assert "éééé" in message and "255 bytes" in message and "shorten" in message
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
    with pytest.raises(ls.LayoutError, match="255 bytes"):
        ls.save({name: np.ones(3)}, out, blocking=False).wait()
    assert list(tmp_path.iterdir()) == []


def test_longest_storable_name_round_trips_in_zarr(tmp_path) -> None:
    name = "a" * 255  # a node name of exactly 255 bytes
    out = tmp_path / "edge.zarr"
    ls.save({name: np.arange(3.0)}, out)
    assert np.array_equal(ls.load_state(out)[name], np.arange(3.0))
    with pytest.raises(ls.LayoutError, match="255 bytes"):
        ls.save({name + "b": np.arange(3.0)}, tmp_path / "over.zarr")


def test_masked_array_is_refused_so_its_mask_is_not_lost(tmp_path) -> None:
    masked = np.ma.array([1.0, 2.0, 3.0], mask=[False, True, False])
    _refused(tmp_path, {"w": np.ones(2), "m": masked}, names="'m'", hint=".filled(")
    path = tmp_path / "ok.h5"
    ls.save({"m": np.arange(3.0)}, path)
    with pytest.raises(UnsupportedValueError, match="masked array"):
        ls.load({"m": masked}, path)  # as a target: what it shows would not be what was loaded
    assert masked.data.tolist() == [1.0, 2.0, 3.0]
    (tmp_path / "ok.h5").unlink()
    torch = pytest.importorskip("torch")
    _refused(tmp_path, {"t": torch.ones(2), "m": masked}, names="'m'", hint=".filled(")


def test_node_names_turn_back_into_tensor_names() -> None:
    from lean_store.naming import node_name, tensor_name

    names = ["model/0.weight", "é/ü", "%41", "_x", ".hidden", "zarr.json", "a b\tc", "🙂",
             "plain.name-1", "\ud800x"]
    for name in names:
        assert tensor_name(node_name(name)) == name, name
    assert tensor_name("no-escape") == "no-escape"
    assert tensor_name("%FF%FE") == "%FF%FE"  # no UTF-8: shown as the node it is


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_damaged_chunk_is_reported_under_the_tensor_name(tmp_path, suffix) -> None:
    """Training checkpoints name tensors ``model/...``; a store knows them by their node name
    (``model%2F...``), which a message must not show in place of the name."""
    values = np.arange(1000, dtype=np.float32) * 3.25
    path = tmp_path / f"t{suffix}"
    ls.save({"model/0.weight": values}, path)
    damage_stored_bytes(path, values.tobytes()[:64], 100, 0xFF)
    with pytest.raises(ls.IntegrityError) as info:
        ls.load_state(path)
    assert "'model/0.weight'" in str(info.value) and "%2F" not in str(info.value)


def test_a_path_that_is_no_path_is_refused_by_name(tmp_path) -> None:
    """None, a number or a list where a path goes: a CheckpointError saying what it is (a save
    raised TypeError from pathlib; a load called it a damaged Zarr group)."""
    for bad in (None, 3, ["a.h5"]):
        with pytest.raises(ls.CheckpointError, match="must be a str or os.PathLike"):
            ls.save({"x": np.ones(2)}, bad)
        with pytest.raises(ls.CheckpointError, match="must be a str or os.PathLike"):
            ls.save({"x": np.ones(2)}, bad, blocking=False)
        with pytest.raises(ls.CheckpointError, match="a zarr store or a file object"):
            ls.load_state(bad)
        with pytest.raises(ls.CheckpointError, match="must be a str or os.PathLike"):
            ls.Checkpointer(bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_bytes_path_is_a_path(tmp_path, suffix) -> None:
    path = os.fsencode(tmp_path / f"b{suffix}")
    ls.save({"x": np.arange(3.0)}, path)
    ls.save({"x": np.arange(3.0)}, path, blocking=False).wait()
    assert np.array_equal(ls.load_state(path)["x"], np.arange(3.0))
    assert ls.verify(path).ok


def test_a_checkpointer_on_a_file_says_so(tmp_path) -> None:
    (tmp_path / "ck.h5").write_bytes(b"x")
    for where in (tmp_path / "ck.h5", tmp_path / "ck.h5" / "run"):
        with pytest.raises(ls.CheckpointError, match="is a file"):
            ls.Checkpointer(where)
    assert (tmp_path / "ck.h5").read_bytes() == b"x"


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_format_mismatch_says_how_to_cast_on_purpose(tmp_path, suffix) -> None:
    """A model kept in bfloat16 (or a float16 array) loaded from float32 weights is refused
    (never a silent cast); the error now shows the cast= that loads it on purpose, and the
    names it needs are those of its differences of kind 'format'."""
    path = tmp_path / f"w{suffix}"
    ls.save({"w": W[:4], "i": np.arange(3)}, path)
    target = {"w": np.zeros((4, 1000), np.float16), "i": np.zeros(3, np.int64)}
    with pytest.raises(ls.LayoutError) as info:
        ls.load(target, path)
    assert "never converted silently" in str(info.value)
    assert "cast={'w': 'float16'}" in str(info.value)
    assert not target["w"].any()
    cast = {d.name: "float16" for d in info.value.differences if d.kind == "format"}
    ls.load(target, path, cast=cast)
    assert target["w"].tobytes() == W[:4].astype(np.float16).tobytes()
    # without format differences the error is as before
    with pytest.raises(ls.LayoutError) as info:
        ls.load({"w": np.zeros((5, 1000), np.float32), "i": np.zeros(3, np.int64)}, path)
    assert "cast=" not in str(info.value)


def test_missing_batchnorm_counters_say_what_they_are(tmp_path) -> None:
    """Checkpoints written before torch 0.4.1 (and files converted from them) lack BatchNorm's
    num_batches_tracked, which torch's load_state_dict fills in for them; the refusal says so
    and that strict=False loads the rest. Any other missing tensor keeps the plain error."""
    path = tmp_path / "old.h5"
    ls.save({"bn.weight": np.ones(4, np.float32), "bn.running_mean": np.zeros(4, np.float32)},
            path)
    target = {"bn.weight": np.zeros(4, np.float32), "bn.running_mean": np.ones(4, np.float32),
              "bn.num_batches_tracked": np.zeros((), np.int64)}
    with pytest.raises(ls.LayoutError, match="BatchNorm counters") as info:
        ls.load(target, path)
    assert "strict=False" in str(info.value) and target["bn.weight"].sum() == 0
    with pytest.warns(UserWarning, match="num_batches_tracked"):
        result = ls.load(target, path, strict=False)
    assert result.missing == ["bn.num_batches_tracked"] and target["bn.weight"].sum() == 4
    target["other"] = np.zeros(2, np.float32)
    with pytest.raises(ls.LayoutError) as info:
        ls.load(target, path)
    assert "BatchNorm" not in str(info.value)
