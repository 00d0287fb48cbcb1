"""torch modules, state dicts and tensors as sources and targets of lean_store's words."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..chunking import Region
from ..encoded import Encoded
from ..errors import CheckpointError, FormatError, UnsupportedValueError
from ..formats import ScalarFormat, complex_of, get
from ..layout import Entry, Layout
from ..stream import CopyEngine
from .base import SourceTensor, TargetTensor, TensorSource, elements_overlap, overlap_refusal
from .meta_tensors import MetaTarget, is_meta, meta_entries
from .module_names import canonical_state
from .module_state import (
    check_own_memory,
    check_settable,
    hand_over,
    is_uninitialized,
    owners_in,
)
from .numpy_source import ArraySourceTensor, ArrayTarget, format_of_value, masked_entry
from .packed_fp4 import FORMAT as PACKED_FORMAT
from .packed_fp4 import is_packed, packed_tensor, unpacked, values_shape, write_words

_TAGS: dict[Any, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
              "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _TAGS[getattr(torch, _name)] = _name
_DTYPE_OF_TAG = {tag: dtype for dtype, tag in _TAGS.items()}
_UINT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def format_of_dtype(dtype: torch.dtype) -> ScalarFormat:
    """The lean_store format of a torch dtype (``torch.complex32`` is ``complex(float16)``)."""
    if dtype == torch.complex32:
        return complex_of(get("float16"))
    tag = _TAGS.get(dtype)
    if tag is None:
        raise FormatError(f"torch dtype {dtype} has no lean_store format")
    return get(tag)


_COMPLEX32 = complex_of(get("float16"))


def dtype_of_format(fmt: ScalarFormat) -> torch.dtype | None:
    if fmt == _COMPLEX32:
        return torch.complex32
    return _DTYPE_OF_TAG.get(fmt.tag)


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy holding its values where its memory does not (a lazy conjugate or
    negative view: ``x.conj()``, ``x.mH`` of a complex ``x``, holds ``x``'s words)."""
    if t.is_conj() or t.is_neg():
        return t.resolve_conj().resolve_neg()
    return t


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a signed-int tensor of equal width (complex: trailing axis of 2)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_UINT_VIEW[t.element_size()])


def _to_numpy_bits(t: torch.Tensor, fmt: ScalarFormat) -> np.ndarray:
    return t.numpy().view(fmt.storage_dtype)


class TorchCopyEngine(CopyEngine):
    """Device -> host copies into reusable host buffers (see :mod:`lean_store.stream`).

    On CUDA the buffers are pinned and each copy is non-blocking on a side stream (one per
    device, ordered after the work already queued on the caller's stream) with an event, so the
    next units copy while the current one is written. On other devices (or ``cuda=False``, as
    the CPU tests use) copies are plain and synchronous, still into the reused buffers.
    """

    def __init__(self, *, cuda: bool | None = None, pin: bool | None = None) -> None:
        self._cuda = torch.cuda.is_available() if cuda is None else cuda
        self._pin = self._cuda if pin is None else pin
        self._streams: dict[Any, Any] = {}

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def nbytes(self, tensor: TorchSourceTensor, region: Region) -> int:
        part = tensor._bits[region]
        return part.numel() * part.element_size()

    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def start(
        self, tensor: TorchSourceTensor, region: Region, buffer: torch.Tensor
    ) -> Callable[[], np.ndarray]:
        part = tensor._bits[region]
        dst = buffer[: part.numel() * part.element_size()].view(part.dtype).view(part.shape)
        fmt = tensor._fmt
        if self._cuda and part.device.type == "cuda":
            stream = self._side_stream(part.device)
            with torch.cuda.stream(stream):
                dst.copy_(part, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)

            def wait() -> np.ndarray:
                event.synchronize()
                return _to_numpy_bits(dst, fmt)

            return wait
        dst.copy_(part)
        words = _to_numpy_bits(dst, fmt)
        return lambda: words


