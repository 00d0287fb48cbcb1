"""TorchLean files <-> lean_store states and optimizer datasets.

* ``TLSF32B`` and JSON state files hold an ordered list of tensors with no names; imported
  tensors are named ``"0"``, ``"1"``, ... in file order, and exported in layout order.
* JSON state has one format tag for the whole file, so every tensor must share one format that
  TorchLean can name (binary floats and complex pairs of them); anything else is refused.
* A ``TLADAMF`` file becomes an ``optimizer`` checkpoint: float64 scalars ``hyper.beta1``,
  ``hyper.beta2``, ``hyper.eps``, ``hyper.weight_decay`` (bits exact), ``hyper.random_counter``
  (uint64, version 4), then per history-owning parameter, in file order, ``state.<id>.step``
  (uint64) and float32 ``state.<id>.exp_avg`` / ``state.<id>.exp_avg_sq`` (torch's names for
  Adam's m and v). The parameter schema (shapes, requiresGrad, alias tags), the version and the
  kind are kept as JSON in the root attribute ``torchlean_adam``. Export rebuilds the file
  byte for byte.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from ..errors import FormatError, IntegrityError
from ..formats import BinaryFormat, ComplexFormat, ScalarFormat, binary, complex_of, get
from ..layout import Layout
from .torchlean import (
    TLAdamEntry,
    TLAdamFile,
    TLAdamParam,
    TLState,
    decode_state_json,
    parse_tag,
    read_adam,
    read_sf32,
    write_adam,
    write_sf32,
)

ADAM_ATTR = "torchlean_adam"
_HYPER = ("beta1", "beta2", "eps", "weight_decay")


# ------------------------------------------------------------------------- format tags


def format_of_tag(tag: str) -> ScalarFormat:
    """The lean_store format of a TorchLean JSON state tag."""
    parsed = parse_tag(tag)
    if parsed.kind == "complex":
        assert parsed.component is not None
        return complex_of(format_of_tag(parsed.component.tag))
    if parsed.kind == "binary64":
        return get("float64")
    if parsed.kind == "float32":
        return get("float32")
    assert parsed.exponent_bits is not None and parsed.fraction_bits is not None
    return binary(
        parsed.exponent_bits, parsed.fraction_bits, bias=parsed.bias, encoding=str(parsed.encoding)
    )


def tag_of_format(fmt: ScalarFormat) -> str | None:
    """TorchLean's JSON state tag for ``fmt``, or None where TorchLean has none."""
    if isinstance(fmt, ComplexFormat) and isinstance(fmt.component, BinaryFormat):
        return fmt.torchlean_tag
    if isinstance(fmt, BinaryFormat):
        return fmt.torchlean_tag
    return None


# ------------------------------------------------------------------------- states


def state_from_sf32(path: str | os.PathLike | bytes) -> dict[str, np.ndarray]:
    """A ``TLSF32B`` file as an ordered ``{"0": float32 array, ...}`` mapping."""
    return {str(i): t for i, t in enumerate(read_sf32(path))}


def state_from_json(text: str | bytes) -> dict[str, Any]:
    """JSON state as an ordered mapping of names to numpy arrays / ``Encoded`` values."""
    from ..checkpoint import as_values

    state = decode_state_json(text)
    fmt = format_of_tag(state.tag)
    return {str(i): as_values(words, fmt) for i, words in enumerate(state.tensors)}


def json_unrepresentable(layout: Layout) -> list[str]:
    """Why ``layout`` cannot be one JSON state file (one line per problem), or []."""
    problems = [
        f"{e.name!r}: {e.format.tag} has no TorchLean tag" for e in layout
        if tag_of_format(e.format) is None
    ]
    if not problems:
        formats = sorted({e.format.tag for e in layout})
        if len(formats) > 1:
            problems.append(
                f"a JSON state file has one format tag, but the tensors use {len(formats)}: "
                f"{', '.join(formats)}"
            )
    return problems


def sf32_unrepresentable(layout: Layout) -> list[str]:
    return [
        f"{e.name!r}: {e.format.tag} is not float32" for e in layout if e.format != get("float32")
    ]


