"""Sharded HDF5 loads check what each rank reads, and all of it before anything is installed
(issue 13: a rank no longer checks every source of the master): a shard-file dataset with
tampered attributes or the wrong shape is refused on every rank with the targets untouched,
with and without the verification pass; single-process reads of one shard go to its file."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from torch_optional import require_torch  # noqa: E402

require_torch()
from test_distributed import damaged_loads, run_world  # noqa: E402

HERE = Path(__file__).resolve()
ROWS = {"w": (8, 3), "v": (6,)}


def _state(rank: int, fill: float | None = None) -> dict:
    import torch

    from lean_store.distributed import LocalShard

    out = {}
    for i, (name, shape) in enumerate(ROWS.items()):
        full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) + 100 * i
        half = shape[0] // 2
        part = full[half * rank: half * (rank + 1)].clone()
        if fill is not None:
            part.fill_(fill)
        offsets = (half * rank,) + (0,) * (len(shape) - 1)
        out[name] = LocalShard(part, shape, offsets)
    return out


def _tamper(out: Path) -> None:
    import h5py

    # "v" is loaded after "w": a check made only when "v" is read would come after "w" was
    # installed on rank 1
    shutil.copytree(out / "ck.h5", out / "attr.h5")
    with h5py.File(out / "attr.h5" / "shard-00001-of-00002.h5", "r+") as f:
        f["t000001-s00001"].attrs["shard"] = np.int64(5)
    shutil.copytree(out / "ck.h5", out / "shape.h5")
    with h5py.File(out / "shape.h5" / "shard-00001-of-00002.h5", "r+") as f:
        del f["t000001-s00001"]
        f.create_dataset("t000001-s00001", data=np.zeros(2, np.float32))


def scenario_checks(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist

    import lean_store as ls

    ls.save(_state(rank), out / "ck.h5")
    dist.barrier()
    if rank == 0:
        _tamper(out)
    dist.barrier()
    rec: dict = {}
    target = _state(rank, fill=-1.0)
    ls.load(target, out / "ck.h5")
    want = _state(rank)
    rec["good"] = all(target[k].tensor.equal(want[k].tensor) for k in ROWS)
    rec.update(damaged_loads(lambda fill: _state(rank, fill=fill), ROWS, out,
                             ("attr.h5", "shape.h5")))
    return rec


SCENARIOS = {"checks": scenario_checks}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("hdf5checks")
    return out, run_world("checks", 2, out, script=HERE)


def test_a_good_checkpoint_loads(checked) -> None:
    _out, recs = checked
    assert all(r["good"] for r in recs)


@pytest.mark.parametrize("case", ["attr.h5 verify=True", "attr.h5 verify=False",
                                  "shape.h5 verify=True", "shape.h5 verify=False"])
def test_a_bad_source_is_refused_on_every_rank_before_anything_is_installed(checked, case):
    _out, recs = checked
    for r in recs:
        got = r[case]
        assert got["type"] is not None, (case, got)
        assert got["type"] in ("IntegrityError", "UnsafeFileError", "ShardedError"), got
        assert "t000001-s00001" in got["message"], got
        assert got["unchanged"], (case, got)
    assert len({r[case]["message"] for r in recs}) == 1  # the same error everywhere


def test_single_process_reads_go_to_the_shard_files(checked, monkeypatch) -> None:
    import lean_store as ls
    from lean_store.stores.hdf5.store import HDF5Reader

    out, _ = checked
    nodes: list[str] = []
    real = HDF5Reader.read

    def spy(self, node, *a, **k):
        nodes.append(node)
        return real(self, node, *a, **k)

    monkeypatch.setattr(HDF5Reader, "read", spy)
    state = ls.load_state(out / "ck.h5")
    assert np.array_equal(state["w"], np.arange(24, dtype=np.float32).reshape(8, 3))
    assert nodes and all(n.startswith("t0000") for n in nodes), nodes  # shard datasets only
    with ls.open(out / "ck.h5") as ck:  # opened whole: every source checked, sizes known
        stored = ck["w"].stored
        assert stored.nbytes_on_disk and "crc32c" in stored.filters


def test_one_chunk_shard_datasets_are_read_from_their_headers(checked, monkeypatch) -> None:
    """The shard files' one-chunk datasets (Fletcher-32 + CRC-32C) are found from their object
    headers and read with one pread each: none is opened through libhdf5."""
    import lean_store as ls
    from lean_store.stores.hdf5.store import HDF5Reader

    out, _ = checked
    opened: list[str] = []
    real = HDF5Reader._open_dataset
    monkeypatch.setattr(HDF5Reader, "_open_dataset",
                        lambda self, node: (opened.append(node), real(self, node))[1])
    state = ls.load_state(out / "ck.h5")
    assert np.array_equal(state["v"], np.arange(6, dtype=np.float32) + 100)
    assert not [n for n in opened if n.startswith("t0000")], opened


if __name__ == "__main__":
    from test_distributed import worker

    _scenario, _rank, _world, _port, _out = sys.argv[1:6]
    worker(_scenario, int(_rank), int(_world), int(_port), Path(_out), SCENARIOS)