class TorchSourceTensor(SourceTensor):
    stable_reads = True  # views of the tensor's memory, or fresh copies

    def __init__(
        self, tensor: torch.Tensor, fmt: ScalarFormat, engine: TorchCopyEngine | None = None
    ) -> None:
        tensor = resolved(tensor.detach())
        self._fmt = fmt
        self._bits = bit_view(tensor.reshape(1) if tensor.dim() == 0 else tensor)
        device = tensor.device  # a new torch.device object on every ask: asked once
        self.device = str(device)
        on_host = device.type == "cpu"
        self._host: np.ndarray | None = None  # host memory: the words as a numpy view, once
        if on_host:
            try:
                self._host = _to_numpy_bits(self._bits, fmt)
            except (RuntimeError, TypeError):  # memory numpy cannot view: sliced per region
                pass
        # device tensors are staged through the pooled host buffers of lean_store.stream
        if engine is None and not on_host:
            engine = TorchCopyEngine()
        self.stage_engine = engine

    def read(self, region: Region) -> np.ndarray:
        if self._host is not None:  # numpy slicing costs a fraction of torch's
            return np.ascontiguousarray(self._host[region])
        part = self._bits[region]
        if part.device.type != "cpu":
            part = part.to("cpu")
        return np.ascontiguousarray(_to_numpy_bits(part.contiguous(), self._fmt))


def state_dict_of(obj: Any) -> Mapping[str, Any]:
    """A module's ``state_dict()`` (persistent buffers in, non-persistent out), named without
    what wrappers add (:func:`unwrapped`, :mod:`.module_names`), or the mapping."""
    if isinstance(obj, torch.nn.Module):
        return canonical_state(unwrapped(obj).state_dict(keep_vars=False))
    if isinstance(obj, Mapping):
        return obj
    raise CheckpointError(f"cannot take torch state from a {type(obj).__name__}")


def unwrapped(module: Any) -> Any:
    """``module`` without its DistributedDataParallel or DataParallel wrappers (which name every
    tensor ``module.<name>``); any other object as it is."""
    parallel = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while isinstance(module, parallel):
        module = module.module
    return module


_QUANTIZED_HINT = (
    "lean_store stores plain tensors: save the float model (before quantize_dynamic / convert), "
    "or dequantize (t.dequantize()) and quantize again after loading"
)


def _is_quantized_state(state: Mapping[str, Any]) -> bool:
    return any(
        (isinstance(v, torch.Tensor) and v.is_quantized) or n.endswith("_packed_params")
        for n, v in state.items()
    )


def unsupported_entry(name: str, value: Any, state: Mapping[str, Any]) -> str | None:
    """Why state entry ``name`` cannot be stored as a tensor, and what to do; None if it can."""
    if is_uninitialized(value):
        return (
            f"state entry {name!r} is an uninitialized parameter or buffer of a lazy module "
            "(torch.nn.LazyLinear and the like): it has no shape and no data yet. Run a forward "
            "pass with a sample batch first, or load a checkpoint into the module with "
            "lean_store.load, which materializes it as torch's load_state_dict does"
        )
    if isinstance(value, torch.Tensor):
        if value.is_quantized:
            return f"state entry {name!r} is a quantized tensor ({value.dtype}); {_QUANTIZED_HINT}"
        if value.layout != torch.strided:
            return (
                f"state entry {name!r} is a sparse tensor ({value.layout}); lean_store stores "
                "dense tensors: save value.to_dense(), or its indices and values as separate "
                "tensors"
            )
        if _dispatches_itself(value):
            return (
                f"state entry {name!r} is {_a(type(value).__name__)}, a tensor subclass that "
                "handles torch's operations itself (as quantized, float8 or NF4 tensors do), so "
                "its values are not plain memory; lean_store stores plain tensors: save plain "
                "tensors of its values (a dequantized or full-precision copy) or its own inner "
                "tensors"
            )
        if value.is_nested:
            return (
                f"state entry {name!r} is a nested tensor; lean_store stores tensors of one "
                "shape: save its components (value.unbind()) or value.to_padded_tensor(0) "
                "with their lengths"
            )
        if value.device.type == "meta":
            return (
                f"state entry {name!r} is a meta tensor: it has a shape but no data. Save a "
                "materialized model. To load into meta tensors: lean_store.load into the module "
                "that holds them gives them CPU memory (one process), as does "
                "load_state_dict(lean_store.load_state(path, like=module), assign=True); a "
                "sharded load needs them materialized first (module.to_empty(device=...))"
            )
        return None
    if isinstance(value, (np.ndarray, Encoded)):
        return masked_entry(name, value)
    what = _a(type(value).__name__)
    if _is_quantized_state(state):
        return f"state entry {name!r} ({what}) belongs to a quantized module; {_QUANTIZED_HINT}"
    if name.rsplit(".", 1)[-1] == "_extra_state":
        return (
            f"state entry {name!r} is a module's extra state (get_extra_state() returned "
            f"{what}), not a tensor: make get_extra_state return a tensor, or save that state "
            "separately (e.g. with lean_store.save_training's trainer state)"
        )
    return (
        f"state entry {name!r} is {what}, not a tensor: save trainer state such as epochs and "
        "steps with lean_store.save_training, or leave it out of the state passed to save"
    )


