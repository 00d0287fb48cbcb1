"""``lean-store diff`` compares a checkpoint's plain data too: the step, trainer extras,
optimizer hyperparameters, scheduler and RNG of a training checkpoint, the epochs and
hyperparameters of a checkpoint dict, DCP's non-tensor items. Two training checkpoints of
the same weights at different steps were reported "identical" (exit 0): only tensors were
compared."""

from __future__ import annotations

import json

import pytest
from torch_optional import require_torch

torch = require_torch()

import lean_store as ls  # noqa: E402
from lean_store.cli import main  # noqa: E402
from lean_store.inspection.diff import diff  # noqa: E402
from lean_store.inspection.plain_data import metadata_diffs  # noqa: E402


def _training(path, step, epoch, lr=0.1):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ls.save_training(path, model=model, optimizer=opt, step=step, extra={"epoch": epoch},
                     rng=False)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_training_checkpoints_that_differ_only_in_plain_data_differ(tmp_path, suffix,
                                                                     capsys) -> None:
    a, b, c = (tmp_path / f"{n}{suffix}" for n in "abc")
    _training(a, 1, 1)
    _training(b, 2, 9, lr=0.5)
    _training(c, 1, 1)
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "metadata: training/step: 1 != 2" in out
    assert "metadata: training/extra/epoch: 1 != 9" in out
    assert "lr" in out and "DIFFERENT" in out
    assert main(["diff", str(a), str(c), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"] == []
    with ls.open(a) as x, ls.open(b) as y:
        assert not diff(x, y).identical


def test_a_torch_checkpoint_dict_against_its_conversion_and_another_epoch(tmp_path,
                                                                          capsys) -> None:
    state = {"w": torch.arange(4.0)}
    torch.save({"model": state, "epoch": 1}, tmp_path / "e1.pt")
    torch.save({"model": state, "epoch": 2}, tmp_path / "e2.pt")
    assert main(["convert", str(tmp_path / "e1.pt"), str(tmp_path / "e1.h5")]) == 0
    assert main(["diff", str(tmp_path / "e1.pt"), str(tmp_path / "e1.h5")]) == 0
    assert main(["diff", str(tmp_path / "e1.h5"), str(tmp_path / "e2.pt")]) == 1
    assert "metadata: lightning/epoch: 1 != 2" in capsys.readouterr().out


def test_metadata_differences_name_their_paths() -> None:
    a = {"step": 1, "opt": {"groups": [{"lr": 0.1}]}, "gone": 3}
    b = {"step": 1, "opt": {"groups": [{"lr": 0.2}]}, "new": [1, 2]}
    assert metadata_diffs(a, b) == [
        "opt/groups/0/lr: 0.1 != 0.2", "gone: only in the first (3)",
        "new: only in the second ([1, 2])"]
    assert metadata_diffs({"x": 1}, {"x": 1.0}) == ["x: 1 != 1.0"]
    many = metadata_diffs({str(i): i for i in range(30)}, {str(i): -i for i in range(1, 31)})
    assert len(many) == 21 and many[-1].startswith("... and")


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_training_checkpoint_converts_between_backends_whole(tmp_path, suffix, capsys) -> None:
    """``convert train.h5 train.zarr`` wrote a checkpoint of kind "training" without its
    metadata, which load_training then refused ("malformed training_format_version"); the
    plain data is carried now, and formats of tensors alone refuse to drop it unless asked."""
    other = ".zarr" if suffix == ".h5" else ".h5"
    src, dst = tmp_path / f"t{suffix}", tmp_path / f"t{other}"
    _training(src, 7, 3)
    assert main(["convert", str(src), str(dst)]) == 0
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.9)
    info = ls.load_training(dst, model=model, optimizer=opt, rng=False)
    assert info.step == 7 and info.extra == {"epoch": 3}
    assert opt.param_groups[0]["lr"] == 0.1
    assert main(["diff", str(src), str(dst)]) == 0
    capsys.readouterr()
    for out in ("t.safetensors", "t.pt"):
        assert main(["convert", str(src), str(tmp_path / out)]) == 2
        assert "--tensors-only" in capsys.readouterr().err
        assert not (tmp_path / out).exists()
        assert main(["convert", str(src), str(tmp_path / out), "--tensors-only"]) == 0
    from safetensors.numpy import load_file

    assert "model/weight" in load_file(str(tmp_path / "t.safetensors"))


def test_dcp_non_tensor_items_survive_a_conversion(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    import lean_store.interop.dcp as lsd
    from lean_store.interop.convert import convert

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(3), "step": 4}, storage_writer=lsd.StorageWriter(
            tmp_path / "d.h5"), no_dist=True)
    convert(tmp_path / "d.h5", tmp_path / "d.zarr")
    state = {"w": torch.zeros(3), "step": 0}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, storage_reader=lsd.StorageReader(tmp_path / "d.zarr"), no_dist=True)
    assert state["step"] == 4 and torch.equal(state["w"], torch.ones(3))
    with pytest.raises(ls.FormatError, match="DCP's non-tensor items"):
        convert(tmp_path / "d.h5", tmp_path / "d.safetensors")


def test_inspect_shows_the_plain_data(tmp_path, capsys) -> None:
    _training(tmp_path / "t.h5", 7, 3)
    assert main(["inspect", str(tmp_path / "t.h5")]) == 0
    out = capsys.readouterr().out
    assert "training: step=7, model=torch.nn.modules.linear.Linear" in out
    assert "optimizer=torch.optim.sgd.SGD" in out
    assert main(["inspect", str(tmp_path / "t.h5"), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["plain_data"]
    assert plain["training"]["step"] == 7 and plain["training"]["extra"] == {"epoch": 3}
    ls.save({"w": torch.ones(2)}, tmp_path / "w.h5")
    assert main(["inspect", str(tmp_path / "w.h5"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plain_data"] == {}
