"""A directory that holds checkpoints but is none (a Checkpointer's steps): the error names
them, so the user knows which path to give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch_optional import needs_torch

import lean_store as ls

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_directory_of_steps_names_them(tmp_path: Path, suffix: str) -> None:
    for step in range(6):
        ls.save({"w": np.full(3, step, np.float32)}, tmp_path / f"step_{step:010d}{suffix}")
    (tmp_path / ".step_0000000006.h5.lean_store-tmp-x").write_bytes(b"")  # not listed
    with pytest.raises(ls.IntegrityError) as caught:
        ls.load_state(tmp_path)
    message = str(caught.value)
    assert "it holds 6 checkpoints" in message
    assert f"step_0000000000{suffix}, ..., step_0000000003{suffix}" in message
    assert f"e.g. {tmp_path / f'step_0000000005{suffix}'}" in message
    assert ".lean_store-tmp" not in message
    run = subprocess.run([sys.executable, "-m", "lean_store", "verify", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 1
    assert f"step_0000000005{suffix}" in run.stdout + run.stderr


def test_a_directory_without_checkpoints_says_only_that(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ls.IntegrityError) as caught:
        ls.load_state(tmp_path)
    assert str(caught.value).endswith("is a directory but not a lean_store checkpoint "
                                      "(no zarr.json)")


@needs_torch  # training checkpoints are saved from torch state
@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_inspect_of_a_directory_of_steps_lists_them(tmp_path: Path, suffix: str) -> None:
    """``lean-store inspect run/`` of a Checkpointer's directory lists its steps with their
    size and plain data (``extra``, ``data``: read without reading a tensor) instead of
    refusing the directory; a step that is no training checkpoint shows none."""
    import json

    from lean_store.cli import main

    run = ls.Checkpointer(tmp_path / "run", backend=suffix.lstrip(".").replace("h5", "hdf5"))
    state = {"w": np.arange(3, dtype=np.float32)}
    for step in (10, 20):
        run.save(step, model=state, extra={"val_loss": step / 100}, data={"epoch": step // 10})
    ls.save(state, run.directory / f"step_0000000030{suffix}")  # not a training checkpoint
    out = subprocess.run([sys.executable, "-m", "lean_store", "inspect", str(run.directory),
                          "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [s["step"] for s in doc["steps"]] == [10, 20, 30]
    assert doc["steps"][1]["extra"] == {"val_loss": 0.2} and doc["steps"][1]["data"] == {
        "epoch": 2}
    assert doc["steps"][2]["extra"] is None and all(s["bytes_on_disk"] > 0 for s in doc["steps"])
    assert main(["inspect", str(run.directory)]) == 0
    # an analyst's machine without torch: training_info and the listing read the metadata
    # without it (before, preparing any training load imported torch's optimizer module)
    code = ("import sys; sys.modules['torch'] = None\n"  # import torch fails
            "import lean_store as ls\n"
            f"print(ls.training_info({str(run.path(20))!r}).extra)\n"
            "from lean_store.cli import main\n"
            f"sys.exit(main(['inspect', {str(run.directory)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "{'val_loss': 0.2}" in done.stdout and "epoch=2" in done.stdout


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_inspect_of_a_run_skips_a_step_pruned_while_it_lists(monkeypatch, capsys,
                                                              tmp_path: Path,
                                                              suffix: str) -> None:
    """``lean-store inspect run/`` while a training job's Checkpointer prunes: a step removed
    between the listing and its turn is left out (it is no longer one of the run's steps).
    It failed with exit 2 and a bare "[Errno 2] No such file or directory" in about a third of
    the calls made while a job saved ~50 steps a second with keep_last=2."""
    import json
    import shutil

    import lean_store.training as training
    from lean_store.cli import main

    for step in range(4):
        ls.save({"w": np.full(3, step, np.float32)}, tmp_path / f"step_{step:010d}{suffix}")
    pruned = tmp_path / f"step_{1:010d}{suffix}"
    real = training.training_info

    def pruning(where, *args, **kwargs):
        if Path(where) == pruned:  # the job's Checkpointer removes it now
            shutil.rmtree(pruned) if pruned.is_dir() else pruned.unlink()
        return real(where, *args, **kwargs)

    monkeypatch.setattr(training, "training_info", pruning)
    assert main(["inspect", "--json", str(tmp_path)]) == 0
    listed = json.loads(capsys.readouterr().out)["steps"]
    assert [row["step"] for row in listed] == [0, 2, 3]
    assert all(row["bytes_on_disk"] > 0 for row in listed)