def _dispatches_itself(value: torch.Tensor) -> bool:
    """A tensor subclass with a ``__torch_dispatch__`` of its own (a wrapper around other
    tensors: torchao's quantized and float8 tensors, NF4, FakeTensor), DTensor aside (the
    sharded path stores its local shards)."""
    if type(value).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return False
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is None or not isinstance(value, dtensor)


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def check_entries(state: Mapping[str, Any]) -> None:
    """:class:`UnsupportedValueError` naming the first entry of ``state`` that is not a
    storable tensor, before anything is written."""
    for name, value in state.items():
        why = unsupported_entry(name, value, state)
        if why is not None:
            raise UnsupportedValueError(why)


def _entry_format(name: str, value: Any) -> ScalarFormat:
    if is_packed(value):
        return PACKED_FORMAT
    if isinstance(value, torch.Tensor):
        try:
            return format_of_dtype(value.dtype)
        except FormatError as exc:
            raise FormatError(f"tensor {name!r}: {exc}") from None
    if isinstance(value, (np.ndarray, Encoded)):
        return format_of_value(name, value)
    raise UnsupportedValueError(f"state entry {name!r} is {_a(type(value).__name__)}, not a tensor")


def _entry_shape(value: Any) -> tuple[int, ...]:
    """The stored shape: a packed FP4 tensor's values, two a byte (:mod:`.packed_fp4`)."""
    return values_shape(tuple(value.shape)) if is_packed(value) else tuple(value.shape)


def value_format(name: str, value: Any) -> ScalarFormat:
    """The format of one state entry, refused as :func:`check_entries` refuses it in a state
    (a whole :class:`TorchSource` for one value costs ~30x more). For a sharded save's
    local shards: a packed FP4 tensor is refused there (its shards would split bytes)."""
    why = unsupported_entry(name, value, {name: value})
    if why is not None:
        raise UnsupportedValueError(why)
    if is_packed(value):
        raise FormatError(f"tensor {name!r}: float4_e2m1fn_x2 is stored by single-process "
                          "saves only, not as shards of a sharded save")
    return _entry_format(name, value)


def value_source(value: Any, fmt: ScalarFormat) -> SourceTensor:
    """One value's source, as :meth:`TorchSource.tensors` makes it (a device tensor gets an
    engine of its own)."""
    if isinstance(value, torch.Tensor):
        return TorchSourceTensor(value, fmt)
    return ArraySourceTensor(value, fmt)


