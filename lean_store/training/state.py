"""Training state: model, optimizer, LR scheduler, step, RNG, data position and extras.

One checkpoint (HDF5 or Zarr) holds tensors under ``model/``, ``optimizer/state/<param>/<key>``,
``rng/`` and wherever a state tree puts them, plus two root attributes:
``training_format_version`` and ``training`` (JSON metadata). See docs/TRAINING.md.

Loading validates everything (optimizer class, hyperparameters, parameter names, shapes,
formats, every stored tensor and its digest, scheduler and data-position state, RNG states on
scratch generators) before it installs anything; on error nothing is changed.

torch is imported lazily, so ``import lean_store`` works without it.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Collection, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from ..checkpoint import Checkpoint, as_values, is_module
from ..errors import CheckpointError, IntegrityError
from ..gc_pause import collection_paused
from ..hardening import check_json_depth
from ..layout import Difference, Layout, layout_error
from ..sources.base import fitted_to_stored, prepare_targets
from ..sources.module_names import respelled, spelled_as, spelled_under
from ..statetree import JSON_DEPTH, decode, encode, tensor_names

TRAINING_FORMAT_VERSION = 1
VERSION_ATTR = "training_format_version"
META_ATTR = "training"
LEGACY_V0_ATTR = "optimizer"
MAX_META_TEXT = 64 << 20
SCHEDULED = ("lr", "initial_lr")


@dataclass
class TrainingInfo:
    """What a training checkpoint said beyond the tensors it restored."""

    step: int | None
    extra: Any
    data: Any
    format_version: int
    rng_restored: bool
    kind: str
    path: str


# ----------------------------------------------------------------------------------- saving


def build_training_state(
    *, model: Any, names_model: Any, optimizer: Any, scheduler: Any = None,
    step: int | None = None, rng: bool = True, data: Any = None, extra: Any = None,
    generators: Mapping[str, Any] | None = None, scaler: Any = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], Any]:
    """(tensors, metadata without ``rng``, RNG tensors, RNG metadata or None): what one process
    contributes to a training checkpoint. Shared by the single-process and the sharded save."""
    tensors, meta = training_tensors(model=model, names_model=names_model, optimizer=optimizer,
                                     scheduler=scheduler, step=step, data=data, extra=extra,
                                     scaler=scaler)
    rng_tensors: dict[str, Any] = {}
    rng_meta = None
    if rng or generators:
        from ..sources.rng import capture

        rng_meta = capture(rng_tensors, generators, global_state=bool(rng))
    return tensors, meta, rng_tensors, rng_meta


def single_training_state(**build: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors and extra root attributes of a single-process training checkpoint."""
    tensors, meta, rng_tensors, rng_meta = build_training_state(**build)
    clash = sorted(set(rng_tensors) & set(tensors))
    if clash:
        raise CheckpointError(f"tensor names {clash[:4]} are used twice")
    tensors.update(rng_tensors)
    if rng_meta is not None:
        meta["rng"] = rng_meta
    return tensors, training_root(json.dumps(meta, separators=(",", ":"), allow_nan=False))


def training_root(text: str) -> dict[str, Any]:
    """The root attributes that make a checkpoint a training checkpoint (``text``: its
    metadata as JSON, refused before anything is written when a load would refuse it)."""
    if len(text) > MAX_META_TEXT:
        raise CheckpointError(
            f"the training metadata is {len(text)} characters of JSON, more than the "
            f"{MAX_META_TEXT} a load reads; it holds the JSON values of extra= and data= (and "
            "the optimizer's and scheduler's settings): keep large values out of them, or pass "
            "them as arrays or tensors, which are stored as tensors")
    return {VERSION_ATTR: TRAINING_FORMAT_VERSION, META_ATTR: text}


