"""Random number generator state: torch CPU and CUDA, numpy, Python ``random``, and named
``torch.Generator`` / ``numpy.random.Generator`` objects. No pickle: byte states become uint8
tensors, the rest JSON through :mod:`lean_store.statetree`.

Restoring is two-phase: :func:`prepare` decodes every state and tries it on a scratch generator
of the same kind (so a malformed state raises before anything changes); ``install`` then sets
the real generators.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, IntegrityError
from ..statetree import decode, encode

PREFIX = "rng/"


def generator_kind(gen: Any) -> str:
    if isinstance(gen, torch.Generator):
        return "torch"
    if isinstance(gen, np.random.Generator):
        return "numpy"
    if isinstance(gen, np.random.RandomState):
        return "numpy_legacy"
    if isinstance(gen, random.SystemRandom):
        raise CheckpointError(
            f"a {type(gen).__name__} has no state to save (it draws from the operating "
            "system); use a random.Random for a sequence that resumes")
    if isinstance(gen, random.Random):
        return "python"
    raise CheckpointError(
        f"cannot capture the state of a {type(gen).__name__}: pass torch.Generator, "
        "numpy.random.Generator, numpy.random.RandomState or random.Random objects"
    )


def generator_state(gen: Any) -> Any:
    kind = generator_kind(gen)
    if kind == "torch":
        return gen.get_state()
    if kind == "numpy":
        return gen.bit_generator.state
    if kind == "python":
        return gen.getstate()
    return gen.get_state()


def check_generator_state(gen: Any, state: Any, where: str) -> Callable[[], None]:
    """Try ``state`` on a scratch generator like ``gen``; return the installer."""
    kind = generator_kind(gen)
    try:
        if kind == "torch":
            torch.Generator(device=gen.device).set_state(state)
            return lambda: gen.set_state(state)
        if kind == "numpy":
            bit_name = type(gen.bit_generator).__name__
            if not isinstance(state, dict) or state.get("bit_generator") != bit_name:
                raise ValueError(f"the state is not for a {bit_name} bit generator")
            scratch = type(gen.bit_generator)()
            scratch.state = state

            def install() -> None:
                gen.bit_generator.state = state

            return install
        if kind == "python":
            random.Random().setstate(state)
            return lambda: gen.setstate(state)
        np.random.RandomState().set_state(state)
        return lambda: gen.set_state(state)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise IntegrityError(f"{where}: unusable generator state ({exc})") from None


def capture(tensors: dict[str, Any], generators: Mapping[str, Any] | None = None,
            *, global_state: bool = True) -> dict[str, Any]:
    """Metadata of the RNG states; byte states are added to ``tensors``."""
    meta: dict[str, Any] = {}
    if global_state:
        meta["torch_cpu"] = encode(torch.get_rng_state(), f"{PREFIX}torch_cpu", tensors)
        cuda = torch.cuda.get_rng_state_all() if _cuda_in_use() else []
        meta["torch_cuda"] = [
            encode(s, f"{PREFIX}torch_cuda/{i}", tensors) for i, s in enumerate(cuda)
        ]
        meta["numpy"] = encode(np.random.get_state(), f"{PREFIX}numpy", tensors)
        meta["python"] = encode(random.getstate(), f"{PREFIX}python", tensors)
    gens = {}
    for name, gen in (generators or {}).items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"generator names must be non-empty strings, got {name!r}")
        gens[name] = {
            "type": generator_kind(gen),
            "state": encode(generator_state(gen), f"{PREFIX}generators/{name}", tensors),
        }
    meta["generators"] = gens
    return meta


def prepare(meta: Any, lookup: Callable[[str, str], Any], generators: Mapping[str, Any] | None,
            *, global_state: bool = True) -> tuple[Callable[[], None], list[str]]:
    """Validate the stored states; return (install, what could not be restored)."""
    if not isinstance(meta, dict):
        raise IntegrityError("malformed RNG metadata")
    installers: list[Callable[[], None]] = []
    lost: list[str] = []
    stored_gens = meta.get("generators", {})
    if not isinstance(stored_gens, dict):
        raise IntegrityError("malformed RNG generator metadata")
    for name, gen in (generators or {}).items():
        item = stored_gens.get(name)
        if not isinstance(item, dict):
            raise CheckpointError(
                f"the checkpoint holds no state for generator {name!r}; it has "
                f"{sorted(stored_gens)}"
            )
        if item.get("type") != generator_kind(gen):
            raise CheckpointError(
                f"generator {name!r} was saved as {item.get('type')!r}, "
                f"not {generator_kind(gen)!r}"
            )
        state = decode(item.get("state"), lookup, f"generator {name!r}")
        installers.append(check_generator_state(gen, state, f"generator {name!r}"))
    if global_state:
        if "torch_cpu" in meta:
            state = decode(meta["torch_cpu"], lookup, "torch CPU RNG")
            installers.append(check_generator_state(torch.default_generator, state,
                                                    "torch CPU RNG"))
        else:
            lost.append("torch CPU RNG")
        installers.extend(_prepare_cuda(meta.get("torch_cuda"), lookup, lost))
        if "numpy" in meta:
            state = decode(meta["numpy"], lookup, "numpy RNG")
            check_generator_state(np.random.RandomState(), state, "numpy RNG")
            installers.append(functools.partial(np.random.set_state, state))
        else:
            lost.append("numpy RNG")
        if "python" in meta:
            state = decode(meta["python"], lookup, "python RNG")
            try:
                random.Random().setstate(state)
            except (TypeError, ValueError) as exc:
                raise IntegrityError(f"python RNG: unusable state ({exc})") from None
            installers.append(functools.partial(random.setstate, state))
        else:
            lost.append("python RNG")

    def install() -> None:
        for step in installers:
            step()

    return install, lost


def _cuda_in_use() -> bool:
    """CUDA generators matter once CUDA is initialized; before that none has been drawn from,
    and capturing them would start CUDA in a process that never used it."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _prepare_cuda(items: Any, lookup: Callable[[str, str], Any],
                  lost: list[str]) -> list[Callable[[], None]]:
    items = items or []
    if not isinstance(items, list):
        raise IntegrityError("malformed CUDA RNG metadata")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not items:
        if _cuda_in_use():
            lost.append("CUDA RNG (the checkpoint has none)")
        return []
    if available != len(items):
        lost.append(f"CUDA RNG (saved for {len(items)} devices, {available} here)")
        return []
    states = [decode(s, lookup, f"CUDA RNG {i}") for i, s in enumerate(items)]
    for i, s in enumerate(states):
        check_generator_state(torch.Generator(device=f"cuda:{i}"), s, f"CUDA RNG {i}")
    return [lambda: torch.cuda.set_rng_state_all(states)]


__all__ = ["capture", "check_generator_state", "generator_state", "prepare"]