class TorchSource(TensorSource):
    def __init__(self, obj: Any, *, meta_ok: bool = False) -> None:
        """``meta_ok``: meta tensors count as the tensors they describe (a load's template,
        ``like=``), not refused; such a source has a layout but no words to save."""
        state = state_dict_of(obj)
        check_entries({n: v for n, v in state.items() if not meta_ok or not is_meta(v)})
        self._values = dict(state)
        self.layout = Layout.from_specs(
            [(n, _entry_shape(v), _entry_format(n, v)) for n, v in self._values.items()]
        )

    def tensors(self) -> Iterator[tuple[Entry, SourceTensor]]:
        engine = None  # one engine (side streams) shared by the device tensors of this walk
        for entry in self.layout:
            value = self._values[entry.name]
            if is_packed(value):
                value = unpacked(value)  # its FP4 values, one a byte
            if isinstance(value, torch.Tensor):
                on_host = value.device.type == "cpu"
                if not on_host and engine is None:
                    engine = TorchCopyEngine()
                yield entry, TorchSourceTensor(value, entry.format, None if on_host else engine)
            else:
                yield entry, ArraySourceTensor(value, entry.format)


class TorchTarget(TargetTensor):
    def __init__(self, entry: Entry, tensor: torch.Tensor) -> None:
        self.entry = entry
        tensor = tensor.detach()
        if tensor.is_conj() or tensor.is_neg():
            raise UnsupportedValueError(
                f"cannot load tensor {entry.name!r} into a lazy "
                f"{'conjugate' if tensor.is_conj() else 'negative'} view (its memory holds other "
                "values than it shows): load into the tensor it views, or into a tensor of its "
                "own (view.resolve_conj() / view.resolve_neg())")
        if not tensor.is_contiguous() and elements_overlap(
                tuple(tensor.shape), [s * tensor.element_size() for s in tensor.stride()],
                tensor.element_size()):
            raise UnsupportedValueError(overlap_refusal(entry.name))
        self._bits = bit_view(tensor.reshape(1) if tensor.dim() == 0 else tensor)

    def memory(self) -> tuple[Any, ...] | None:
        t = self._bits
        if t.numel() == 0:
            return None
        size = t.element_size()
        return (t.untyped_storage().data_ptr() + t.storage_offset() * size, tuple(t.shape),
                tuple(s * size for s in t.stride()), self.entry.format.tag, str(t.device))

    def write(self, region: Region, bits: np.ndarray) -> None:
        dst = self._bits[region]
        out = _numpy_view(dst) if dst.device.type == "cpu" else None
        if out is not None:
            # numpy's copy: one thread, no hand-off. torch's copy_ splits bigger tensors over
            # its intra-op threads, which on a busy machine made the install 5-50x slower
            # (216 MB of an LLM-like state: 24-76 ms with numpy, 0.1-6.5 s with copy_)
            np.copyto(out, np.ascontiguousarray(bits).view(out.dtype).reshape(out.shape))
            # written behind autograd's back: counted as the in-place change it is, so that a
            # graph that saved the old values fails at backward (as after torch's copy_ or
            # load_state_dict) instead of computing gradients from the new ones
            _increment_version(self._bits)
            return
        src = torch.from_numpy(np.ascontiguousarray(bits).view(_np_int(bits.dtype.itemsize)))
        with torch.no_grad():
            if dst.device.type == "cuda":
                # through a pinned buffer, non-blocking on the current stream: the upload of this
                # unit overlaps reading the next one; torch's caching host allocator keeps the
                # buffer until the copy has run, and reuses it after
                pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                pinned.copy_(src)
                dst.copy_(pinned.reshape(dst.shape), non_blocking=True)
            else:
                dst.copy_(src.reshape(dst.shape), non_blocking=False)


def _increment_version(t: torch.Tensor) -> None:
    bump = getattr(torch.autograd.graph, "increment_version", None)  # torch 2.1+
    if bump is not None:
        bump(t)


def _numpy_view(t: torch.Tensor) -> np.ndarray | None:
    """The same memory as a numpy array, or None where torch gives none (a tensor with its
    conjugate or negative bit set, a subclass refusing it): then torch copies."""
    try:
        return t.numpy()
    except (RuntimeError, TypeError):
        return None


def _np_int(itemsize: int) -> np.dtype:
    return np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize])


