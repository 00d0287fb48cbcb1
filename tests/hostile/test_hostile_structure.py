"""Hostile structure (issue 11, items 12-14): deep nesting, huge claimed layouts, special files
and unexpected failures give a short, typed error (and one CLI line), never a RecursionError,
a hang, a traceback or memory in proportion to what a file claims."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import lean_store as ls
from lean_store import cli
from lean_store.hardening import MAX_TREE_DEPTH, json_depth

ROOT = Path(__file__).resolve().parents[2]
STATE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(3, dtype=np.int64)}
DEEP = "[" * 100_000 + "]" * 100_000


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lean_store", *args], capture_output=True,
                          text=True, env=_env(), timeout=120)


def _main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (much faster than a child), as a CompletedProcess."""
    capsys.readouterr()
    code = cli.main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def _one_clean_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def _set_h5_root(path: Path, **attrs) -> None:
    with h5py.File(path, "r+") as f:
        for key, value in attrs.items():
            del f.attrs[key]
            if isinstance(value, str):
                data = value.encode()
                f.attrs[key] = np.array(data, dtype=h5py.string_dtype("utf-8", len(data)))
            else:
                f.attrs[key] = value


def _set_zarr_root(path: Path, **attrs) -> None:
    meta_path = path / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"].update(attrs)
    meta_path.write_text(json.dumps(meta))


@pytest.fixture
def h5(tmp_path) -> Path:
    path = tmp_path / "ck.h5"
    ls.save(STATE, path)
    return path


@pytest.fixture
def zdir(tmp_path) -> Path:
    path = tmp_path / "ck.zarr"
    ls.save(STATE, path)
    return path


# ------------------------------------------------------------------ 12: JSON nesting


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert (json_depth("5"), json_depth("[]"), json_depth(b"[1, [2, 3]]")) == (0, 1, 2)
    assert json_depth('[1, [2, 3], {"a": [4]}]') == 3
    tricky = r'[{"name": "a[[[,{\"b", "x": "\\"}, {"name": "]],\\\\"}, ["\\\""]]'
    assert json.loads(tricky)  # valid JSON: brackets, backslashes and quotes inside strings
    assert json_depth(tricky) == 2
    assert json_depth(DEEP) == 100_000
    assert json_depth(DEEP, block=1000) == 100_000  # the same across block boundaries


@pytest.mark.parametrize("depth", [100_000, 10_000])
def test_hdf5_layout_nested_deep_is_refused(h5, depth, capsys) -> None:
    _set_h5_root(h5, layout="[" * depth + "]" * depth)
    # 100,000 levels are far more text than 2 tensors need; 10,000 fit and are refused for depth
    what = "far longer than 2 tensors need" if depth == 100_000 else f"nested {depth} levels"
    with pytest.raises(ls.IntegrityError, match=what):
        ls.open(h5)
    report = ls.verify(h5)
    assert not report.ok and what in str(report)
    line = _one_clean_line(_main(capsys, "inspect", str(h5)))
    assert what in line


def test_layout_nesting_is_refused_even_where_the_text_may_be_long(tmp_path) -> None:
    state = {f"t{i}": np.zeros(1, np.float32) for i in range(40)}  # room for a 650 KB layout
    path = tmp_path / "many.h5"
    ls.save(state, path)
    _set_h5_root(path, layout=DEEP)
    with pytest.raises(ls.UnsafeFileError, match="nested 100000 levels"):
        ls.open(path)


@pytest.mark.parametrize("depth", [100_000, 10_000])
def test_zarr_layout_text_nested_deep_is_refused(zdir, depth) -> None:
    _set_zarr_root(zdir, layout="[" * depth + "]" * depth)
    with pytest.raises(ls.IntegrityError, match="far longer|nested 10000 levels"):
        ls.load_state(zdir)


def test_zarr_metadata_nested_100000_deep_is_refused_before_zarr_parses_it(zdir) -> None:
    text = (zdir / "zarr.json").read_text()
    deep = text.replace('"attributes": {', f'"attributes": {{"x": {DEEP},', 1)
    (zdir / "zarr.json").write_text(deep)
    with pytest.raises(ls.UnsafeFileError, match="zarr.json: JSON nested 100002 levels"):
        ls.open(zdir)


