"""Each tensor's own metadata in a sharded load (issue 13). The master manifest of sharded HDF5
checkpoints (docs/FORMAT.md 6.1.1): a sharded load reads every tensor's metadata from it once,
yet a master dataset whose attributes or virtual mappings were changed after the save is still
refused on every rank before anything is installed (each master dataset compared by one rank,
with verify; by every rank reading it, without), by a single-process read and by ``verify``;
masters written before the manifest existed still load. Zarr: an array's own ``zarr.json``
changed after the save is refused the same way, each compared by one rank."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch_optional import require_torch  # noqa: E402

require_torch()
from test_distributed import damaged_loads, run_world  # noqa: E402

HERE = Path(__file__).resolve()
ROWS = {"w": (8, 3), "v": (6,), "u": (4, 2)}
MASTER = "lean_store.h5"


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
        out[name] = LocalShard(part, shape, (half * rank,) + (0,) * (len(shape) - 1))
    return out


def _whole(name: str) -> np.ndarray:
    shape = ROWS[name]
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
            + 100 * list(ROWS).index(name))


def _fixed(text: str) -> np.ndarray:
    import h5py

    data = text.encode()
    return np.array(data, dtype=h5py.string_dtype("utf-8", len(data)))


def _tamper(out: Path) -> None:
    import h5py

    # "v" is loaded after "w": a check made only when "v" is read would come after "w" was
    # installed
    shutil.copytree(out / "ck.h5", out / "attr.h5")  # a master attribute alone
    with h5py.File(out / "attr.h5" / MASTER, "r+") as f:
        text = f["v"].attrs["shards"]
        f["v"].attrs["shards"] = _fixed(" " + (text if isinstance(text, str) else text.decode()))
    shutil.copytree(out / "ck.h5", out / "swapped.h5")  # the mappings of "v" swapped
    with h5py.File(out / "swapped.h5" / MASTER, "r+") as f:
        old = f["v"]
        attrs = {k: (old.attrs[k], old.attrs.get_id(k).dtype) for k in old.attrs}
        dtype = old.dtype
        del f["v"]
        layout = h5py.VirtualLayout(shape=(6,), dtype=dtype)
        layout[0:3] = h5py.VirtualSource("shard-00001-of-00002.h5", "/t000001-s00001", (3,))
        layout[3:6] = h5py.VirtualSource("shard-00000-of-00002.h5", "/t000001-s00000", (3,))
        new = f.create_virtual_dataset("v", layout)
        for key, (value, kind) in attrs.items():
            new.attrs.create(key, value, dtype=kind)
    shutil.copytree(out / "ck.h5", out / "old.h5")  # written before the manifest existed
    with h5py.File(out / "old.h5" / MASTER, "r+") as f:
        del f.attrs["master_manifest"]
    shutil.copytree(out / "ck.zarr", out / "doc.zarr")  # v's own zarr.json, not the root copy
    doc_path = out / "doc.zarr" / "v" / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["attributes"]["width"] = 16
    doc_path.write_text(json.dumps(doc))


def scenario_manifest(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist

    import lean_store as ls
    from lean_store.stores.hdf5 import sharded

    ls.save(_state(rank), out / "ck.h5")
    ls.save(_state(rank), out / "ck.zarr")
    dist.barrier()
    if rank == 0:
        _tamper(out)
    dist.barrier()
    from lean_store.checkpoint import Checkpoint

    compared: list[str] = []
    real = sharded.master_differences

    def counting(record, *args):
        compared.append(record.node)
        return real(record, *args)

    sharded.master_differences = counting
    asked: list[str] = []
    real_check = Checkpoint.check_metadata

    def asking(self, name):
        asked.append(name)
        return real_check(self, name)

    Checkpoint.check_metadata = asking
    rec: dict = {}
    for verify in (True, False):
        asked.clear()
        target = _state(rank, fill=-1.0)
        ls.load(target, out / "ck.zarr", verify=verify)
        want = _state(rank)
        rec[f"ck.zarr verify={verify}"] = {
            "good": all(target[k].tensor.equal(want[k].tensor) for k in ROWS),
            "compared": sorted(asked)}
    for name in ("ck.h5", "old.h5"):
        for verify in (True, False):
            compared.clear()
            target = _state(rank, fill=-1.0)
            ls.load(target, out / name, verify=verify)
            want = _state(rank)
            rec[f"{name} verify={verify}"] = {
                "good": all(target[k].tensor.equal(want[k].tensor) for k in ROWS),
                "compared": sorted(compared)}
    rec.update(damaged_loads(lambda fill: _state(rank, fill=fill), ROWS, out,
                             ("attr.h5", "swapped.h5", "doc.zarr")))
    return rec


SCENARIOS = {"manifest": scenario_manifest}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("hdf5manifest")
    return out, run_world("manifest", 2, out, script=HERE)


def test_the_master_file_holds_a_manifest_readable_by_h5py(world) -> None:
    import h5py

    out, _ = world
    with h5py.File(out / "ck.h5" / MASTER, "r") as f:
        doc = json.loads(f.attrs["master_manifest"])
        assert doc["version"] == 1
        assert [r["node"] for r in doc["tensors"]] == list(ROWS)
        (v,) = [r for r in doc["tensors"] if r["node"] == "v"]
        assert v["stored_shape"] == [6]
        assert v["sources"] == [
            {"offsets": [0], "lengths": [3], "file": "shard-00000-of-00002.h5",
             "dataset": "/t000001-s00000"},
            {"offsets": [3], "lengths": [3], "file": "shard-00001-of-00002.h5",
             "dataset": "/t000001-s00001"}]
        assert v["attrs"]["shards"].encode() == f["v"].attrs["shards"]  # fixed-length bytes
        assert v["attrs"]["shape"] == [6] and v["attrs"]["name"] == "v"
        assert np.array_equal(f["v"][...], _whole("v"))  # h5py alone, through the mappings
    if shutil.which("h5dump"):  # Debian's HDF5 1.10 tools read the master with its manifest
        dump = subprocess.run(["h5dump", "-A", str(out / "ck.h5" / MASTER)],
                              capture_output=True, text=True, timeout=60)
        assert dump.returncode == 0 and 'ATTRIBUTE "master_manifest"' in dump.stdout


def test_a_zarr_load_compares_each_array_document_once_across_ranks_with_verify(world):
    _out, recs = world
    assert all(r[f"ck.zarr verify={v}"]["good"] for r in recs for v in (True, False))
    with_verify = [r["ck.zarr verify=True"]["compared"] for r in recs]
    assert sorted(n for c in with_verify for n in c) == sorted(ROWS)
    assert all(r["ck.zarr verify=False"]["compared"] == sorted(ROWS) for r in recs)


def test_a_load_compares_each_master_dataset_once_across_ranks_with_verify(world) -> None:
    _out, recs = world
    for name in ("ck.h5", "old.h5"):
        for verify in (True, False):
            assert all(r[f"{name} verify={verify}"]["good"] for r in recs), name
    with_verify = [r["ck.h5 verify=True"]["compared"] for r in recs]
    assert sorted(n for c in with_verify for n in c) == sorted(ROWS)  # each by one rank
    assert all(c for c in with_verify)  # spread over the ranks
    for r in recs:  # without verify: every master dataset this rank reads, by this rank
        assert r["ck.h5 verify=False"]["compared"] == sorted(ROWS)
        assert r["old.h5 verify=True"]["compared"] == []  # no manifest: read from the file


@pytest.mark.parametrize("case", ["attr.h5 verify=True", "attr.h5 verify=False",
                                  "swapped.h5 verify=True", "swapped.h5 verify=False",
                                  "doc.zarr verify=True", "doc.zarr verify=False"])
def test_changed_tensor_metadata_is_refused_on_every_rank_before_install(world, case) -> None:
    _out, recs = world
    words = "disagrees with its copy" if case.startswith("doc") else "changed after the save"
    for r in recs:
        got = r[case]
        assert got["type"] == "IntegrityError", (case, got)
        assert "'v'" in got["message"] and words in got["message"], got
        assert got["unchanged"], (case, got)
    assert len({r[case]["message"] for r in recs}) == 1  # the same error everywhere


@pytest.mark.parametrize("name,words", [("attr.h5", "dataset attribute shards"),
                                        ("swapped.h5", "virtual mappings")])
def test_a_single_process_and_verify_refuse_a_changed_master(world, name, words) -> None:
    import lean_store as ls
    from lean_store.errors import IntegrityError

    out, _ = world
    with pytest.raises(IntegrityError, match=words):
        ls.load_state(out / name)
    report = ls.verify(out / name)
    assert not report.ok and words in str(report)


# shape: caught by the layout check; storage: by the master dataset's own check alone
@pytest.mark.parametrize("key, value", [("shape", [2**70]), ("storage", 2**70)])
def test_a_master_manifest_value_past_int64_names_the_tensor(world, tmp_path, key,
                                                             value) -> None:
    """A master manifest record claiming a value no int64 attribute can hold is an
    IntegrityError naming the tensor, not an OverflowError from encoding it."""
    import h5py

    import lean_store as ls
    from lean_store.errors import IntegrityError

    out, _ = world
    path = tmp_path / "huge.h5"
    shutil.copytree(out / "ck.h5", path)
    with h5py.File(path / MASTER, "r+") as f:
        doc = json.loads(f.attrs["master_manifest"])
        next(r for r in doc["tensors"] if r["node"] == "v")["attrs"][key] = value
        del f.attrs["master_manifest"]
        f.attrs["master_manifest"] = _fixed(json.dumps(doc))
    with pytest.raises(IntegrityError, match=f"'v'.*{key}"):
        ls.load_state(path)
    assert not ls.verify(path).ok


def test_a_single_process_reads_masters_with_and_without_a_manifest(world) -> None:
    import lean_store as ls

    out, _ = world
    for name in ("ck.h5", "old.h5"):
        state = ls.load_state(out / name)
        assert all(np.array_equal(state[k], _whole(k)) for k in ROWS), name
        assert ls.verify(out / name).ok


def test_a_single_process_open_compares_masters_from_their_headers(world, monkeypatch
                                                                    ) -> None:
    """Opened whole in one process, each master dataset is compared with its manifest record
    as a sharded load compares it (its header's bytes where they are as written), not read
    back attribute by attribute; every source is still checked at open, sizes known."""
    import lean_store as ls
    from lean_store.stores.hdf5 import sharded

    out, _ = world
    read_back: list[str] = []
    real = sharded.read_attrs
    monkeypatch.setattr(sharded, "read_attrs",
                        lambda dsid, where, *a: (read_back.append(where), real(dsid, where, *a))[1])
    with ls.open(out / "ck.h5") as ck:
        assert not read_back, read_back
        for name in ROWS:
            assert ck[name].stored.nbytes_on_disk, name
            np.testing.assert_array_equal(ck[name].read(), _whole(name))
    assert not read_back, read_back


if __name__ == "__main__":
    from test_distributed import worker

    _scenario, _rank, _world, _port, _out = sys.argv[1:6]
    worker(_scenario, int(_rank), int(_world), int(_port), Path(_out), SCENARIOS)