def torch_targets(obj: Any) -> dict[str, TargetTensor]:
    """In-place targets of a module's or a mapping's tensors. A module's extra state is handed
    to its ``set_extra_state`` after the load (:mod:`.module_state`), and an entry that is not
    the module's own memory is refused."""
    state = state_dict_of(obj)
    module = unwrapped(obj)
    lazy = {n for n, v in state.items() if is_uninitialized(v)}
    meta = meta_entries(module, state)  # see sources/meta_tensors.py
    memoryless = lazy | set(meta)  # given memory by the load
    check_entries({n: v for n, v in state.items() if n not in memoryless})
    extra = owners_in(module, state)
    if isinstance(module, torch.nn.Module):
        check_own_memory(module, {n: v for n, v in state.items() if n not in memoryless}, extra)
    layout = Layout.from_specs([(n, () if n in lazy else _entry_shape(v), _entry_format(n, v))
                                for n, v in state.items()])
    targets: dict[str, TargetTensor] = {}
    for entry in layout:
        value = state[entry.name]
        if entry.name in meta:
            targets[entry.name] = MetaTarget(entry, meta[entry.name], TorchTarget)
        elif entry.name in lazy:
            targets[entry.name] = UninitializedTarget(entry, value)
        elif is_packed(value):
            targets[entry.name] = PackedFp4Target(entry, value)
        elif entry.name in extra:
            targets[entry.name] = ExtraStateTarget(entry, extra[entry.name],
                                                   getattr(value, "device", None))
        elif isinstance(value, torch.Tensor):
            targets[entry.name] = TorchTarget(entry, value)
        elif isinstance(value, np.ndarray):
            targets[entry.name] = ArrayTarget(entry, value)
        else:
            raise CheckpointError(f"target {entry.name!r} is not writable in place")
    return targets


class ExtraStateTarget(TargetTensor):
    """A module's extra state: the stored tensor, whatever its shape and format (adopted from
    the checkpoint by :meth:`adopt`), collected and handed to ``owner.set_extra_state`` by
    :meth:`finish`, on the device of the module's current extra state."""

    takes_stored_entry = True

    def __init__(self, entry: Entry, owner: torch.nn.Module, device: Any) -> None:
        check_settable(owner, entry.name)
        self.entry = entry
        self._owner = owner
        self._device = device
        self._words: np.ndarray | None = None

    def adopt(self, entry: Entry) -> None:
        """The stored entry's shape and format (its name stays the target's)."""
        self.entry = Entry(self.entry.index, self.entry.name, entry.shape, entry.format)
        self._words = None

    def _buffer(self) -> np.ndarray:
        if self._words is None:
            fmt = self.entry.format
            shape = (self.entry.shape or (1,)) + ((2,) if fmt.words_per_value == 2 else ())
            self._words = np.empty(shape, dtype=fmt.storage_dtype)
        return self._words

    def write(self, region: Region, bits: np.ndarray) -> None:
        self._buffer()[region] = bits

    def finish(self) -> None:
        """Hand the loaded tensor to the module (after every tensor of the load is
        installed)."""
        value = new_tensor(self._buffer(), self.entry.format, self.entry.shape, self._device)
        hand_over(self._owner, self.entry.name, value)


class PackedFp4Target(TorchTarget):
    """A ``float4_e2m1fn_x2`` tensor, loaded from the FP4 values it holds (two a byte)."""

    def __init__(self, entry: Entry, tensor: torch.Tensor) -> None:
        super().__init__(entry, tensor)
        self._tensor = tensor.detach()

    def write(self, region: Region, bits: np.ndarray) -> None:
        write_words(self._tensor, region, bits)


