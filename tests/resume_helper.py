"""A tiny training run for the exact-resume tests; also run as a script in a fresh process.

    python tests/resume_helper.py STEPS OPTIMIZER CHECKPOINT OUT [OPTIMIZER CHECKPOINT OUT ...]

loads each CHECKPOINT into a freshly built run of OPTIMIZER, trains STEPS more steps and saves
the result to OUT.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch

import lean_store as ls

BATCH = 4
SAMPLES = 24  # 6 batches per epoch: a resume at step 5 lands mid-epoch


class ResumableLoader:
    """A shuffling DataLoader whose position (epoch, batch index, and the generator state at
    the start of the epoch) can be saved and restored."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, shuffle=True, generator=self.generator
        )
        self.epoch = 0
        self.index = 0
        self._epoch_state = self.generator.get_state()
        self._it: Any = None

    def next(self) -> Any:
        if self._it is None:
            self._epoch_state = self.generator.get_state()
            self._it = iter(self.loader)
            for _ in range(self.index):
                next(self._it)
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.index, self._it = self.epoch + 1, 0, None
            return self.next()
        self.index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "generator": self._epoch_state.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self.generator.set_state(state["generator"])
        self._it = None


def build(kind: str) -> dict[str, Any]:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
    )
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6), torch.randn(SAMPLES, 2))
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    elif kind == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=2e-3, amsgrad=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7)
    elif kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, nesterov=True)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    else:
        raise ValueError(kind)
    return {"model": model, "optimizer": opt, "scheduler": sched,
            "data": ResumableLoader(data, seed=1)}


def train(run: dict[str, Any], steps: int) -> None:
    model, opt, sched, loader = run["model"], run["optimizer"], run["scheduler"], run["data"]
    model.train()
    for _ in range(steps):
        x, y = loader.next()
        noise = np.random.standard_normal() * 1e-3 + random.random() * 1e-3  # global RNGs too
        loss = ((model(x) - y) ** 2).mean() + noise
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def save(run: dict[str, Any], path: Any, step: int) -> None:
    ls.save_training(path, step=step, **run)


def main(argv: list[str]) -> None:
    steps, jobs = int(argv[1]), argv[2:]
    for i in range(0, len(jobs), 3):
        kind, checkpoint, out = jobs[i : i + 3]
        run = build(kind)
        info = ls.load_training(checkpoint, **run)
        train(run, steps)
        save(run, out, info.step + steps)


if __name__ == "__main__":
    main(sys.argv)
