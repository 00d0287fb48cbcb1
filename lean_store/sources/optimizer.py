"""torch optimizers as named tensors plus JSON metadata, and the checks made before a restore.

Saving flattens ``optimizer.state_dict()``: each per-parameter value becomes a tensor named
``<prefix>state/<param name>/<key>``. Tensors stay tensors (``step`` too, when torch keeps it as
one); Python numbers become 0-d int64/float64/bool arrays and ``None`` is recorded in the
metadata only. Hyperparameters go into the metadata with the parameter *names* of each group.

Loading builds the expected state from the live optimizer (its own state where it has some,
else the known rules of SGD, Adam, AdamW and RMSprop), compares every item of the file with it,
and returns a :class:`PreparedOptimizer` holding new tensors. ``install()`` then hands them to
``optimizer.load_state_dict``; nothing is touched before that.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..formats import ScalarFormat, get
from ..layout import Difference, Layout, layout_error
from ..statetree import decode, encode, tensor_names
from .module_names import canonical_names
from .module_state import is_uninitialized
from .torch_source import format_of_dtype, unwrapped

SCHEDULED = ("lr", "initial_lr")
"""Group keys a learning-rate scheduler changes as training runs: restored, not compared."""
CYCLED = ("momentum", "betas")
"""Also restored, not compared, in groups whose momentum a scheduler cycles (OneCycleLR and
CyclicLR with ``cycle_momentum`` mark such groups with ``max_momentum``)."""

_NUMBER_FORMATS = {"int": "int64", "float": "float64", "bool": "bool"}
_INT64 = (-(1 << 63), (1 << 63) - 1)


def class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def param_names(optimizer: torch.optim.Optimizer, model: Any = None) -> list[str]:
    """The names of the optimizer's parameters, in its order.

    From ``model.named_parameters()`` when a model is given, else from the ``param_names`` torch
    keeps for optimizers built from ``named_parameters()``, else ``param.<index>``; named
    without what wrappers add, as the model's tensors are (:mod:`.module_names`).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is not None:
        named = list(unwrapped(model).named_parameters(remove_duplicate=True))
        by_id = dict(zip((id(p) for _, p in named), canonical_names([n for n, _ in named])))
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise CheckpointError(
                f"the optimizer's parameters {missing[:8]} (positions) are not parameters of the "
                "model given; pass the model the optimizer was built for"
            )
        return [by_id[id(p)] for p in params]
    names: list[str] = []
    for g in optimizer.param_groups:
        if "param_names" in g and len(g["param_names"]) == len(g["params"]):
            names.extend(str(n) for n in g["param_names"])
        else:
            return [f"param.{i}" for i in range(len(params))]
    if len(set(names)) != len(names):
        raise CheckpointError("the optimizer's param_names are not unique")
    return canonical_names(names)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _live_state(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, dict[str, Any]]:
    state = optimizer.state_dict()["state"]
    out: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if not isinstance(key, int) or not 0 <= key < len(names):
            raise CheckpointError(f"optimizer state is keyed by {key!r}, not by a parameter")
        if not isinstance(value, Mapping):
            raise CheckpointError(f"optimizer state of {names[key]!r} is not a dict")
        out[names[key]] = dict(value)
    return out


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, (list, tuple)):  # LBFGS' direction and step histories
        return "tree"
    return type(value).__name__


def is_stateless(optimizer: torch.optim.Optimizer) -> bool:
    """Plain SGD (momentum 0 in every group) never keeps per-parameter state."""
    return type(optimizer) is torch.optim.SGD and all(
        not g.get("momentum") for g in optimizer.param_groups
    )


