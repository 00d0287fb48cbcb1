"""A Hugging Face sharded safetensors checkpoint (``model.safetensors.index.json`` and the shard
files beside it, as ``save_pretrained`` writes a model over its shard size) converts as one
state: ``lean-store convert <directory or index> out.h5``. Every bit is kept; the index and
its files must agree exactly, and shard names must stay in the index's directory, else one
error lists every difference before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import lean_store as ls
from lean_store.cli import main
from lean_store.interop import sharded_index
from lean_store.interop.convert import convert

SHARDS = {
    "model-00001-of-00003.safetensors": ["embed.weight", "layers.0.w", "layers.0.b"],
    "model-00002-of-00003.safetensors": ["layers.1.w", "layers.1.b", "steps"],
    "model-00003-of-00003.safetensors": ["norm.weight", "lm_head.weight"],
}


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "embed.weight": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "layers.0.w": rng.standard_normal((8, 8)).astype(np.float16),
        "layers.0.b": rng.standard_normal(8).astype(np.float32),
        "layers.1.w": rng.standard_normal((8, 8)).astype(np.float16),
        "layers.1.b": np.array([np.nan, -0.0, np.inf, 1e-45, 0, 1, 2, 3], np.float32),
        "steps": np.array([7], np.int64),
        "norm.weight": np.ones(8, np.float32),
        "lm_head.weight": rng.standard_normal((4, 8)),
    }


def _write(directory: Path, shards: dict[str, list[str]] | None = None,
           weight_map: dict[str, str] | None = None) -> Path:
    state = _state()
    directory.mkdir(exist_ok=True)
    shards = SHARDS if shards is None else shards
    for file, names in shards.items():
        save_file({n: state[n] for n in names}, str(directory / file), metadata={"format": "pt"})
    if weight_map is None:
        weight_map = {n: f for f, names in shards.items() for n in names}
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0},
                                 "weight_map": dict(sorted(weight_map.items()))}))
    return index


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("suffix", [".h5", ".zarr", ".safetensors"])
@pytest.mark.parametrize("by", ["directory", "index"])
def test_a_sharded_checkpoint_converts_bit_for_bit(tmp_path, suffix, by) -> None:
    index = _write(tmp_path / "hf")
    out = tmp_path / f"out{suffix}"
    layout = convert(index.parent if by == "directory" else index, out)
    state = _state()
    names = [e.name for e in layout]  # the shards' order (each file in its data order)
    assert [set(names[:3]), set(names[3:6]), set(names[6:])] == [set(v) for v in SHARDS.values()]
    got = load_file(str(out)) if suffix == ".safetensors" else ls.load_state(out)
    for name, want in state.items():
        value = got[name]
        value = value.bits if isinstance(value, ls.Encoded) else value
        assert _bits(value) == _bits(want), name


def test_the_command_line_converts_a_model_directory(tmp_path, capsys) -> None:
    index = _write(tmp_path / "hf")
    assert main(["convert", str(index.parent), str(tmp_path / "m.h5")]) == 0
    assert "converted 8 tensors" in capsys.readouterr().err
    (index.parent / "model-00002-of-00003.safetensors").unlink()
    assert main(["convert", str(index.parent), str(tmp_path / "n.h5")]) != 0
    err = capsys.readouterr().err
    assert "model-00002-of-00003.safetensors" in err and "Traceback" not in err
    assert not (tmp_path / "n.h5").exists()


def test_an_index_and_files_that_disagree_are_refused_with_every_difference(tmp_path) -> None:
    shards = {"a.safetensors": ["embed.weight", "layers.0.w"],
              "b.safetensors": ["layers.0.w", "steps"]}  # layers.0.w in both files
    weight_map = {"embed.weight": "a.safetensors", "layers.0.w": "a.safetensors",
                  "steps": "b.safetensors", "norm.weight": "b.safetensors"}  # not in b
    index = _write(tmp_path / "hf", shards, weight_map)
    with pytest.raises(ls.IntegrityError) as info:
        convert(index, tmp_path / "out.h5")
    message = str(info.value)
    assert "'norm.weight' is mapped to 'b.safetensors', which does not hold it" in message
    assert "'b.safetensors' holds 'layers.0.w', which the index maps to 'a.safetensors'" \
        in message
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("shard", ["../model.safetensors", "/tmp/model.safetensors",
                                   "sub/model.safetensors", "..", ""])
def test_a_shard_outside_the_index_directory_is_refused(tmp_path, shard) -> None:
    index = _write(tmp_path / "hf", {"model.safetensors": ["steps"]},
                   {"steps": shard})
    (tmp_path / "model.safetensors").write_bytes((index.parent / "model.safetensors")
                                                 .read_bytes())
    with pytest.raises(ls.UnsafeFileError, match="not a file name in the index's directory"):
        convert(index, tmp_path / "out.h5")


def test_malformed_and_ambiguous_indexes_are_refused(tmp_path, monkeypatch) -> None:
    index = _write(tmp_path / "hf")
    index.write_text('{"weight_map": {"x": 3}}')
    with pytest.raises(ls.IntegrityError, match="weight_map"):
        convert(index, tmp_path / "out.h5")
    index.write_text("{not json")
    with pytest.raises(ls.IntegrityError, match="not a valid JSON"):
        convert(index, tmp_path / "out.h5")
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
    monkeypatch.setattr(sharded_index, "MAX_INDEX_BYTES", 16)
    with pytest.raises(ls.UnsafeFileError, match="too large"):
        convert(index, tmp_path / "out.h5")
    monkeypatch.undo()
    (index.parent / "other.safetensors.index.json").write_text(index.read_text())
    with pytest.raises(ls.CheckpointError, match="2 safetensors indexes"):
        convert(index.parent, tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists()


def _as_hub_cache(directory: Path, root: Path) -> Path:
    """The Hugging Face hub cache's layout: ``snapshots/<revision>/<file>`` are symbolic
    links to ``blobs/<hash>``."""
    blobs = root / "blobs"
    snapshot = root / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(directory.iterdir())):
        blob = blobs / f"blob{i}"
        f.rename(blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


def test_a_model_in_the_hub_cache_converts_through_its_symlinks(tmp_path) -> None:
    _write(tmp_path / "hf")
    snapshot = _as_hub_cache(tmp_path / "hf", tmp_path / "models--org--name")
    convert(snapshot, tmp_path / "out.h5")
    got = ls.load_state(tmp_path / "out.h5")
    for name, want in _state().items():
        value = got[name]
        assert _bits(value.bits if isinstance(value, ls.Encoded) else value) == _bits(want)


def test_a_model_directory_of_one_weights_file_converts(tmp_path, capsys) -> None:
    """Most models (below transformers' 5 GB shard size) are one model.safetensors and no
    index; a Trainer checkpoint directory holds it beside optimizer and argument files."""
    model = tmp_path / "checkpoint-500"
    model.mkdir()
    state = _state()
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    (model / "config.json").write_text("{}")
    (model / "training_args.bin").write_bytes(b"\x80\x04not a state")  # a pickle: never read
    (model / "trainer_state.json").write_text("{}")
    assert main(["convert", str(model), str(tmp_path / "m.h5")]) == 0
    assert main(["diff", str(tmp_path / "m.h5"), str(model)]) == 0
    assert "identical" in capsys.readouterr().out
    snapshot = _as_hub_cache(model, tmp_path / "cache")
    convert(snapshot, tmp_path / "c.zarr")
    got = ls.load_state(tmp_path / "c.zarr")
    assert _bits(got["layers.1.b"]) == _bits(state["layers.1.b"])
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"x": np.ones(2, np.float32)}, str(two / name))
    with pytest.raises(ls.CheckpointError, match="2 safetensors files and no index"):
        convert(two, tmp_path / "t.h5")
