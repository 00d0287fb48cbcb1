"""Progress bars: drawn on a given stream or a terminal, silent when not on a terminal."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

import lean_store as ls
from lean_store import progress as progress_mod

STATE = {"w": np.arange(1 << 18, dtype=np.float32), "b": np.ones(7, np.int8)}


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _bar_text(out: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # drop terminal control codes


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_bar_on_a_stream_shows_bytes_rate_and_eta(tmp_path, suffix) -> None:
    out = io.StringIO()
    ls.save(STATE, tmp_path / f"ck{suffix}", progress=out)
    text = _bar_text(out.getvalue())
    assert f"save ck{suffix}" in text
    assert "1.0/1.0 MiB" in text  # bytes done / total, binary units
    assert "/s" in text  # transfer rate column
    assert re.search(r"\d:\d\d:\d\d", text)  # time remaining column
    target = {"w": np.zeros_like(STATE["w"]), "b": np.zeros_like(STATE["b"])}
    out = io.StringIO()
    ls.load(target, tmp_path / f"ck{suffix}", progress=out)
    assert f"load ck{suffix}" in _bar_text(out.getvalue())
    np.testing.assert_array_equal(target["w"], STATE["w"])


def test_true_draws_on_a_terminal_only(tmp_path, monkeypatch) -> None:
    quiet = io.StringIO()  # not a terminal: logs stay clean
    monkeypatch.setattr("sys.stderr", quiet)
    ls.save(STATE, tmp_path / "a.h5", progress=True)
    assert quiet.getvalue() == ""
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    ls.save(STATE, tmp_path / "b.h5", progress=True)
    assert "save b.h5" in _bar_text(term.getvalue())


def test_automatic_only_for_big_jobs_on_a_terminal(tmp_path, monkeypatch) -> None:
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    ls.save(STATE, tmp_path / "small.h5")  # default progress=None: below the threshold
    assert term.getvalue() == ""
    monkeypatch.setattr(progress_mod, "AUTO_THRESHOLD_BYTES", 1 << 20)
    ls.save(STATE, tmp_path / "big.h5")
    assert "save big.h5" in _bar_text(term.getvalue())
    quiet = io.StringIO()
    monkeypatch.setattr("sys.stderr", quiet)
    ls.save(STATE, tmp_path / "big2.h5")  # big, but no terminal
    ls.load({k: v.copy() for k, v in STATE.items()}, tmp_path / "big2.h5")
    assert quiet.getvalue() == ""


def test_false_is_silent_everywhere(tmp_path, monkeypatch) -> None:
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    monkeypatch.setattr(progress_mod, "AUTO_THRESHOLD_BYTES", 0)
    ls.save(STATE, tmp_path / "ck.zarr", progress=False)
    assert term.getvalue() == ""


def test_a_progress_that_is_no_stream_is_refused_before_anything(tmp_path) -> None:
    """``progress="yes"`` raised AttributeError ('str' object has no attribute 'write')."""
    path = tmp_path / "p.h5"
    for bad in ("yes", 3):
        with pytest.raises(ls.CheckpointError, match="progress must be None, True, False"):
            ls.save({"a": np.ones(3)}, path, progress=bad)
        assert not path.exists()
    ls.save({"a": np.ones(3)}, path)
    target = {"a": np.zeros(3)}
    with pytest.raises(ls.CheckpointError, match="progress must be"):
        ls.load(target, path, progress="yes")
    assert target["a"].tolist() == [0.0, 0.0, 0.0]