def training_tensors(*, model: Any, names_model: Any, optimizer: Any, scheduler: Any = None,
                     step: int | None = None, data: Any = None, extra: Any = None,
                     scaler: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every tensor of a training checkpoint but the RNG states, by name, and its metadata
    (without ``rng``). Shared by the single-process and the sharded save."""
    from ..sources.optimizer import class_name, describe, param_names
    from ..sources.torch_source import state_dict_of

    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {"step": step}
    if model is not None:
        state = state_dict_of(model)
        for name, value in state.items():
            tensors[f"model/{name}"] = value
        meta["model"] = {"class": class_name(model), "tensors": len(state)}
    if optimizer is not None:
        names = param_names(optimizer, names_model)
        meta["optimizer"] = describe(optimizer, names, "optimizer/", tensors)
    for field, part in (("scheduler", scheduler), ("scaler", scaler)):
        if part is not None:  # an LR scheduler, a mixed-precision loss scaler
            meta[field] = {
                "class": class_name(part),
                "state": encode(part.state_dict(), field, tensors),
            }
    if data is not None:
        meta["data"] = _data_meta(data, tensors)
    if extra is not None:
        meta["extra"] = encode(extra, "extra", tensors)
    return tensors, meta


def _data_kind(data: Any) -> str:
    from ..sources.rng import generator_state

    try:
        generator_state(data)
        return "generator"
    except CheckpointError:
        pass
    if callable(getattr(data, "state_dict", None)) and callable(
        getattr(data, "load_state_dict", None)
    ):
        return "stateful"
    if isinstance(data, Mapping):
        return "mapping"
    raise CheckpointError(
        f"cannot store a data position of type {type(data).__name__}: pass a generator, an "
        "object with state_dict()/load_state_dict(), or a mapping"
    )


def _data_meta(data: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    from ..sources.rng import generator_kind, generator_state

    kind = _data_kind(data)
    if kind == "generator":
        return {"type": f"generator:{generator_kind(data)}",
                "state": encode(generator_state(data), "data", tensors)}
    state = data.state_dict() if kind == "stateful" else dict(data)
    return {"type": kind, "class": type(data).__qualname__, "state": encode(state, "data", tensors)}


# ---------------------------------------------------------------------------------- loading


def read_metadata(ck: Checkpoint) -> tuple[int, dict[str, Any], str]:
    """(training format version, metadata in the current version's shape, optimizer prefix).

    Migration rule: version 0 files (no ``training_format_version``) kept the optimizer
    metadata in the root attribute ``optimizer``, its tensors under ``state/`` and no RNG,
    step, scheduler or data; they are read as version 1 with those fields absent.
    """
    attrs = ck.root_attrs
    if ck.kind not in ("optimizer", "training"):
        raise CheckpointError(
            f"{ck.path} is a {ck.kind!r} checkpoint, not an optimizer or training checkpoint"
        )
    version = attrs.get(VERSION_ATTR)
    if version is None and LEGACY_V0_ATTR in attrs:
        return 0, {"optimizer": _json(attrs[LEGACY_V0_ATTR], ck.path)}, ""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise IntegrityError(f"{ck.path}: malformed {VERSION_ATTR} {version!r}")
    if version > TRAINING_FORMAT_VERSION:
        raise IntegrityError(
            f"{ck.path}: training format version {version} is newer than this lean_store "
            f"(reads up to {TRAINING_FORMAT_VERSION}); upgrade lean_store"
        )
    meta = _json(attrs.get(META_ATTR), ck.path)
    if not isinstance(meta, dict):
        raise IntegrityError(f"{ck.path}: the training metadata is not a JSON object")
    return version, meta, "optimizer/"


def _json(value: Any, where: Any) -> Any:
    if isinstance(value, (dict, list)):  # a store may hand back parsed JSON
        return value
    if not isinstance(value, str) or len(value) > MAX_META_TEXT:
        raise IntegrityError(f"{where}: training metadata missing or absurdly long")
    check_json_depth(value, f"{where}: training metadata", JSON_DEPTH)
    try:
        return json.loads(value)
    except ValueError as exc:
        raise IntegrityError(f"{where}: training metadata is not valid JSON ({exc})") from None


class TrainingReader:
    """Verified reads of one checkpoint's tensors into new torch tensors or numpy arrays."""

    def __init__(self, ck: Checkpoint) -> None:
        self.ck = ck

    def entry(self, name: str) -> Any:
        """The layout entry of tensor ``name``; IntegrityError when the checkpoint lacks it."""
        if name not in self.ck.layout:
            raise IntegrityError(f"{self.ck.path}: the metadata names tensor {name!r}, "
                                 "which the checkpoint does not hold")
        return self.ck.layout[name]

    def tensor(self, name: str, device: Any = "cpu") -> Any:
        from ..sources.torch_source import dtype_of_format, new_tensor

        entry = self.entry(name)
        if dtype_of_format(entry.format) is None:
            raise IntegrityError(f"tensor {name!r} is {entry.format.tag}, which torch cannot hold")
        return new_tensor(self.ck.read_bits(entry.name), entry.format, entry.shape, device)

    def lookup(self, kind: str, name: str) -> Any:
        if kind == "tensor":
            return self.tensor(name)
        entry = self.entry(name)
        values = as_values(self.ck.read_bits(entry.name), entry.format)
        if kind == "scalar":
            if entry.shape != () or not hasattr(values, "dtype"):
                raise IntegrityError(f"tensor {name!r} is not a numpy scalar")
            return values[()]
        return values


def load_single(path: Any, *, model: Any, names_model: Any, optimizer: Any, rng: bool,
                generators: Mapping[str, Any] | None, scheduled: Collection[str],
                stacklevel: int, scheduler: Any = None, data: Any = None,
                scaler: Any = None) -> TrainingInfo:
    """Restore a training checkpoint in one process (see :func:`lean_store.load_training`);
    Python's cyclic collector paused meanwhile (:mod:`..gc_pause`)."""
    with collection_paused(), Checkpoint(path) as ck:
        prepared = prepare_load(ck, model=model, names_model=names_model, optimizer=optimizer,
                                rng=rng, generators=generators, scheduled=scheduled,
                                scheduler=scheduler, data=data, scaler=scaler)
        prepared.install()
    warn_lost(path, prepared.lost, stacklevel)
    return prepared.info


@dataclass
class PreparedLoad:
    """A validated training checkpoint: ``install()`` changes things, nothing before it did."""

    installs: list[Callable[[], None]]
    lost: list[str]
    info: TrainingInfo

    def install(self) -> None:
        for install in self.installs:
            install()


def warn_lost(path: Any, lost: list[str], stacklevel: int) -> None:
    if lost:
        warnings.warn(
            f"{path}: restored without {', '.join(lost)}: the optimizer moments (and any model) "
            "are restored, but a stochastic continuation cannot be reproduced",
            stacklevel=stacklevel + 1,
        )


def prepare_load(ck: Checkpoint, *, model: Any, names_model: Any, optimizer: Any, rng: bool,
                 generators: Mapping[str, Any] | None, scheduled: Collection[str],
                 scheduler: Any = None, data: Any = None, rank: int = 0, world: int = 1,
                 prepare_model: Callable[[Checkpoint, Any], Callable[[], None]] | None = None,
                 read_state: Callable[[str, Any], Any] | None = None,
                 scaler: Any = None) -> PreparedLoad:
    """Validate everything a training checkpoint holds against the live objects and read what
    is needed; nothing is changed until ``install()`` of the result. The sharded load passes
    ``rank``/``world`` (whose RNG states to restore), ``prepare_model`` (reads this rank's
    shards) and ``read_state`` (optimizer tensors as this rank's shards)."""
    installs: list[Callable[[], None]] = []
    version, meta, prefix = read_metadata(ck)
    reader = TrainingReader(ck)
    accounted = {name for _, name in tensor_names(meta)}
    accounted |= {n for n in ck.layout.names() if n.startswith(("model/", f"{prefix}state/"))}
    extra = [n for n in ck.layout.names() if n not in accounted]
    if extra:
        raise IntegrityError(f"{ck.path}: tensors {extra[:8]} are not described by the "
                             "training metadata")
    if model is not None:
        installs.append((prepare_model or _prepare_model)(ck, model))
    if optimizer is not None:
        from ..sources.optimizer import param_names, prepare  # torch: only for an optimizer

        if not meta.get("optimizer"):
            raise CheckpointError(f"{ck.path} holds no optimizer state")
        names = stored_spelling(param_names(optimizer, names_model), meta["optimizer"])
        prepared = prepare(optimizer, names, meta["optimizer"], prefix, ck.layout,
                           read_state or reader.tensor, reader.lookup, scheduled=scheduled)
        installs.append(prepared.install)
    for field, part in (("scheduler", scheduler), ("scaler", scaler)):
        if part is not None:
            installs.append(_prepare_stateful(field, meta.get(field), part, reader, ck.path))
    data_state = None
    if meta.get("data") is not None:
        data_state, install = _prepare_data(meta["data"], data, reader, ck.path)
        installs.append(install)
    elif data is not None:
        raise CheckpointError(f"{ck.path} holds no data position")
    lost: list[str] = []
    if meta.get("rng") is not None and (rng or generators):
        rng_meta, lookup, why = _rank_rng(meta["rng"], reader, rank, world)
        if why is not None:
            if generators:
                raise CheckpointError(f"{ck.path}: cannot restore the generators: {why}")
            lost.append(why)
        else:
            install, lost = _prepare_rng(rng_meta, lookup, generators, rng)
            installs.append(install)
    elif generators:
        raise CheckpointError(f"{ck.path} holds no generator states")
    elif rng:
        lost = ["RNG state" if version else f"RNG state (format version {version})"]
    extra_value = decode(meta.get("extra"), reader.lookup, "extra")
    step = meta.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise IntegrityError(f"{ck.path}: malformed step {step!r}")
    info = TrainingInfo(step=step, extra=extra_value, data=data_state, format_version=version,
                        rng_restored=rng and not lost, kind=ck.kind, path=str(ck.path))
    return PreparedLoad(installs, lost, info)


def _rank_rng(meta: Any, reader: TrainingReader, rank: int, world: int
              ) -> tuple[Any, Callable[[str, str], Any], str | None]:
    """This rank's RNG metadata and a lookup for its tensors, or why it cannot be restored.

    A sharded save stores one RNG record per rank (``{"ranks": [...]}``); each RNG tensor is
    stacked along a leading rank axis, row ``r`` being rank ``r``'s. RNG states continue only
    on the world size that saved them: after resharding they are skipped (with a warning)."""
    if not (isinstance(meta, dict) and "ranks" in meta):
        if world == 1:
            return meta, reader.lookup, None
        return None, reader.lookup, (f"RNG state (saved by one process, loading on {world} "
                                     "ranks; RNG continuation cannot be reproduced)")
    ranks = meta["ranks"]
    if not isinstance(ranks, list) or not ranks:
        raise IntegrityError(f"{reader.ck.path}: malformed per-rank RNG metadata")
    if len(ranks) != world:
        return None, reader.lookup, (
            f"per-rank RNG state (saved by {len(ranks)} ranks, loading on {world}; after "
            "resharding to another world size RNG continuation cannot be reproduced)")

    def lookup(kind: str, name: str) -> Any:
        entry = reader.entry(name)
        if not entry.shape or entry.shape[0] != len(ranks):
            raise IntegrityError(f"per-rank RNG tensor {name!r} of shape {entry.shape} is not "
                                 f"stacked over {len(ranks)} ranks")
        if kind == "tensor":
            return reader.tensor(name)[rank].clone()
        values = reader.lookup("array", name)[rank]
        return values[()] if kind == "scalar" else values.copy()

    return ranks[rank], lookup, None


def _prepare_rng(meta: Any, lookup: Callable[[str, str], Any], generators: Any, rng: bool
                 ) -> Any:
    from ..sources.rng import prepare

    return prepare(meta, lookup, generators, global_state=rng)


def _prepare_model(ck: Checkpoint, model: Any) -> Callable[[], None]:
    from ..sources import after_load, tensor_targets

    targets = tensor_targets(model)
    # named as the checkpoint spells them (a wrapper's names: sources/module_names.py)
    if is_module(model):
        targets = respelled(targets, spelled_under(targets, ck.layout.names(), "model/"))
    # extra state and lazy parameters as saved; tied names through the twin the file holds
    targets, _tied = fitted_to_stored(targets, ck.layout, "model/")
    expected = Layout.from_specs(
        [(f"model/{n}", t.entry.shape, t.entry.format) for n, t in targets.items()]
    )
    stored = [e for e in ck.layout if e.name.startswith("model/")]
    actual = Layout.from_specs([(e.name, e.shape, e.format) for e in stored])
    actual.check(expected)
    ck.verify([e.name for e in stored])  # every digest before anything is written

    def install() -> None:
        prepare_targets(targets.values())  # meta tensors get memory (all or none)
        for name, target in targets.items():
            for region, words in ck.blocks(f"model/{name}", reuse=True):
                target.write(region, words)
        for target in targets.values():  # extra state, handed to its module
            target.finish()
        after_load(model, targets.values(), stacklevel=5)

    return install


def stored_spelling(names: list[str], meta: Any) -> list[str]:
    """The optimizer's parameter ``names`` as the checkpoint's optimizer metadata ``meta``
    spells them (a wrapper's names: sources/module_names.py)."""
    params = meta.get("params") if isinstance(meta, dict) else None
    stored = [p["name"] for p in params if isinstance(p, dict) and isinstance(p.get("name"), str)
              ] if isinstance(params, list) else []
    spelling = spelled_as(names, stored)
    return [spelling.get(name, name) for name in names]


def _prepare_stateful(field: str, meta: Any, part: Any, reader: TrainingReader,
                      where: Any) -> Callable[[], None]:
    """The install of a scheduler's or a loss scaler's state (``field``), validated now: the
    same class, the same keys."""
    from ..sources.optimizer import class_name

    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} holds no {field} state")
    if meta.get("class") != class_name(part):
        raise layout_error([Difference(f"{field} class", None, class_name(part),
                                       meta.get("class"))], field)
    state = decode(meta.get("state"), reader.lookup, field)
    live = part.state_dict()
    if not isinstance(state, dict) or set(state) != set(live):
        got = sorted(state) if isinstance(state, dict) else state
        raise layout_error([Difference(f"{field} keys", None, sorted(live), got)], field)
    return lambda: part.load_state_dict(state)


def _prepare_data(meta: Any, data: Any, reader: TrainingReader, where: Any) -> tuple[Any, Any]:
    if not isinstance(meta, dict) or not isinstance(meta.get("type"), str):
        raise IntegrityError(f"{where}: malformed data position metadata")
    state = decode(meta.get("state"), reader.lookup, "data position")
    if data is None:
        return state, lambda: None
    kind = _data_kind(data)
    saved = meta["type"]
    if kind == "generator":
        from ..sources.rng import check_generator_state, generator_kind

        if saved != f"generator:{generator_kind(data)}":
            raise CheckpointError(f"the data position was saved from a {saved}, not a "
                                  f"{generator_kind(data)} generator")
        return state, check_generator_state(data, state, "data position")
    if saved != kind:
        raise CheckpointError(f"the data position was saved as {saved!r}, not {kind!r}")
    if kind == "stateful":
        live = data.state_dict()
        if isinstance(live, Mapping) and isinstance(state, Mapping) and set(live) != set(state):
            raise layout_error([Difference("data position keys", None, sorted(live),
                                           sorted(state))], "data position")
        return state, lambda: data.load_state_dict(state)
    if not isinstance(data, MutableMapping):
        raise CheckpointError("pass a mutable mapping to restore a mapping data position")

    def install() -> None:
        data.clear()
        data.update(state)

    return state, install


__all__ = [
    "TRAINING_FORMAT_VERSION", "PreparedLoad", "TrainingInfo", "build_training_state",
    "load_single", "prepare_load", "read_metadata", "single_training_state", "training_root",
    "training_tensors",
]