class UninitializedTarget(TargetTensor):
    """A lazy module's uninitialized parameter or buffer: it takes the stored shape (its own
    dtype and device stay, checked like any target's) and is materialized with that shape
    just before its words are installed, as torch's ``load_state_dict`` materializes it."""

    takes_stored_entry = True

    def __init__(self, entry: Entry, value: Any) -> None:
        self.entry = entry
        self._value = value
        self._target: TorchTarget | None = None

    def adopt(self, entry: Entry) -> None:
        """The stored entry's shape; the format stays the parameter's own."""
        self.entry = Entry(self.entry.index, self.entry.name, entry.shape, self.entry.format)

    def _materialized(self) -> TorchTarget:
        if self._target is None:
            if is_uninitialized(self._value):
                self._value.materialize(self.entry.shape)
            self._target = TorchTarget(self.entry, self._value)
        return self._target

    def write(self, region: Region, bits: np.ndarray) -> None:
        self._materialized().write(region, bits)

    def finish(self) -> None:
        self._materialized()  # an empty tensor has no words to write


def extra_state_names(obj: Any, names: Any) -> set[str]:
    """Which of ``names`` (``obj``'s state's, lean_store's spelling) are extra state."""
    return set(owners_in(unwrapped(obj), names))


def new_tensor_like(bits: np.ndarray, fmt: ScalarFormat, shape: tuple[int, ...], like: Any
                    ) -> Any:
    """:func:`new_tensor` on ``like``'s device (the CPU for a meta tensor), or a packed FP4
    tensor of ``like``'s shape where ``like`` is one (``shape`` is then the values' shape)."""
    device = getattr(like, "device", None)
    if is_packed(like):
        return packed_tensor(bits, tuple(like.shape), None if _is_meta_device(device) else device)
    return new_tensor(bits, fmt, shape, device)


def new_tensor(bits: np.ndarray, fmt: ScalarFormat, shape: tuple[int, ...], device: Any) -> Any:
    """A new torch tensor holding ``bits`` exactly, or an ``Encoded`` if torch has no dtype;
    on ``device``, or on the CPU for the meta device (a template without memory: a meta
    model's ``like=``, an optimizer over meta parameters)."""
    dtype = dtype_of_format(fmt)
    if dtype is None:
        return Encoded(bits, fmt)
    words = torch.from_numpy(np.ascontiguousarray(bits).view(_np_int(bits.dtype.itemsize)))
    if dtype.is_complex:
        probe = torch.empty(0, dtype=dtype)
        real = words.view(torch.view_as_real(probe).dtype).reshape(shape + (2,))
        out = torch.view_as_complex(real.contiguous())
    else:
        out = words.view(dtype).reshape(shape)
    # ``bits`` is a fresh array owned by the caller, so the CPU tensor can share its memory.
    if device is None or getattr(device, "type", None) == "cpu" or str(device) == "cpu" \
            or _is_meta_device(device):
        return out
    return out.to(device)


def _is_meta_device(device: Any) -> bool:
    return getattr(device, "type", None) == "meta" or str(device) == "meta"


def _fits_on_devices(state: Mapping[str, Any]) -> bool:
    """True when every CUDA device has room (10 % to spare) for a copy of its tensors."""
    need: dict[Any, int] = {}
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            need[value.device] = need.get(value.device, 0) + value.numel() * value.element_size()
    for device, nbytes in need.items():
        free, _total = torch.cuda.mem_get_info(device)
        if nbytes > 0.9 * free:
            return False
    return True


def snapshot_state(obj: Any, mode: str) -> dict[str, Any]:
    """A frozen copy of a torch state: ``"device"`` clones each tensor where it lives, ``"host"``
    copies device tensors into host memory, ``"auto"`` picks ``"device"`` when it fits."""
    state = state_dict_of(obj)
    if mode == "auto":
        mode = "device" if _fits_on_devices(state) else "host"
    out: dict[str, Any] = {}
    devices = set()
    with torch.no_grad():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                t = value.detach()
                if t.device.type == "cuda":
                    devices.add(t.device)
                if mode == "host" and t.device.type != "cpu":
                    copy = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    copy.copy_(t)
                else:
                    copy = t.clone()
                out[name] = copy
            elif isinstance(value, np.ndarray):
                out[name] = value.copy()
            elif isinstance(value, Encoded):
                out[name] = Encoded(value.bits.copy(), value.format)
            else:
                out[name] = value
    for device in devices:  # the copies are complete before the caller may mutate the originals
        torch.cuda.current_stream(device).synchronize()
    return out