def test_array_metadata_nested_deep_is_refused(zdir) -> None:
    meta = zdir / "w" / "zarr.json"
    text = meta.read_text()
    meta.write_text(text.replace('"attributes": {', f'"attributes": {{"x": {DEEP},', 1))
    # opened from the root's consolidated copy: the array's own document is bounded when it
    # is read, before the tensor's data
    with pytest.raises(ls.UnsafeFileError, match="w/zarr.json: JSON nested"):
        ls.load_state(zdir)


def _nest(base: Path, depth: int) -> list[Path]:
    made, path = [], base
    for _ in range(depth):  # os.makedirs recurses; one mkdir at a time does not
        path = path / "d"
        path.mkdir()
        made.append(path)
    return made


def _unnest(made: list[Path]) -> None:
    for path in reversed(made):  # shutil.rmtree recurses too (Python < 3.12)
        path.rmdir()


def test_zarr_with_1000_nested_directories_is_refused(zdir, capsys) -> None:
    made = _nest(zdir / "w", 1000)
    try:
        with pytest.raises(ls.UnsafeFileError, match=f"more than {MAX_TREE_DEPTH} deep"):
            ls.open(zdir)
        line = _one_clean_line(_main(capsys, "inspect", str(zdir)))
        assert "nested more than" in line
    finally:
        _unnest(made)
    assert ls.load_state(zdir)["w"].tobytes() == STATE["w"].tobytes()  # intact once removed


def test_zarr_tree_as_deep_as_a_rank_32_array_is_fine(tmp_path) -> None:
    shape = (1,) * 32
    path = tmp_path / "rank32.zarr"
    ls.save({"t": np.ones(shape, np.float32)}, path)
    assert ls.load_state(path)["t"].shape == shape


# ------------------------------------------------------------------ 12: claimed sizes


ENTRY = '{"index":0,"name":"x","shape":[1],"format":"float32","width":32}'
MANY = 200_000  # a 13 MB layout: as many tensors as a claim likes, far more than the file holds


def _many_entries() -> str:
    return "[" + ",".join([ENTRY] * MANY) + "]"


@pytest.mark.parametrize("count", [MANY, 2])
def test_layout_listing_far_more_tensors_than_present_is_refused_briefly(h5, count) -> None:
    _set_h5_root(h5, layout=_many_entries(), tensor_count=count)
    with pytest.raises(ls.IntegrityError) as info:
        ls.open(h5)
    message = str(info.value)
    assert len(message) < 500, message[:1000]
    if count == MANY:
        assert f"tensor_count {MANY} but the store holds only 2 datasets" in message
    else:
        assert "far longer than 2 tensors need" in message


def test_zarr_layout_listing_far_more_tensors_than_present_is_refused(zdir) -> None:
    _set_zarr_root(zdir, layout=_many_entries(), tensor_count=MANY)
    with pytest.raises(ls.IntegrityError, match="holds only 2 datasets"):
        ls.open(zdir)


def test_many_mismatches_make_a_short_message_that_counts_the_rest(tmp_path) -> None:
    state = {f"t{i:03d}": np.full(2, i, np.int32) for i in range(60)}
    path = tmp_path / "many.h5"
    ls.save(state, path)
    with h5py.File(path, "r+") as f:
        for name in state:  # every dataset renamed: 60 missing and 60 unexpected
            f.move(name, "x" + name)
    with pytest.raises(ls.IntegrityError) as info:
        ls.open(path)
    message = str(info.value)
    assert "... and 100 more" in message and message.count("\n") == 21
    wrong = {f"u{i:03d}": np.zeros(2, np.int32) for i in range(60)}
    ls.save(state, path)
    with pytest.raises(ls.LayoutError) as info:
        ls.load(wrong, path)
    assert "more" in str(info.value) and len(info.value.differences) > 100


# ------------------------------------------------------------------ 13: special files


def _special(tmp_path: Path, kind: str) -> tuple[Path, str]:
    path = tmp_path / f"{kind}.h5"
    if kind == "fifo":
        os.mkfifo(path)
        return path, "FIFO"
    if kind == "devzero":
        path.symlink_to("/dev/zero")
        return path, "symlink to /dev/zero, which is a character device"
    if kind == "dangling":
        path.symlink_to(tmp_path / "gone.h5")
        return path, "dangling symlink"
    if kind == "socket":
        path = Path("/tmp") / f"lean_store_test_{os.getpid()}.h5"  # short: AF_UNIX path limit
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
        return path, "socket"
    raise AssertionError(kind)


