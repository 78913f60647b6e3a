"""Building a sharded learner's model without any rank ever holding it whole.

The model is built on the meta device while every op that gives its tensors values is recorded; it is then
sharded, and each rank replays the record on the CPU, one tensor at a time, from the RNG state the build
started with, keeping only its own rows. The replay draws the random stream exactly as building the whole
model on the CPU does (the same ops on tensors of the same sizes, in the same order), so every rank's rows
are bit-identical to the unsharded model's for the same seed: a sharded learner that seeds Θ seeds the
same Θ as a one-process learner. A rank holds at most one whole tensor (plus its own rows), not the model.

A build the record cannot reproduce (a tensor computed from other tensors, random values drawn with a
generator of its own or off the meta device) is built whole instead, with one warning line that says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from diloco.client.param_shards import DTensor, rows_per_shard, shard_model

log = logging.getLogger("diloco.learner")

OVERWRITES = frozenset({"normal_", "uniform_", "zero_", "fill_", "random_", "bernoulli_", "exponential_",
                        "cauchy_", "log_normal_", "geometric_"})
"""In-place ops whose result does not depend on what the tensor held: what came before one is not kept."""


class Unreplayable(Exception):
    """The recorded build cannot be replayed exactly (the message says which tensor, and why)."""


@dataclass(frozen=True)
class _Op:
    """One op that gave a meta storage values: a creation (`view` None: its output is the storage) or an
    in-place op on a view of it."""

    func: Any
    key: int
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None
    args: tuple
    kwargs: dict[str, Any]
    dtype: torch.dtype
    elements: int
    seeded: bool
    covers: bool
    """It writes every element of the storage without reading any."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _elements(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


