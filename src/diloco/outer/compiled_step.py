"""The delayed-Nesterov steps as compiled loops, where numba is installed (`diloco[fast]`), and the
distance of the new Θ from the old (a round's update norm) in one read.

Why: a syncer's round takes a plain step (`delayed_nesterov.py`): g = the merged gradient, S ← S + s·g,
Θ ← Θ − η·s·g; and once its shares add up to a full round, the momentum step. In torch those are three
and seven ops per chunk, each a pass over the chunk; with one or two pushes per round they were half of a
round's CPU. One loop does them while an element is in registers, and says whether the state it wrote is
finite, so that no pass of its own checks it, and sums the update's squares and the new values' squares as
it writes them (the round's update norm and the new Θ's norm), so that no pass reads the chunk again.

The values are torch's bit for bit: the scale, and each product and sum that torch rounds on its own, is
one rounded op; the add and the sub with an alpha are one fused multiply-add each (`_fma`), which is what
torch's vectorized CPU kernels compute. `steps_like_torch` checks both loops once against the torch of
this process; without it the torch ops run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

import diloco.codecs.compiled as compiled


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the plain step over these (flat, fp32) tensors takes the compiled loop."""
    return (compiled.usable(tensors[0].numel(), *tensors) and all(t.dtype == torch.float32 for t in tensors)
            and steps_like_torch())


@dataclass(frozen=True)
class Stepped:
    """What a step's loop says of the chunk it wrote."""

    finite: bool
    """Whether the state it checks (the new sums, or the new momentum) is finite."""
    squares: tuple[float, float]
    """(Σ (target − theta)², Σ target²) in float64, as `squares` sums them: the update's distance and the new
    values' own norm, summed while each value was in a register (reading the chunk again after cost a third
    of the step). Meaningless where target is theta (a step in place)."""


def plain_step(theta: torch.Tensor, source: torch.Tensor, factor: float, divide: bool, old: torch.Tensor,
               share: float, rate: float, total: torch.Tensor, target: torch.Tensor) -> Stepped:
    """g = source·factor (source ÷ factor with `divide`); total = old + share·g; target = theta − rate·g, as
    `torch.mul`/`torch.div`, `torch.add(old, g, alpha=share)` and `torch.sub(theta, g, alpha=rate)` give
    them. All flat fp32 tensors of one length. `finite`: every total."""
    finite, distance, own = _kernels()["plain_step"](
        theta.numpy(), source.numpy(), np.float32(factor), divide, old.numpy(), np.float32(share),
        np.float32(rate), total.numpy(), target.numpy())
    return Stepped(bool(finite), (float(distance), float(own)))


def momentum_step(theta: torch.Tensor, source: torch.Tensor, factor: float, divide: bool, old: torch.Tensor,
                  share: float, momentum: float, old_momentum: torch.Tensor, lr: float, total: torch.Tensor,
                  new_momentum: torch.Tensor, target: torch.Tensor) -> Stepped:
    """The full round's step: with g as in `plain_step` and S = old + share·g, b = μ·old_momentum + S
    (two rounded ops, `torch.mul` then `add_`), target = theta − lr·(μ·b + share·g) and total = 0, as
    `DelayedNesterov._step_chunk` computes them. `finite`: every new momentum value."""
    finite, distance, own = _kernels()["momentum_step"](
        theta.numpy(), source.numpy(), np.float32(factor), divide, old.numpy(), np.float32(share),
        np.float32(momentum), old_momentum.numpy(), np.float32(lr), total.numpy(), new_momentum.numpy(),
        target.numpy())
    return Stepped(bool(finite), (float(distance), float(own)))


def square_distance(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Σ (a − b)² of flat fp32 tensors in one read of each, no difference written: each difference rounded
    to fp32 as `torch.sub` rounds it, its square summed in float64. None where the loop does not take them."""
    both = squares(a, b)
    return None if both is None else both[0]


def squares(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float] | None:
    """(Σ (a − b)², Σ a²), as `square_distance`, in the same read: a step's distance and its new values'
    squares (each a² in float64: finite exactly when every element is). None where the loop does not take them."""
    if not (compiled.usable(a.numel(), a, b) and a.dtype == b.dtype == torch.float32 and a.is_contiguous()
            and b.is_contiguous() and a.numel() == b.numel()):
        return None
    distance, own = _kernels()["squares"](a.numpy(), b.numpy())
    return float(distance), float(own)


def load_for(tensors: Iterable[torch.Tensor], steps: bool = True) -> None:
    """Load numba and the merge's loops now where one of `tensors` would take them (`steps`: the outer step's
    too): a syncer takes that memory (about 120 MB) and CPU as it starts, not mid-run, so its memory stays
    flat after and no round waits on a compiler."""
    if any(t.numel() >= compiled.MIN_ELEMENTS and t.dtype == torch.float32 for t in tensors):
        load_merge_loops(steps)


def load_merge_loops(steps: bool = True) -> None:
    """What the merge compiles in each process (the rest is cached on disk): the outer step's check (1.0 s of
    CPU here) and the group fold's check with its typed lists (0.6 s), which a shard otherwise made at its
    first group of pushes, under its lock, while its learners' pushes and answers waited."""
    import diloco.codecs.compiled_sums as compiled_sums

    if steps:
        steps_like_torch()
    if compiled.is_enabled():
        compiled_sums.groups_like_torch()


