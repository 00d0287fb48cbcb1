"""The README's Python examples run as written (on a small model with the names they use)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from torch_optional import require_torch

import lean_store as ls

torch = require_torch()

README = Path(__file__).resolve().parents[2] / "README.md"


class Sampler:
    """A data position with state_dict()/load_state_dict(), as the README's `sampler`."""

    def __init__(self) -> None:
        self.epoch, self.index = 3, 17

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


def _namespace() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(8, 32))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {"model": model, "opt": opt, "sched": sched, "sampler": Sampler(), "np": np}


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text("utf-8"), flags=re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    ls.save({"w": np.zeros(2, np.float32)}, tmp_path / "ckpt.h5")  # for ls.verify("ckpt.h5")
    namespace = _namespace()
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert ls.load_state("run.h5")["fc.weight"].shape == (32, 8)
    assert namespace["report"].ok
    namespace["handle"].wait()
    assert namespace["info"].step == 100