def _dense(t: torch.Tensor) -> bool:
    """Every element of its storage, each once (any order of dims)."""
    if t.storage_offset() != 0 or t.numel() != _elements(t):
        return False
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Recorder(TorchDispatchMode):
    """Notes, for every meta storage, the ops that gave it values; and why a storage's values are unknown
    (made from other tensors) or the random stream cannot be replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.unknown: dict[int, str] = {}
        self.problem: str | None = None
        self.rng: torch.Tensor | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        made_on = kwargs.get("device")
        if "device" in {s.name for s in func._schema.arguments if s.kwarg_only} and \
                (made_on is None or torch.device(made_on).type == "cpu"):
            # A CPU tensor made on the meta device instead: the build itself runs as on the CPU (a device
            # context would not: Hugging Face models skip their init under `torch.device("meta")`).
            out = func(*args, **{**kwargs, "device": torch.device("meta")})
        else:
            out = func(*args, **kwargs)
        self._note(func, args, kwargs, out)
        return out

    def _note(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        schema = func._schema.arguments
        written = [a for i, a in enumerate(args) if i < len(schema) and schema[i].alias_info is not None
                   and schema[i].alias_info.is_write] + \
            [kwargs[s.name] for s in schema if s.kwarg_only and s.name in kwargs and s.alias_info is not None
             and s.alias_info.is_write]
        if seeded and self.rng is None:
            self.rng = torch.get_rng_state()  # meta ops draw nothing: the state the build's first draw saw
        if seeded and kwargs.get("generator") is not None:
            self._refuse(f"{func} draws from a generator of its own")
        elif not inputs and isinstance(out, torch.Tensor):  # a new tensor from its arguments alone
            if out.device.type == "meta":
                self.unknown.pop(_key(out), None)
                self.ops.append(_Op(func, _key(out), None, args, kwargs, out.dtype, _elements(out), seeded, True))
            elif seeded:
                self._refuse(f"{func} draws random values on {out.device.type}, not on the meta device")
        elif len(written) == 1 and written[0] is args[0] and len(inputs) == 1:  # in place, from arguments alone
            t = args[0]
            if t.device.type != "meta":
                if seeded:
                    self._refuse(f"{func} draws random values on {t.device.type}, not on the meta device")
                return
            covers = func.overloadpacket.__name__ in OVERWRITES and _dense(t)
            if covers:
                self.unknown.pop(_key(t), None)
            self.ops.append(_Op(func, _key(t), (tuple(t.shape), tuple(t.stride()), t.storage_offset()), args[1:],
                                kwargs, t.dtype, _elements(t), seeded, covers))
        else:
            if seeded:
                self._refuse(f"{func} draws random values from other tensors")
            keys = {_key(a) for a in inputs}
            fresh = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and _key(o) not in keys]
            for t in [*written, *fresh]:
                self.unknown[_key(t)] = f"computed by {func} from other tensors"

    def _refuse(self, why: str) -> None:
        self.problem = self.problem or why


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by name, tied ones under each of their names."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


View = tuple[int, tuple[int, ...], tuple[int, ...], int]
"""A tensor as (its storage, size, stride, storage offset)."""


def _view(t: torch.Tensor) -> View:
    return _key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset()


@dataclass
class InitRecord:
    """How a model built on the meta device got its values, to be replayed into its own rows."""

    ops: list[_Op]
    rng: torch.Tensor | None
    views: dict[str, View]
    """Each parameter and buffer of the model as built, by name."""

    def fill(self, model: nn.Module) -> int:
        """Give every parameter and buffer of `model` (the recorded one, sharded and `to_empty`'d) its values:
        each rank its own rows of a sharded tensor, every rank all of a plain one. Returns the most bytes of
        whole tensors it held at once."""
        targets: dict[int, list[tuple[torch.Tensor, View]]] = {}
        for name, t in _tensors(model):
            targets.setdefault(self.views[name][0], []).append((t, self.views[name]))
        last = {op.key: i for i, op in enumerate(self.ops) if op.key in targets}
        overwritten_next, covering = [False] * len(self.ops), set()
        for i in range(len(self.ops) - 1, -1, -1):  # whether the next op on the same storage overwrites it
            op = self.ops[i]
            overwritten_next[i] = op.key in covering
            (covering.add if op.covers else covering.discard)(op.key)
        outside = torch.get_rng_state()
        if self.rng is not None:
            torch.set_rng_state(self.rng)
        live: dict[int, torch.Tensor] = {}
        peak = 0
        try:
            with torch.no_grad():
                for i, op in enumerate(self.ops):
                    kept = op.key in targets
                    if not kept and not op.seeded:
                        continue
                    live[op.key] = _apply(op, live.get(op.key))
                    peak = max(peak, sum(t.untyped_storage().nbytes() for t in live.values()))
                    if kept and last[op.key] == i:
                        for target, view in targets[op.key]:
                            _take_rows(target, live[op.key].as_strided(*view[1:]))
                    if not kept or last[op.key] == i or overwritten_next[i]:
                        del live[op.key]  # at most one whole tensor is alive at a time
        finally:
            torch.set_rng_state(outside)
        return peak


def _apply(op: _Op, base: torch.Tensor | None) -> torch.Tensor:
    """The op replayed on the CPU; returns the tensor whose storage holds the values."""
    if op.view is None:
        return op.func(*op.args, **{**op.kwargs, "device": torch.device("cpu")})
    if base is None:
        base = torch.empty(op.elements, dtype=op.dtype)
    op.func(base.as_strided(*op.view), *op.args, **op.kwargs)
    return base


def _take_rows(target: torch.Tensor, whole: torch.Tensor) -> None:
    """This rank's rows of `whole` (a sharded tensor's; all of it for a plain tensor) into `target`."""
    if DTensor is not None and isinstance(target, DTensor):
        local, mesh = target.to_local(), target.device_mesh
        rows = rows_per_shard(target.shape[0], mesh.size(mesh.ndim - 1))
        start = mesh.get_coordinate()[-1] * rows
        local.copy_(whole[start:start + local.shape[0]])
    else:
        target.copy_(whole)


def record_build(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """`build()` on the meta device, and how to give it its values; Unreplayable if that cannot be exact."""
    recorder = _Recorder()
    try:
        with recorder:
            model = build()
    except (RuntimeError, NotImplementedError) as exc:  # it reads values a meta tensor does not have
        raise Unreplayable(f"building it on the meta device failed ({str(exc).splitlines()[0][:200]})") from exc
    named, written = _tensors(model), {op.key for op in recorder.ops}
    for name, t in named:
        if t.device.type != "meta":
            raise Unreplayable(f"{name} was made on {t.device.type}, not on the meta device")
        why = recorder.unknown.get(_key(t)) or \
            (None if _key(t) in written else "made where it cannot be recorded")
        if why:
            raise Unreplayable(f"{name} is {why}")
    if recorder.problem:
        raise Unreplayable(recorder.problem)
    return model, InitRecord(recorder.ops, recorder.rng, {name: _view(t) for name, t in named})


def build_sharded(build: Callable[[], nn.Module], sharding: str, world: int,
                  device: torch.device | str = "cpu") -> nn.Module:
    """`build()`'s model, sharded as `sharding` says (fsdp or hsdp) over `world` ranks on `device`, each rank
    holding only its rows, the same values as the whole model built on the CPU. A build that cannot be
    replayed exactly is built whole first (one warning line)."""
    device = torch.device(device)
    try:
        model, record = record_build(build)
    except Unreplayable as why:
        log.warning("every rank builds the whole model before sharding it: %s", why)
        return shard_model(build().to(device), sharding, world, device.type)
    model = shard_model(model, sharding, world, device.type)
    model.to_empty(device=device)
    record.fill(model)
    return model