@cache
def steps_like_torch() -> bool:
    """Whether `plain_step` and `momentum_step` give torch's values bit for bit here, checked once (as
    `compiled_sums` checks its folds): the fused multiply-add is what torch computes wherever its CPU
    kernels are vectorized."""
    if not (compiled.is_enabled() and compiled.loaded()):
        return False
    generator = torch.Generator().manual_seed(0)
    numel = compiled.MIN_ELEMENTS + 37
    theta, source, old, old_momentum = (torch.randn(numel, generator=generator) for _ in range(4))
    factor, share, momentum, lr = 0.3712345, 0.2718281, 0.9, 0.7
    for divide in (False, True):
        g = torch.div(source, factor) if divide else torch.mul(source, factor)
        total, target, new_momentum = torch.empty(numel), torch.empty(numel), torch.empty(numel)
        stepped = plain_step(theta, source, factor, divide, old, share, lr * share, total, target)
        if not (torch.equal(total, torch.add(old, g, alpha=share))
                and torch.equal(target, torch.sub(theta, g, alpha=lr * share)) and _summed(stepped, target, theta)):
            return False
        stepped = momentum_step(theta, source, factor, divide, old, share, momentum, old_momentum, lr, total,
                                new_momentum, target)
        b = torch.mul(old_momentum, momentum).add_(torch.add(old, g, alpha=share))
        if not (torch.equal(new_momentum, b) and not total.any()
                and torch.equal(target, torch.sub(theta, torch.mul(b, momentum).add_(g, alpha=share), alpha=lr))
                and _summed(stepped, target, theta)):
            return False
    return True


def _summed(stepped: Stepped, new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether a step's squares are those of its values, to float64's rounding (summed in any order)."""
    distance = float(torch.sub(new, old).double().square().sum())
    own = float(new.double().square().sum())
    return stepped.finite and all(math.isclose(a, b, rel_tol=1e-9)
                                  for a, b in zip(stepped.squares, (distance, own)))


@cache
def _kernels() -> dict[str, Callable[..., Any]]:
    import numba
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def _fma(typing_context, a, b, c):  # type: ignore[no-untyped-def]
        """a·b + c rounded once (LLVM's fma), where torch fuses; every other fp32 op in the loops below is
        rounded on its own: their one fast-math flag, `reassoc`, lets the float64 sums be reordered (so that
        they vectorize), and no fp32 op of theirs is a chain of adds it could reorder, nor may a product and a
        sum be contracted without `contract`. `steps_like_torch` checks the values."""
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return builder.fma(*args)
        return types.float32(types.float32, types.float32, types.float32), codegen

    summing = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", fastmath={"reassoc"})
    """A sum in any order, so that it vectorizes; each difference and square is still one rounded op."""
    largest = np.float32(np.finfo(np.float32).max)

    @summing
    def plain_step(theta, source, factor, divide, old, share, rate, total, target):  # type: ignore[no-untyped-def]
        infinite = False
        distance = own = 0.0
        for i in range(theta.shape[0]):
            g = source[i] / factor if divide else source[i] * factor
            summed = _fma(g, share, old[i])
            total[i] = summed
            new = _fma(-g, rate, theta[i])
            target[i] = new
            infinite |= not abs(summed) <= largest  # NaN too
            difference, value = np.float64(new - theta[i]), np.float64(new)
            distance += difference * difference
            own += value * value
        return not infinite, distance, own

    @summing
    def momentum_step(theta, source, factor, divide, old, share, momentum, old_momentum, lr, total,  # type: ignore[no-untyped-def]
                      new_momentum, target):
        infinite = False
        distance = own = 0.0
        for i in range(theta.shape[0]):
            g = source[i] / factor if divide else source[i] * factor
            b = old_momentum[i] * momentum + _fma(g, share, old[i])
            new_momentum[i] = b
            new = _fma(-_fma(g, share, b * momentum), lr, theta[i])
            target[i] = new
            total[i] = 0.0
            infinite |= not abs(b) <= largest
            difference, value = np.float64(new - theta[i]), np.float64(new)
            distance += difference * difference
            own += value * value
        return not infinite, distance, own

    @summing
    def squares(a, b):  # type: ignore[no-untyped-def]
        total = own = 0.0
        for i in range(a.shape[0]):
            difference = np.float64(a[i] - b[i])
            value = np.float64(a[i])
            total += difference * difference
            own += value * value
        return total, own

    return {"plain_step": plain_step, "momentum_step": momentum_step, "squares": squares}
