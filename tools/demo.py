"""lean_store demo: train a small model, checkpoint it to HDF5 and Zarr, restore, compare.

Run with ``./dev demo`` (creates .venv on first use). Writes to ./demo_out/.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import lean_store as ls


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 3),
    )


def train(model: torch.nn.Module, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(512, 16, generator=gen)
    labels = (inputs[:, :3].sum(dim=1, keepdim=True) > 0).long().squeeze(1) + (
        inputs[:, 3] > 1
    ).long()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for step in range(steps):
        idx = torch.randint(0, 512, (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(inputs[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"  step {step:3d}  loss {loss.item():.4f}")
    return losses


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(
            torch.equal(
                a.reshape(-1).contiguous().view(torch.uint8),
                b.reshape(-1).contiguous().view(torch.uint8),
            )
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    args = parser.parse_args()
    console = Console()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)

    torch.manual_seed(0)
    model = make_model()
    # A half-precision buffer too, to show exact bits for non-float32 state.
    model.register_buffer("ema_bf16", torch.randn(64, dtype=torch.bfloat16))
    console.print(f"[bold]1. Training a small model for {args.steps} steps[/bold]")
    train(model, args.steps, seed=1)
    model.eval()
    probe = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    expected = model(probe)

    table = Table(title="2-3. Save, restore into a fresh model, compare")
    for col in ("backend", "path", "tensors", "bytes", "params bit-identical", "next prediction"):
        table.add_column(col)
    for suffix in (".h5", ".zarr"):
        path = args.out / f"model{suffix}"
        layout = ls.save(model, path)
        fresh = make_model()
        fresh.register_buffer("ema_bf16", torch.zeros(64, dtype=torch.bfloat16))
        ls.load(fresh, path)
        fresh.eval()
        same = all(
            bits_equal(a, b)
            for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
        )
        pred_same = bits_equal(fresh(probe), expected)
        size = sum(f.stat().st_size for f in [path] + list(path.rglob("*")) if f.is_file())
        table.add_row(
            suffix[1:],
            str(path),
            str(len(layout)),
            f"{size:,}",
            "yes" if same else "NO",
            "identical" if pred_same else "DIFFERENT",
        )
        if not (same and pred_same):
            raise SystemExit(f"restore from {path} was not exact")
    console.print(table)

    console.print("[bold]4. Looking inside[/bold]")
    with ls.open(args.out / "model.h5") as ck:
        console.print(f"  {ck}")
        weight = ck["0.weight"]
        console.print(f"  0.weight: {weight.format.tag} {weight.shape}, chunks {weight.chunks}")
        console.print(f"  0.weight[0, :4] = {np.asarray(weight[0, :4])}")
        console.print(f"  ema_bf16[:3] = {ck['ema_bf16'][:3]}")
    h5dump = shutil.which("h5dump")
    if h5dump:
        out = subprocess.run(
            [
                h5dump,
                "-A",
                "0",
                "-d",
                "/ema_bf16",
                "-s",
                "0",
                "-c",
                "3",
                str(args.out / "model.h5"),
            ],
            capture_output=True,
            text=True,
        )
        console.print("  h5dump -A 0 -d /ema_bf16 -s 0 -c 3 (HDF5's own tools read it too):")
        for line in out.stdout.splitlines():
            if "DATATYPE" in line or "(0)" in line:
                console.print("   " + line.strip())
    console.print("[bold green]Demo finished: both checkpoints restored bit for bit.[/bold green]")


if __name__ == "__main__":
    main()