def describe(
    optimizer: torch.optim.Optimizer, names: list[str], prefix: str, tensors: dict[str, Any]
) -> dict[str, Any]:
    """Metadata of ``optimizer``; its state tensors are added to ``tensors``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"expected a torch.optim.Optimizer, got a {type(optimizer).__name__}")
    live = _live_state(optimizer, names)
    if not live and not is_stateless(optimizer):
        raise CheckpointError(
            f"{class_name(optimizer)} has no state yet (no step was taken): saving it would write "
            "an incomplete resume checkpoint; take an optimizer step first"
        )
    params = _params(optimizer)
    state_meta: dict[str, dict[str, str]] = {}
    trees: dict[str, dict[str, Any]] = {}
    for name, values in live.items():
        kinds: dict[str, str] = {}
        for key, value in values.items():
            if not isinstance(key, str):
                raise CheckpointError(f"optimizer state key {key!r} of {name!r} is not a string")
            kind = _kind(value)
            where = f"optimizer state {name!r}/{key!r}"
            if kind == "tensor":
                tensors[f"{prefix}state/{name}/{key}"] = value.detach()
            elif kind in _NUMBER_FORMATS:
                if kind == "int" and not _INT64[0] <= value <= _INT64[1]:
                    raise CheckpointError(f"{where}: integer {value} does not fit int64")
                tensors[f"{prefix}state/{name}/{key}"] = np.asarray(
                    value, dtype=_NUMBER_FORMATS[kind]
                )
            elif kind == "tree":  # a list of tensors and numbers: a state tree (FORMAT.md 7)
                trees.setdefault(name, {})[key] = encode(
                    value, f"{prefix}state/{name}/{key}", tensors)
            elif kind != "none":
                raise CheckpointError(
                    f"{where} is a {kind}; lean_store stores optimizer state made of tensors, "
                    "numbers and lists of them only (no pickle)"
                )
            kinds[key] = kind
        state_meta[name] = kinds
    groups = []
    for g, group in enumerate(optimizer.state_dict()["param_groups"]):
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        start = sum(len(x["params"]) for x in optimizer.param_groups[:g])
        groups.append({
            "params": names[start:start + len(group["params"])],
            "hyper": encode(hyper, f"{prefix}groups/{g}", tensors),
        })
    meta = {
        "class": class_name(optimizer),
        "groups": groups,
        "params": [
            {"name": n, "shape": list(p.shape), "dtype": format_of_dtype(p.dtype).tag}
            for n, p in zip(names, params)
        ],
        "state": state_meta,
    }
    if trees:
        meta["state_trees"] = trees
    return meta


# ---------------------------------------------------------------------------------- loading


def _rule(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], param: torch.Tensor,
          shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]] | None:
    """The state torch's own optimizers create for ``param`` (of ``shape``) on their first
    step."""
    from torch.optim.optimizer import _get_scalar_dtype

    cls = type(optimizer)
    dtype = param.dtype
    step = ("tensor", (), _get_scalar_dtype(is_fused=group.get("fused")))
    moment = ("tensor", shape, dtype)
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        rule = {"step": step, "exp_avg": moment, "exp_avg_sq": moment}
        if group.get("amsgrad"):
            rule["max_exp_avg_sq"] = moment
        return rule
    if cls is torch.optim.SGD:
        return {"momentum_buffer": moment} if group.get("momentum") else {}
    if cls is torch.optim.RMSprop:
        rule = {"step": step, "square_avg": moment}
        if group.get("momentum", 0) > 0:
            rule["momentum_buffer"] = moment
        if group.get("centered"):
            rule["grad_avg"] = moment
        return rule
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        from .torch_source import bit_view

        return bool(torch.equal(bit_view(a.detach().cpu()), bit_view(b.detach().cpu())))
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()!r}, {value.dtype})" if value.numel() <= 8 else "tensor"
    return repr(value)


class PreparedOptimizer:
    """A validated optimizer state, ready to install with :meth:`install`."""

    def __init__(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any],
                 tensor_names: set[str]) -> None:
        self.optimizer = optimizer
        self.state_dict = state_dict
        self.tensor_names = tensor_names

    def install(self) -> None:
        self.optimizer.load_state_dict(self.state_dict)


def prepare(
    optimizer: torch.optim.Optimizer,
    names: list[str],
    meta: Any,
    prefix: str,
    file_layout: Layout,
    read: Callable[[str, Any], Any],
    lookup: Callable[[str, str], Any],
    *,
    scheduled: Collection[str] = SCHEDULED,
) -> PreparedOptimizer:
    """Check the file's optimizer against the live one; raise one LayoutError listing every
    difference, or return new state ready to install. ``read(name, device)`` gives a new torch
    tensor with its digest verified; ``lookup`` resolves the tensors of metadata trees."""
    diffs: list[Difference] = []
    if not isinstance(meta, dict) or not isinstance(meta.get("groups"), list):
        raise CheckpointError("the checkpoint's optimizer metadata is malformed")
    if meta.get("class") != class_name(optimizer):
        diffs.append(Difference("optimizer class", None, class_name(optimizer), meta.get("class")))
        raise layout_error(diffs, "optimizer")
    params = _params(optimizer)
    by_name = dict(zip(names, params))
    _check_params(meta.get("params"), names, params, diffs)
    shapes = _shapes(meta["params"], names, params)
    groups = meta["groups"]
    live_groups = optimizer.param_groups
    if len(groups) != len(live_groups):
        diffs.append(Difference("param group count", None, len(live_groups), len(groups)))
        raise layout_error(diffs, "optimizer")
    start = 0
    for g, (fg, lg) in enumerate(zip(groups, live_groups)):
        want = names[start:start + len(lg["params"])]
        start += len(lg["params"])
        if not isinstance(fg, dict) or fg.get("params") != want:
            got = fg.get("params") if isinstance(fg, dict) else fg
            diffs.append(Difference("group parameters", f"group {g}", want, got))
    if diffs:
        raise layout_error(diffs, "optimizer")

    # hyperparameters: decoded (hyper tensors read here), then compared
    new_groups: list[dict[str, Any]] = []
    for g, (fg, lg) in enumerate(zip(groups, optimizer.state_dict()["param_groups"])):
        hyper = decode(fg.get("hyper"), lookup, f"optimizer group {g}")
        if not isinstance(hyper, dict):
            raise CheckpointError(f"optimizer group {g}: malformed hyperparameters")
        live = {k: v for k, v in lg.items() if k not in ("params", "param_names")}
        new = dict(lg)
        restored = set(scheduled)
        if "max_momentum" in live and "max_momentum" in hyper:
            restored |= set(CYCLED)
        for key in sorted(set(hyper) | set(live)):
            label = f"group {g} {key}"
            if key in restored:
                if key not in hyper:
                    continue  # the file never had it (no scheduler then): keep the live value
                value = hyper[key]
                if key in live and isinstance(live[key], torch.Tensor):
                    if not isinstance(value, torch.Tensor):
                        diffs.append(Difference("hyperparameter", label, "a tensor", _show(value)))
                        continue
                    value = value.to(live[key].device)
                new[key] = value
            elif key not in hyper:
                diffs.append(Difference("hyperparameter", label, _show(live[key]), "missing"))
            elif key not in live:
                diffs.append(Difference("hyperparameter", label, "missing", _show(hyper[key])))
            elif not _same(live[key], hyper[key]):
                diffs.append(Difference("hyperparameter", label, _show(live[key]),
                                        _show(hyper[key])))
        new_groups.append(new)

    # per-parameter state: expected from the live state, else from torch's rules
    live_state = _live_state(optimizer, names)
    file_state = meta.get("state")
    if not isinstance(file_state, dict):
        raise CheckpointError("the checkpoint's optimizer state metadata is malformed")
    for name in file_state:
        if name not in by_name:
            diffs.append(Difference("extra", f"{prefix}state/{name}", None, "state of a parameter "
                                    "the optimizer does not have"))
    expected_specs: list[tuple[str, tuple[int, ...], ScalarFormat]] = []
    kinds: dict[str, dict[str, str]] = {}
    trees = meta.get("state_trees", {})
    if not isinstance(trees, dict):
        raise CheckpointError("the checkpoint's optimizer state trees are malformed")
    group_of = {n: lg for lg, fg in zip(live_groups, groups) for n in fg["params"]}
    for name in names:
        got = file_state.get(name, {})
        if not isinstance(got, dict):
            raise CheckpointError(f"optimizer state metadata of {name!r} is malformed")
        param = by_name[name]
        expect: Mapping[str, tuple[str, tuple[int, ...] | None, torch.dtype | None]] | None
        if name in live_state:
            expect = {k: (_kind(v), tuple(v.shape) if isinstance(v, torch.Tensor) else (),
                          v.dtype if isinstance(v, torch.Tensor) else None)
                      for k, v in live_state[name].items()}
        else:
            expect = _rule(optimizer, group_of[name], param, shapes[name])
            if not got:
                continue  # no state for this parameter (it never had a gradient)
            if expect is None:  # an optimizer lean_store has no rule for: trust the file
                expect = {k: (kind, None, None) for k, kind in got.items()}
        for key in sorted(set(expect) | set(got)):
            tname = f"{prefix}state/{name}/{key}"
            if key not in got:
                diffs.append(Difference("missing", tname, expect[key][0], None))
                continue
            if key not in expect:
                diffs.append(Difference("extra", tname, None, got[key]))
                continue
            kind, shape, dtype = expect[key]
            if got[key] != kind:
                diffs.append(Difference("kind", tname, kind, got[key]))
                continue
            if kind in _NUMBER_FORMATS:
                expected_specs.append((tname, (), get(_NUMBER_FORMATS[kind])))
            elif kind == "tree":  # its tensors as the file has them, all under its own name
                of_param = trees.get(name)
                tree = of_param.get(key) if isinstance(of_param, dict) else None
                if tree is None:
                    diffs.append(Difference("missing", tname, "its state tree", None))
                    continue
                for _, inner in tensor_names(tree):
                    if not inner.startswith(f"{tname}/") or inner not in file_layout:
                        diffs.append(Difference("missing", inner, "a tensor of " + tname, None))
                    else:
                        expected_specs.append((inner, file_layout[inner].shape,
                                               file_layout[inner].format))
            elif kind == "tensor":
                if shape is None or dtype is None:  # no expectation: the file's own
                    if tname in file_layout:
                        expected_specs.append((tname, file_layout[tname].shape,
                                               file_layout[tname].format))
                    else:
                        diffs.append(Difference("missing", tname, "a tensor", None))
                else:
                    expected_specs.append((tname, shape, format_of_dtype(dtype)))
        kinds[name] = {k: got[k] for k in got}
    stored = [e for e in file_layout if e.name.startswith(f"{prefix}state/")]
    actual = Layout.from_specs([(e.name, e.shape, e.format) for e in stored])
    diffs.extend(actual.diff(Layout.from_specs(expected_specs), order_matters=False))
    if diffs:
        raise layout_error(_unique(diffs), "optimizer state")

    # everything matches: read the state into new tensors
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        if name not in kinds or not kinds[name]:
            continue
        param = by_name[name]
        values: dict[str, Any] = {}
        for key, kind in kinds[name].items():
            tname = f"{prefix}state/{name}/{key}"
            if kind == "none":
                values[key] = None
            elif kind == "tree":  # torch's load_state_dict moves its tensors to the parameter
                values[key] = decode(trees[name][key], lookup, tname)
            elif kind == "tensor":
                live_value = live_state.get(name, {}).get(key)
                device = live_value.device if isinstance(live_value, torch.Tensor) else (
                    "cpu" if key == "step" else param.device)
                values[key] = read(tname, device)
            else:
                values[key] = read(tname, "cpu").item()
        state[index] = values
    return PreparedOptimizer(
        optimizer,
        {"state": state, "param_groups": new_groups},
        {e.name for e in stored},
    )


def _check_params(meta_params: Any, names: list[str], params: list[torch.Tensor],
                  diffs: list[Difference]) -> None:
    if not isinstance(meta_params, list):
        raise CheckpointError("the checkpoint's optimizer parameter list is malformed")
    if len(meta_params) != len(params):
        diffs.append(Difference("parameter count", None, len(params), len(meta_params)))
    for i, (name, p) in enumerate(zip(names, params)):
        if i >= len(meta_params):
            diffs.append(Difference("missing", name, f"parameter {i}", None))
            continue
        item = meta_params[i] if isinstance(meta_params[i], dict) else {}
        if item.get("name") != name:
            diffs.append(Difference("parameter name", f"parameter {i}", name, item.get("name")))
        if is_uninitialized(p):
            pass  # a lazy module's: it takes the shape the model's load gives it
        elif item.get("shape") != list(p.shape):
            diffs.append(Difference("shape", name, list(p.shape), item.get("shape")))
        if item.get("dtype") != format_of_dtype(p.dtype).tag:
            tag = format_of_dtype(p.dtype).tag
            diffs.append(Difference("format", name, tag, item.get("dtype")))


def _shapes(meta_params: list[Any], names: list[str], params: list[torch.Tensor]
            ) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape; a lazy module's uninitialized parameter has none yet and takes
    the stored one (which the model's load checks and gives it)."""
    out = {}
    for name, p, item in zip(names, params, meta_params):
        if not is_uninitialized(p):
            out[name] = tuple(p.shape)
            continue
        shape = item.get("shape") if isinstance(item, dict) else None
        if not (isinstance(shape, list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                        for n in shape)):
            raise CheckpointError(f"the checkpoint's optimizer shape of {name!r} is malformed")
        out[name] = tuple(shape)
    return out


def _unique(diffs: list[Difference]) -> list[Difference]:
    seen, out = set(), []
    for d in diffs:
        key = (d.kind, d.name, str(d.expected), str(d.actual))
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


__all__ = ["SCHEDULED", "PreparedOptimizer", "describe", "param_names", "prepare"]
