"""A learner's checkpoint state copied into one flat buffer per dtype, so that saving it costs about what
its bytes cost.

`torch.save` pays a fixed Python cost for every tensor it pickles: a learner's model and AdamW state are
three tensors per parameter plus a step count each, and for the built-in model that fixed cost was three
quarters of a checkpoint's serialisation (13.7 ms against 3.2 ms for the same bytes as one tensor). The
training thread already copies the state once before the write (so training can go on); `packed_copy`
makes that copy into one buffer per dtype and leaves, in the tensors' places, a reference (dtype,
offset, shape). `unpacked` turns a loaded state back into the same nested values, each tensor a view of
its buffer, after checking every reference against the buffers: a file is a claim to check, even a
sealed one. A state saved before this layout (no `PACKED` key) loads as it was written.

Tensors off the CPU (a GPU learner's) are cloned where they are, as before: copying them to the host
would move the device-to-host transfer onto the training thread. A value the copy computes (`Deferred`: a
learner's unpushed progress, anchor − θ) is written into the buffer as it is computed: the copy is then one
pass over it rather than a subtraction into a new tensor and a second copy of that.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

PACKED = "diloco.packed_state"
"""The key of a packed state's version; its value is `VERSION`."""
VERSION = 1
REF = "diloco.packed_tensor"
"""The one key of the dict that stands in a tensor's place: [dtype name, offset, shape]."""

_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}
_KEYS = {t: key for key, t in _DTYPES.items()}


class Deferred(Protocol):
    """A value computed as the copy is made (`core/own_progress.Unpushed`): written into its place in the
    buffer by `fill_into`, so the copy costs one pass over it, not two."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def fill_into(self, out: torch.Tensor) -> None: ...


def packed_copy(state: Any) -> dict[str, Any]:
    """A copy of `state` (nested dicts, lists, tuples; tensors, `Deferred` values and plain values) that
    training can no longer change: every CPU tensor of a dtype in `_DTYPES` copied into that dtype's
    buffer (one `cat` each), each `Deferred` value written into it after them, others cloned."""
    tensors: dict[str, list[torch.Tensor]] = {}
    filled: dict[str, int] = {}
    deferred: dict[str, list[tuple[Deferred, list[Any]]]] = {}
    deferred_filled: dict[str, int] = {}

    def place(value: torch.Tensor | Deferred) -> dict[str, list[Any]]:
        key = _KEYS[value.dtype]
        n = math.prod(value.shape)
        if isinstance(value, torch.Tensor):
            offset = filled.get(key, 0)
            filled[key] = offset + n
            tensors.setdefault(key, []).append(value.reshape(-1))
            return {REF: [key, offset, list(value.shape)]}
        ref = [key, deferred_filled.get(key, 0), list(value.shape)]  # its offset past the tensors: set below
        deferred_filled[key] = ref[1] + n
        deferred.setdefault(key, []).append((value, ref))
        return {REF: ref}

    tree = _rebuilt(state, place)
    buffers = {}
    with torch.no_grad():  # a copy of values, never part of a graph
        for key in tensors.keys() | deferred.keys():
            before = filled.get(key, 0)
            buffer = torch.empty(before + deferred_filled.get(key, 0), dtype=_DTYPES[key])
            if key in tensors:
                torch.cat(tensors[key], out=buffer[:before])
            for value, ref in deferred.get(key, []):
                ref[1] += before
                value.fill_into(buffer[ref[1]:ref[1] + math.prod(value.shape)].view(value.shape))
            buffers[key] = buffer
    return {PACKED: VERSION, "buffers": buffers, "tree": tree}


def unpacked(state: Any) -> Any:
    """The nested state a `packed_copy` was made from, each tensor a view of its buffer; any other state as it
    is. Raises ValueError, naming what is wrong, for a reference that its buffers do not hold."""
    if not isinstance(state, dict) or PACKED not in state:
        return state
    if state[PACKED] != VERSION:
        raise ValueError(f"is packed in an unknown layout (version {state[PACKED]!r})")
    buffers = state.get("buffers")
    if not isinstance(buffers, dict) or not all(
            isinstance(k, str) and _DTYPES.get(k) is not None and isinstance(b, torch.Tensor) and b.dim() == 1
            and b.dtype == _DTYPES[k] for k, b in buffers.items()):
        raise ValueError("has packed buffers that are not one flat tensor of the dtype each names")

    def view(ref: Any) -> torch.Tensor:
        if not (isinstance(ref, list) and len(ref) == 3 and ref[0] in buffers and _is_count(ref[1])
                and isinstance(ref[2], list) and all(_is_count(d) for d in ref[2])):
            raise ValueError(f"has a malformed packed tensor reference {str(ref)[:80]!r}")
        key, offset, shape = ref
        n = math.prod(shape)
        if offset + n > buffers[key].numel():
            raise ValueError(f"has a packed tensor of {n} {key} values at offset {offset}, past its buffer's "
                             f"{buffers[key].numel()}")
        return buffers[key][offset:offset + n].view(shape)

    return _restored(state.get("tree"), view)


def _packs(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype in _KEYS and value.device.type == "cpu"
    return hasattr(value, "fill_into") and getattr(value, "dtype", None) in _KEYS


def _rebuilt(value: Any, place: Any) -> Any:
    if _packs(value):
        return place(value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _rebuilt(v, place) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuilt(v, place) for v in value)
    return value


def _restored(value: Any, view: Any) -> Any:
    if isinstance(value, dict):
        if REF in value and len(value) == 1:
            return view(value[REF])
        return {k: _restored(v, view) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_restored(v, view) for v in value)
    return value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 62