@pytest.fixture(params=["fifo", "devzero", "dangling", "socket"])
def special(request, tmp_path):
    path, what = _special(tmp_path, request.param)
    yield path, what
    if path.is_socket():
        path.unlink()


def test_special_files_are_refused_by_every_entry_point(special, capsys) -> None:
    path, what = special
    for call in (
        lambda: ls.open(path),
        lambda: ls.open(str(path), backend="zarr"),
        lambda: ls.load_state(path),
        lambda: ls.load({"w": np.zeros((3, 4), np.float32)}, path),
    ):
        with pytest.raises(ls.CheckpointError, match=what):
            call()
    report = ls.verify(path)
    assert not report.ok and what in str(report)
    for args in (["inspect", str(path)], ["verify", str(path)],
                 ["convert", str(path), str(path.with_name("out.safetensors"))],
                 ["convert", str(path), str(path.with_name("out.zarr")), "--from", "hdf5"],
                 ["diff", str(path), str(path)]):
        if what == "FIFO" and args[0] in ("convert", "diff"):  # in a child: old code blocked
            done = _cli(*args)
        else:
            done = _main(capsys, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert what in _one_clean_line(done)


def test_fifo_opened_as_hdf5_is_refused_not_waited_on(tmp_path) -> None:
    """In a child, so that the old behaviour (blocking forever in open) fails the test."""
    fifo = tmp_path / "pipe.h5"
    os.mkfifo(fifo)
    code = (
        "import lean_store as ls, sys\n"
        "try:\n"
        f"    ls.open({str(fifo)!r}, backend='hdf5')\n"
        "except ls.CheckpointError as exc:\n"
        "    print(exc)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=_env(), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("ls.open(fifo, backend='hdf5') blocked")
    assert "is a FIFO (named pipe)" in done.stdout, done.stdout + done.stderr


def test_symlink_to_a_checkpoint_still_opens(h5, tmp_path) -> None:
    link = tmp_path / "latest.h5"
    link.symlink_to(h5)
    assert ls.load_state(link)["w"].tobytes() == STATE["w"].tobytes()


# ------------------------------------------------------------------ 14: the CLI, hostile inputs


def test_cli_turns_an_unexpected_exception_into_one_line_and_exit_2(h5, monkeypatch,
                                                                    capsys) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(ls.checkpoint, "open", boom)
    assert cli.main(["inspect", str(h5)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "lean-store inspect: unexpected error: RuntimeError: boom "
        "(set LEAN_STORE_DEBUG=1 for a traceback)"
    )
    monkeypatch.setattr(ls.checkpoint, "open", lambda *a, **k: (_ for _ in ()).throw(
        RecursionError("maximum recursion depth exceeded")))
    assert cli.main(["diff", str(h5), str(h5)]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["garbage", "empty", "zarr_no_meta", "layout_not_json",
                                    "count_string"])
def test_cli_on_hostile_inputs_prints_one_line(tmp_path, h5, damage, capsys) -> None:
    path = h5
    if damage == "garbage":
        path = tmp_path / "g.h5"
        path.write_bytes(os.urandom(4096))
    elif damage == "empty":
        path = tmp_path / "e.h5"
        path.write_bytes(b"")
    elif damage == "zarr_no_meta":
        path = tmp_path / "z.zarr"
        (path / "w").mkdir(parents=True)
    elif damage == "layout_not_json":
        _set_h5_root(h5, layout="[{" + "\"a\":" * 5)
    elif damage == "count_string":
        _set_h5_root(h5, tensor_count="2")
    for command in ("inspect", "verify", "diff"):
        args = [command, str(path)] + ([str(path)] if command == "diff" else [])
        done = _main(capsys, *args)
        assert done.returncode in (1, 2), (command, done.returncode, done.stderr)
        if command != "verify":  # verify reports its findings on stdout, one per line
            _one_clean_line(done)
        else:
            assert "Traceback" not in done.stdout + done.stderr
