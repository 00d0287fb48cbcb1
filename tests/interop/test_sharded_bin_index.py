"""A Hugging Face sharded checkpoint of torch ``.bin`` files (``pytorch_model.bin.index.json``
and ``pytorch_model-0000K-of-0000N.bin``: what transformers wrote before safetensors, and what
many published models still ship) converts and diffs as one state, each shard read with
``torch.load(weights_only=True)``. Before, the directory was taken for a Zarr store ("not a
readable Zarr v3 group") and the index for a TorchLean JSON state."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402
from lean_store.cli import main  # noqa: E402
from lean_store.interop.convert import convert  # noqa: E402

SHARDS = {
    "pytorch_model-00001-of-00002.bin": ["embed.weight", "layers.0.w", "layers.0.b"],
    "pytorch_model-00002-of-00002.bin": ["layers.1.b", "steps", "scale"],
}


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(16, 8, generator=gen).to(torch.bfloat16),
        "layers.0.w": torch.randn(8, 8, generator=gen).to(torch.float16),
        "layers.0.b": torch.randn(8, generator=gen),
        "layers.1.b": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, 0, 1, 2, 3]),
        "steps": torch.tensor(7, dtype=torch.int64),
        "scale": torch.randn(3, 2, generator=gen, dtype=torch.float64),
    }


def _write(directory: Path, shards: dict[str, list[str]] = SHARDS,
           weight_map: dict[str, str] | None = None) -> Path:
    state = _state()
    directory.mkdir(exist_ok=True)
    for file, names in shards.items():
        torch.save({n: state[n] for n in names}, directory / file)
    if weight_map is None:
        weight_map = {n: f for f, names in shards.items() for n in names}
    index = directory / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def _bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("suffix", [".h5", ".zarr", ".safetensors"])
@pytest.mark.parametrize("by", ["directory", "index"])
def test_bin_shards_convert_bit_for_bit(tmp_path, suffix, by) -> None:
    index = _write(tmp_path / "hf")
    out = tmp_path / f"out{suffix}"
    layout = convert(index.parent if by == "directory" else index, out)
    names = [e.name for e in layout]  # the shards' order, each file in its own order
    assert names == [n for names in SHARDS.values() for n in names]
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        got = load_file(str(out))
    else:
        got = ls.load_state(out, like=_state())
    for name, want in _state().items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert _bits(got[name]) == _bits(want), name


def test_the_command_line_converts_and_diffs_a_bin_model_directory(tmp_path, capsys) -> None:
    index = _write(tmp_path / "hf")
    assert main(["convert", str(index.parent), str(tmp_path / "m.h5")]) == 0
    assert "converted 6 tensors" in capsys.readouterr().err
    assert main(["diff", str(tmp_path / "m.h5"), str(index.parent)]) == 0
    assert "identical" in capsys.readouterr().out
    (index.parent / "pytorch_model-00002-of-00002.bin").unlink()
    assert main(["convert", str(index.parent), str(tmp_path / "n.h5")]) == 1
    err = capsys.readouterr().err
    assert "pytorch_model-00002-of-00002.bin" in err and "Traceback" not in err
    assert not (tmp_path / "n.h5").exists()


def test_a_directory_with_both_kinds_of_index_is_read_through_safetensors(tmp_path) -> None:
    from safetensors.torch import save_file

    index = _write(tmp_path / "hf")
    safe = {n: v + 1 if v.is_floating_point() else v for n, v in _state().items()}
    save_file({n: v.contiguous() for n, v in safe.items()}, str(index.parent / "model.safetensors"))
    (index.parent / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model.safetensors" for n in safe}}))
    convert(index.parent, tmp_path / "dir.h5")
    convert(index, tmp_path / "bin.h5")  # the .bin index, named
    by_dir = ls.load_state(tmp_path / "dir.h5", like=_state())
    by_bin = ls.load_state(tmp_path / "bin.h5", like=_state())
    assert _bits(by_dir["layers.0.b"]) == _bits(safe["layers.0.b"])
    assert _bits(by_bin["layers.0.b"]) == _bits(_state()["layers.0.b"])
    with pytest.raises(ls.CheckpointError, match="index of torch shards, not of safetensors"):
        convert(index, tmp_path / "x.h5", src_format="safetensors")


def test_bin_shards_and_index_that_disagree_are_refused_with_every_difference(tmp_path) -> None:
    shards = {"a.bin": ["embed.weight", "layers.0.w"], "b.bin": ["layers.0.w", "steps"]}
    weight_map = {"embed.weight": "a.bin", "layers.0.w": "a.bin", "steps": "b.bin",
                  "scale": "b.bin"}
    index = _write(tmp_path / "hf", shards, weight_map)
    with pytest.raises(ls.IntegrityError) as info:
        convert(index, tmp_path / "out.h5")
    message = str(info.value)
    assert "'scale' is mapped to 'b.bin', which does not hold it" in message
    assert "'b.bin' holds 'layers.0.w', which the index maps to 'a.bin'" in message
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_bin_shard_holding_an_arbitrary_pickle_is_refused_unloaded(tmp_path) -> None:
    index = _write(tmp_path / "hf")

    class Payload:
        def __reduce__(self):  # would run on an unrestricted torch.load
            return (Path(tmp_path / "pwned").write_text, ("x",))

    (index.parent / "pytorch_model-00002-of-00002.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ls.IntegrityError, match="weights_only"):
        convert(index.parent, tmp_path / "out.h5")
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "out.h5").exists()


def test_a_directory_of_one_pytorch_model_bin_converts(tmp_path) -> None:
    model = tmp_path / "old-model"
    model.mkdir()
    torch.save(_state(), model / "pytorch_model.bin")
    (model / "training_args.bin").write_bytes(b"\x80\x04not a state")  # never read
    convert(model, tmp_path / "m.h5")
    got = ls.load_state(tmp_path / "m.h5", like=_state())
    assert all(_bits(got[n]) == _bits(v) for n, v in _state().items())
