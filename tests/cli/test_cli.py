"""The lean-store command line: every command, its output, and its exit status on errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store.cli import main

STATE = {
    "w": np.array([[1.0, -2.0], [np.nan, np.inf]], np.float32),
    "b": ls.Encoded.from_values([0.5, -1.5, 3.0], "bfloat16"),
    "twelve": ls.Encoded.from_values([1.0, 2.0, -3.0, 0.25], ls.formats.binary(5, 6)),
    "n": np.array([-5, 7, 2**40], np.int64),
    "c": np.array([1 + 2j, 3 - 4j], np.complex64),
}


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    ls.save(STATE, tmp_path / "a.h5")
    return tmp_path / "a.h5"


def test_help_lists_commands_and_examples(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for word in ("inspect", "verify", "diff", "convert", "export", "import", "examples:"):
        assert word in out
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "lean-store convert model.safetensors" in capsys.readouterr().out


def test_usage_error_exits_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_inspect_table(capsys: pytest.CaptureFixture, ckpt: Path) -> None:
    code, out, _ = run(capsys, "inspect", ckpt)
    assert code == 0
    for text in ("twelve", "binary_5_6_15_ieee", "bfloat16", "(2, 2)", "nbit", "complex64"):
        assert text in out


def test_inspect_stats_json_is_exact(capsys: pytest.CaptureFixture, ckpt: Path) -> None:
    code, out, _ = run(capsys, "inspect", ckpt, "--stats", "--json")
    assert code == 0
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert doc["backend"] == "hdf5" and doc["tensor_count"] == 5
    assert rows["twelve"]["width"] == 12 and rows["twelve"]["format"] == "binary_5_6_15_ieee"
    w = rows["w"]["stats"]
    assert (w["min"], w["max"], w["mean"], w["nan"], w["posinf"]) == (-2.0, 1.0, -0.5, 1, 1)
    t = rows["twelve"]["stats"]
    assert (t["min"], t["max"], t["mean"]) == (-3.0, 2.0, 0.0625)
    n = rows["n"]["stats"]
    assert (n["min"], n["max"]) == (-5, 2**40) and n["mean"] == (2**40 + 2) / 3
    assert rows["c"]["stats"]["mean"] == {"re": 2.0, "im": -1.0}


def test_inspect_zarr_and_missing(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    ls.save(STATE, tmp_path / "a.zarr")
    code, out, _ = run(capsys, "inspect", tmp_path / "a.zarr", "--json")
    assert code == 0 and json.loads(out)["backend"] == "zarr"
    code, out, err = run(capsys, "inspect", tmp_path / "missing.h5")
    assert code == 2 and "does not exist" in err and "Traceback" not in err


def test_inspect_foreign_hdf5_is_a_problem(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["x"] = np.zeros(3)
    code, _, err = run(capsys, "inspect", tmp_path / "plain.h5")
    assert code == 1 and "not a lean_store checkpoint" in err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_of_another_format_say_which_commands_read_it(
        capsys: pytest.CaptureFixture, tmp_path: Path, command: str) -> None:
    """A safetensors file (or a Hugging Face model directory of one) is no checkpoint to
    inspect or verify: a usage error (2) naming what it is and the commands that read it.
    Before: "not a lean_store checkpoint (no HDF5 signature ...)", and verify called it BAD."""
    from safetensors.numpy import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.zeros(3, np.float32)}, str(model / "model.safetensors"))
    for path in (model / "model.safetensors", model):
        code, out, err = run(capsys, command, path)
        assert code == 2 and "BAD" not in out, (out, err)
        assert "is a safetensors file, not a lean_store checkpoint" in err
        assert f"lean-store convert {path} OUT.h5" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_of_other_archives_say_what_they_are(
        capsys: pytest.CaptureFixture, tmp_path: Path, command: str) -> None:
    """An .npz, a zipped Zarr store and a directory DCP wrote: a usage error (2) naming what
    the path holds and the way to it, not an IntegrityError (1) or a BAD report. A file that is
    only named like a torch file (its suffix) is not called one: it is no checkpoint (1)."""
    import shutil

    np.savez(tmp_path / "arrays.npz", w=np.zeros(3))
    ls.save(STATE, tmp_path / "ck.zarr")
    archive = shutil.make_archive(str(tmp_path / "ck.zarr"), "zip", tmp_path / "ck.zarr")
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"\x80\x04")
    (dcp_dir / "__0_0.distcp").write_bytes(b"")
    for path, words in ((tmp_path / "arrays.npz", "numpy .npz archive"),
                        (archive, "zipped Zarr store"), (dcp_dir, "(DCP) directory")):
        code, out, err = run(capsys, command, path)
        assert code == 2 and "BAD" not in out, (out, err)
        assert "is not a lean_store checkpoint" in err and words in err, err
        assert "Traceback" not in err
    (tmp_path / "junk.bin").write_bytes(bytes(100))
    code, out, err = run(capsys, command, tmp_path / "junk.bin")
    assert "torch" not in err + out and "not a lean_store checkpoint" in err + out


def test_verify_ok_and_corrupt_chunk(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "big.h5"
    ls.save({"a": np.zeros(8, np.float32), "big": np.arange(8192, dtype=np.float32)}, path,
            chunk_bytes=4096)
    code, out, _ = run(capsys, "verify", path)
    assert code == 0 and out.startswith("OK")
    with h5py.File(path, "r") as f:
        info = f["big"].id.get_chunk_info(3)
    with open(path, "r+b") as f:
        f.seek(info.byte_offset + 10)
        byte = f.read(1)
        f.seek(info.byte_offset + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    code, out, _ = run(capsys, "verify", path)
    assert code == 1
    assert "BAD" in out and "'big'" in out and "chunk (3,)" in out and "'a'" not in out
    code, out, _ = run(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and doc["problems"][0]["tensor"] == "big"
    code, _, err = run(capsys, "verify", tmp_path / "none.zarr")
    assert code == 2 and "does not exist" in err


def test_diff_identical_and_different(capsys: pytest.CaptureFixture, tmp_path: Path,
                                      ckpt: Path) -> None:
    ls.save(STATE, tmp_path / "same.zarr")
    code, out, _ = run(capsys, "diff", ckpt, tmp_path / "same.zarr")
    assert code == 0 and "identical" in out
    other = dict(STATE)
    other["w"] = np.nextafter(STATE["w"], np.float32(np.inf))  # one ULP up (inf stays inf)
    other["extra"] = np.zeros(1, np.float32)
    ls.save(other, tmp_path / "other.h5")
    code, out, _ = run(capsys, "diff", ckpt, tmp_path / "other.h5")
    assert code == 1 and "DIFFERENT" in out and "'extra': unexpected tensor" in out
    code, out, _ = run(capsys, "diff", ckpt, tmp_path / "other.h5", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["identical"] is False
    w = next(t for t in doc["tensors"] if t["name"] == "w")
    assert w["identical"] is False and w["max_ulp"] == 1 and w["differing"] == 2
    assert w["max_abs"] == 2.0**-23  # one float32 ULP just below 2.0 in magnitude
    assert all(t["identical"] for t in doc["tensors"] if t["name"] != "w")
    code, _, err = run(capsys, "diff", ckpt, tmp_path / "nope.h5")
    assert code == 2 and "does not exist" in err


def test_diff_against_the_file_a_checkpoint_was_converted_from(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    source = {"w": np.array([[1.0, -2.0], [np.nan, 3.5]], np.float32),
              "n": np.array([-5, 7, 2**40], np.int64)}
    save_file(source, str(tmp_path / "m.safetensors"))
    assert run(capsys, "convert", tmp_path / "m.safetensors", tmp_path / "m.h5")[0] == 0
    code, out, _ = run(capsys, "diff", tmp_path / "m.safetensors", tmp_path / "m.h5")
    assert code == 0 and "identical" in out
    changed = dict(source, w=np.nextafter(source["w"], np.float32(np.inf)))
    ls.save(changed, tmp_path / "changed.zarr")
    code, out, _ = run(capsys, "diff", tmp_path / "changed.zarr", tmp_path / "m.safetensors",
                       "--json")
    doc = json.loads(out)
    w = next(t for t in doc["tensors"] if t["name"] == "w")
    assert code == 1 and w["differing"] == 3 and w["max_ulp"] == 1  # NaN stays NaN


def test_convert_and_refusal(capsys: pytest.CaptureFixture, tmp_path: Path, ckpt: Path) -> None:
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "a.zarr")
    assert code == 0 and "converted 5 tensors" in err
    code, _, _ = run(capsys, "diff", ckpt, tmp_path / "a.zarr")
    assert code == 0
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "a.zarr")
    assert code == 2 and "--force" in err
    code, _, _ = run(capsys, "convert", ckpt, tmp_path / "a.zarr", "--force", "--compression",
                     "zstd")
    assert code == 0
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "a.safetensors")
    assert code == 2 and "twelve" in err and "binary_5_6_15_ieee" in err
    assert "never casts" in err and "Traceback" not in err
    assert not (tmp_path / "a.safetensors").exists()
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "a.npz")
    assert code == 2 and "suffix" in err


def test_export_json_and_import(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    words = np.array([0x3F80, 0xC020, 0x7FC0, 0x0001], np.uint16)
    ls.save({"x": ls.Encoded(words, "bfloat16"), "y": ls.Encoded(words[:2], "bfloat16")},
            tmp_path / "s.h5")
    code, out, _ = run(capsys, "export", tmp_path / "s.h5", "--json")
    assert code == 0
    assert json.loads(out) == {
        "format": "torchlean_state_binary_8_7_127_ieee_v1",
        "state": [{"shape": [4], "values": [0x3F80, 0xC020, 0x7FC0, 1]},
                  {"shape": [2], "values": [0x3F80, 0xC020]}],
    }
    code, _, _ = run(capsys, "export", tmp_path / "s.h5", "--json", "-o", tmp_path / "s.json")
    assert code == 0 and (tmp_path / "s.json").read_text() == out.rstrip("\n")
    code, _, _ = run(capsys, "import", tmp_path / "s.json", tmp_path / "t.zarr")
    assert code == 0
    with ls.open(tmp_path / "t.zarr") as ck:
        assert ck.layout.names() == ["0", "1"]
        assert ck["0"].format == ls.formats.get("bfloat16")
        assert ck["0"].bits().tolist() == words.tolist()
    code, _, err = run(capsys, "export", tmp_path / "s.h5")
    assert code == 2 and "--json" in err


def test_export_refuses_mixed_formats(capsys: pytest.CaptureFixture, ckpt: Path) -> None:
    code, out, err = run(capsys, "export", ckpt, "--json")
    assert code == 2 and out == "" and "int64 has no TorchLean tag" in err


def test_import_bad_json_is_a_problem(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"format": "torchlean_state_float32_bits_v1", '
                                       '"state": [{"shape": [2], "values": [1]}]}')
    code, _, err = run(capsys, "import", tmp_path / "bad.json", tmp_path / "o.h5")
    assert code == 1 and "values has 1" in err and not (tmp_path / "o.h5").exists()


def test_console_script_and_module_entry_points(tmp_path: Path, ckpt: Path) -> None:
    env = dict(os.environ, COLUMNS="200")
    script = Path(sys.executable).with_name("lean-store")
    result = subprocess.run([str(script), "verify", str(ckpt)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("OK")
    result = subprocess.run([sys.executable, "-m", "lean_store", "inspect", str(tmp_path / "x")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_stats_mean_of_huge_finite_values_is_finite(capsys: pytest.CaptureFixture,
                                                    tmp_path: Path) -> None:
    x = np.array([1.7e308, 1.7e308, -1e308, 5.0, np.nan])
    ls.save({"x": x, "e": np.zeros((0, 3), np.float32)}, tmp_path / "big.zarr")
    code, out, _ = run(capsys, "inspect", tmp_path / "big.zarr", "--stats", "--json")
    stats = {t["name"]: t["stats"] for t in json.loads(out)["tensors"]}
    assert code == 0 and stats["x"]["mean"] == 6e307 and stats["x"]["nan"] == 1
    assert stats["e"]["count"] == 0 and stats["e"]["mean"] is None


@pytest.mark.parametrize("argv", [
    ["diff", "{a}", "{b}"], ["diff", "{a}", "{b}", "--json"], ["verify", "{a}"],
    ["verify", "{a}", "--json"], ["inspect", "{a}"], ["inspect", "{a}", "--json"],
])
def test_a_closed_output_pipe_exits_141_quietly(tmp_path: Path, argv: list[str]) -> None:
    """``lean-store diff a b | head`` with the reader gone: before, rich's console exited 1
    ("they differ", for identical checkpoints) and plain writes 2 with "Broken pipe"; now
    every command exits 141 (128 + SIGPIPE, what the shell reports for such a command) and
    prints nothing."""
    state = {f"t{i}": np.arange(50, dtype=np.float32) + i for i in range(400)}
    ls.save(state, tmp_path / "a.h5")
    ls.save(state, tmp_path / "b.zarr")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    try:
        args = [a.format(a=tmp_path / "a.h5", b=tmp_path / "b.zarr") for a in argv]
        result = subprocess.run([sys.executable, "-m", "lean_store", *args], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert result.stderr == ""
