"""The Lightning CheckpointIO plugin: a Trainer.fit resumed from a lean_store checkpoint ends
bit-identical to an uninterrupted fit; the checkpoint dict round-trips exactly without pickle;
objects that are neither plain data nor tensors are refused with the key named."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
from torch_optional import require_torch

torch = require_torch()  # lightning needs torch
import lightning.pytorch as pl  # noqa: E402

import lean_store as ls  # noqa: E402
from lean_store.interop.lightning import CheckpointIO  # noqa: E402


@pytest.fixture(autouse=True)
def restore_torch_globals(monkeypatch):
    """``Trainer(deterministic=True)`` switches torch's deterministic mode on for the whole
    process (and sets CUBLAS_WORKSPACE_CONFIG); put everything back for the other tests."""
    import os

    mode = (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())
    fill = torch.utils.deterministic.fill_uninitialized_memory
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    if "CUBLAS_WORKSPACE_CONFIG" in os.environ:  # monkeypatch restores it (or its absence)
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ["CUBLAS_WORKSPACE_CONFIG"])
    else:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


class Tiny(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 1))
        self.norm = torch.nn.BatchNorm1d(4)  # buffers too
        self.extra: dict = {}

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(self.norm(x)), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01, betas=(0.9, 0.99))
        return {"optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    def on_save_checkpoint(self, checkpoint):
        checkpoint.update(self.extra)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(epochs: int, root: Path, io: CheckpointIO | None = None, **kw) -> pl.Trainer:
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1)]
    return pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False, deterministic=True,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        plugins=[io or CheckpointIO()], default_root_dir=root, **kw,
    )


def bits(model: torch.nn.Module) -> dict[str, bytes]:
    return {k: v.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
            for k, v in model.state_dict().items()}


def test_resumed_fit_is_bit_identical_to_an_uninterrupted_one(tmp_path: Path) -> None:
    io = CheckpointIO()  # HDF5; the Zarr backend's round trip is tested below
    whole = Tiny(seed=1)
    trainer(4, tmp_path / "whole", io).fit(whole, data())

    first = Tiny(seed=1)
    trainer(2, tmp_path / "run", io).fit(first, data())
    ckpt = tmp_path / "run" / "epoch=1-step=8.ckpt"
    assert h5py.is_hdf5(ckpt)
    with ls.open(ckpt) as ck:  # an ordinary lean_store checkpoint, tensors as datasets
        assert "state_dict/net.0.weight" in ck.layout
        assert "optimizer_states/0/state/0/exp_avg" in ck.layout
    assert ls.verify(ckpt).ok

    resumed = Tiny(seed=2)  # other initial weights: everything must come from the checkpoint
    assert bits(resumed) != bits(first)
    t = trainer(4, tmp_path / "run", io)
    t.fit(resumed, data(), ckpt_path=ckpt)
    assert t.current_epoch == 4 and t.global_step == 16
    assert bits(resumed) == bits(whole)
    lr = t.optimizers[0].param_groups[0]["lr"]
    assert lr == whole.trainer.optimizers[0].param_groups[0]["lr"] == 0.005  # StepLR restored


def test_checkpoint_dict_round_trips_exactly(tmp_path: Path, backend: str) -> None:
    checkpoint = {
        "epoch": 3, "global_step": 2**60, "pytorch-lightning_version": "2.6.6",
        "state_dict": {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
                       "n": torch.tensor(5)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(4.0)}},
                              "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99),
                                                "params": [0]}]}],
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None,
                                                           "best_k_models": {}}},
        "hyper_parameters": {"nan": math.nan, "arr": np.arange(3, dtype=np.int16)},
    }
    io = CheckpointIO(backend=backend)
    path = tmp_path / "sub" / "epoch=3-step=9.ckpt"
    io.save_checkpoint(checkpoint, path)
    assert path.is_dir() == (backend == "zarr")
    got = io.load_checkpoint(path)
    assert list(got) == list(checkpoint)
    assert got["global_step"] == 2**60
    assert got["optimizer_states"][0]["state"] == {0: {"step": torch.tensor(4.0)}}
    assert got["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert got["state_dict"]["w"].dtype == torch.bfloat16
    assert torch.equal(got["state_dict"]["w"], checkpoint["state_dict"]["w"])
    assert got["callbacks"] == checkpoint["callbacks"]
    assert math.isnan(got["hyper_parameters"]["nan"])
    assert got["hyper_parameters"]["arr"].dtype == np.int16
    meta = ls.open(path).root_attrs["lightning"]
    assert "pickle" not in meta and "epoch" in meta
    assert io.load_checkpoint(path, map_location="cpu")["state_dict"]["n"].device.type == "cpu"

    io.remove_checkpoint(path)
    assert not path.exists()
    io.remove_checkpoint(path)  # already gone: not an error


def test_objects_that_need_pickle_are_refused_with_their_key(tmp_path: Path) -> None:
    model = Tiny(seed=1)
    model.extra = {"loops_extra": {"sampler": object()}}
    t = trainer(1, tmp_path)
    with pytest.raises(ls.CheckpointError, match=r"loops_extra/sampler: cannot store a object"):
        t.fit(model, data())
    assert not list(tmp_path.glob("*.ckpt"))  # nothing half-written


def test_a_plain_lean_store_file_is_not_read_as_a_lightning_checkpoint(tmp_path: Path) -> None:
    ls.save({"w": np.zeros(3, np.float32)}, tmp_path / "w.h5")
    with pytest.raises(ls.CheckpointError, match="not a Lightning one"):
        CheckpointIO().load_checkpoint(tmp_path / "w.h5")
    with pytest.raises(ls.CheckpointError, match="unknown backend"):
        CheckpointIO(backend="pt")


def test_a_torch_ckpt_converted_by_the_command_line_resumes_through_the_plugin(
        tmp_path: Path) -> None:
    """A run checkpointed by Lightning's own (torch.save) plugin moves to lean_store with
    ``lean-store convert epoch=1-step=8.ckpt run.h5``, and the fit resumed from the converted
    file through this plugin ends bit-identical to an uninterrupted one."""
    from lean_store.cli import main

    whole = Tiny(seed=1)
    trainer(4, tmp_path / "whole").fit(whole, data())

    first = Tiny(seed=1)
    pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, deterministic=True,
               enable_progress_bar=False, enable_model_summary=False,
               callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "torch")],
               default_root_dir=tmp_path / "torch").fit(first, data())
    pt = tmp_path / "torch" / "epoch=1-step=8.ckpt"
    assert not h5py.is_hdf5(pt)  # torch.save's zip
    assert main(["convert", str(pt), str(tmp_path / "run.h5")]) == 0
    assert ls.verify(tmp_path / "run.h5").ok

    resumed = Tiny(seed=2)
    t = trainer(4, tmp_path / "resumed")
    t.fit(resumed, data(), ckpt_path=tmp_path / "run.h5")
    assert t.current_epoch == 4 and t.global_step == 16
    assert bits(resumed) == bits(whole)


class Monitored(Tiny):
    def training_step(self, batch, index):
        loss = super().training_step(batch, index)
        self.log("train_loss", loss)
        return loss


def test_a_monitored_model_checkpoint_saves_and_resumes(tmp_path: Path, backend: str) -> None:
    """ModelCheckpoint(monitor=...), the usual Lightning setup, keeps its state under a key
    like "ModelCheckpoint{'monitor': 'train_loss', 'mode': 'min', ...}" with tensors in it;
    their key paths escape to node names over 255 bytes, and every save was refused
    ("unsafe tensor names"). They are stored under shortened names now and resume exactly."""
    io = CheckpointIO(backend=backend)

    def callbacks() -> list:
        return [pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "run", monitor="train_loss",
                                             save_top_k=2, save_last=True)]

    first = Monitored(seed=1)
    t = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks(),
                   plugins=[io], default_root_dir=tmp_path)
    t.fit(first, data())
    last = tmp_path / "run" / "last.ckpt"
    assert ls.verify(last).ok
    with ls.open(last) as ck:
        names = [n for n in ck.layout.names() if n.startswith("callbacks/")]
    assert any(n.endswith("/best_model_score") for n in names)
    assert any("~" in n for n in names)  # a best_k_models path, shortened
    checkpoint = io.load_checkpoint(last)
    state = next(v for k, v in checkpoint["callbacks"].items() if "'train_loss'" in k)
    assert torch.equal(state["best_model_score"],
                       t.checkpoint_callback.best_model_score.detach().cpu())
    assert len(state["best_k_models"]) == 2

    resumed = Monitored(seed=2)
    t2 = pl.Trainer(max_epochs=4, accelerator="cpu", devices=1, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    callbacks=callbacks(), plugins=[io], default_root_dir=tmp_path)
    t2.fit(resumed, data(), ckpt_path=last)
    assert t2.current_epoch == 4
    assert t2.checkpoint_callback.best_model_score is not None