def state_json_of(layout: Layout, read_words: Any) -> TLState:
    """A :class:`TLState` of every tensor; refuses layouts TorchLean cannot hold."""
    problems = json_unrepresentable(layout)
    if problems:
        raise FormatError(
            "TorchLean JSON state cannot hold this checkpoint exactly:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    if not len(layout):
        raise FormatError("TorchLean JSON state needs at least one tensor to name its format")
    tag = tag_of_format(layout[0].format)
    assert tag is not None
    tensors = []
    for entry in layout:
        words = np.ascontiguousarray(read_words(entry))
        pair = (2,) if entry.format.words_per_value == 2 else ()
        tensors.append(words.reshape(entry.shape + pair))
    return TLState(tag, tensors)


def write_sf32_from(layout: Layout, read_words: Any, path: str | os.PathLike) -> None:
    problems = sf32_unrepresentable(layout)
    if problems:
        raise FormatError(
            "TorchLean TLSF32B files hold only float32 tensors (lean_store never casts):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    tensors = [
        np.ascontiguousarray(read_words(e)).view(np.float32).reshape(e.shape) for e in layout
    ]
    write_sf32(path, tensors)


# ------------------------------------------------------------------------- Adam


def adam_state(f: TLAdamFile) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The datasets and root attributes lean_store stores for a ``TLADAMF`` file."""
    state: dict[str, np.ndarray] = {}
    for name, bits in zip(_HYPER, f.hyper_bits):
        state[f"hyper.{name}"] = np.array(int(bits), dtype=np.uint64).view(np.float64)
    if f.random_counter is not None:
        state["hyper.random_counter"] = np.array(f.random_counter, dtype=np.uint64)
    for e in f.entries:
        state[f"state.{e.id}.step"] = np.array(e.step, dtype=np.uint64)
        state[f"state.{e.id}.exp_avg"] = e.m
        state[f"state.{e.id}.exp_avg_sq"] = e.v
    schema = {
        "version": f.version,
        "kind": f.kind,
        "params": [
            {"shape": list(p.shape), "requires_grad": bool(p.requires_grad), "alias": p.alias}
            for p in f.params
        ],
    }
    return state, {ADAM_ATTR: json.dumps(schema, separators=(",", ":"))}


def adam_from(layout: Layout, read_words: Any, root_attrs: dict[str, Any]) -> TLAdamFile:
    """Rebuild the ``TLADAMF`` file of an optimizer checkpoint made by :func:`adam_state`."""
    text = root_attrs.get(ADAM_ATTR)
    if not isinstance(text, str):
        raise FormatError(
            f"not a TorchLean Adam checkpoint: the root attribute {ADAM_ATTR!r} is missing "
            "(import a TLADAMF file to make one)"
        )
    try:
        schema = json.loads(text)
        version, kind = int(schema["version"]), schema["kind"]
        params = [
            TLAdamParam(tuple(p["shape"]), bool(p["requires_grad"]), p["alias"])
            for p in schema["params"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"malformed {ADAM_ATTR} attribute ({exc})") from None

    def scalar(name: str, fmt: str) -> int:
        if name not in layout or layout[name].format != get(fmt):
            raise IntegrityError(f"TorchLean Adam checkpoint lacks the {fmt} tensor {name!r}")
        return int(np.asarray(read_words(layout[name])).reshape(-1)[0])

    bits = tuple(scalar(f"hyper.{n}", "float64") for n in _HYPER)
    floats = [struct.unpack("<d", struct.pack("<Q", b))[0] for b in bits]
    counter = scalar("hyper.random_counter", "uint64") if version >= 4 else None
    entries = []
    for entry in layout:
        if entry.name.startswith("state.") and entry.name.endswith(".step"):
            pid = int(entry.name.split(".")[1])
            m_entry = layout[f"state.{pid}.exp_avg"]
            v_entry = layout[f"state.{pid}.exp_avg_sq"]
            m = np.ascontiguousarray(read_words(m_entry)).view(np.float32).reshape(m_entry.shape)
            v = np.ascontiguousarray(read_words(v_entry)).view(np.float32).reshape(v_entry.shape)
            entries.append(TLAdamEntry(pid, scalar(entry.name, "uint64"), m, v))
    return TLAdamFile(
        version=version, kind=kind, beta1=floats[0], beta2=floats[1], eps=floats[2],
        weight_decay=floats[3], hyper_bits=(bits[0], bits[1], bits[2], bits[3]),
        random_counter=counter, params=params,
        entries=entries,
    )


def write_adam_from(
    layout: Layout, read_words: Any, root_attrs: dict[str, Any], path: str | os.PathLike
) -> None:
    write_adam(path, adam_from(layout, read_words, root_attrs))


__all__ = [
    "ADAM_ATTR", "adam_from", "adam_state", "format_of_tag", "json_unrepresentable",
    "read_adam", "sf32_unrepresentable", "state_from_json", "state_from_sf32",
    "state_json_of", "tag_of_format", "write_adam_from", "write_sf32_from",
]
