"""The delayed-Nesterov plain step as one compiled loop, where numba is installed (`diloco[fast]`), and the
distance of the new Θ from the old (a round's update norm) in one read.

Why: a syncer's round that does not complete its outer optimizer's period takes a plain step
(`delayed_nesterov.py`): g = the merged gradient, S ← S + s·g, Θ ← Θ − η·s·g. In torch that is three ops
per chunk (the merged gradient's scale, the add, the sub), each a pass over the chunk; with one push per
round that was a fifth of the round's CPU. One loop does the three while an element is in registers.

The values are torch's bit for bit: the scale is one rounded multiply (or divide), and the add and the sub
with an alpha are one fused multiply-add each, which is what torch's vectorized CPU kernels compute
(`steps_like_torch` checks it once against the torch of this process, and without it the torch ops run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

import numpy as np
import torch

import diloco.codecs.compiled as compiled


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the plain step over these (flat, fp32) tensors takes the compiled loop."""
    return (compiled.usable(tensors[0].numel(), *tensors) and all(t.dtype == torch.float32 for t in tensors)
            and steps_like_torch())


def plain_step(theta: torch.Tensor, source: torch.Tensor, factor: float, divide: bool, old: torch.Tensor,
               share: float, rate: float, total: torch.Tensor, target: torch.Tensor) -> None:
    """g = source·factor (source ÷ factor with `divide`); total = old + share·g; target = theta − rate·g, as
    `torch.mul`/`torch.div`, `torch.add(old, g, alpha=share)` and `torch.sub(theta, g, alpha=rate)` give
    them. All flat fp32 tensors of one length."""
    _kernels()["plain_step"](theta.numpy(), source.numpy(), np.float32(factor), divide, old.numpy(),
                             np.float32(share), np.float32(rate), total.numpy(), target.numpy())


def square_distance(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Σ (a − b)² of flat fp32 tensors in one read of each, no difference written: each difference rounded
    to fp32 as `torch.sub` rounds it, its square summed in float64. None where the loop does not take them."""
    if not (compiled.usable(a.numel(), a, b) and a.dtype == b.dtype == torch.float32 and a.is_contiguous()
            and b.is_contiguous() and a.numel() == b.numel()):
        return None
    return float(_kernels()["square_distance"](a.numpy(), b.numpy()))


def load_for(tensors: Iterable[torch.Tensor]) -> None:
    """Load numba and the step's loop now where one of `tensors` would take it: a syncer takes that memory
    (about 120 MB) as it starts, not at its first plain step mid-run, so its memory stays flat after."""
    if any(t.numel() >= compiled.MIN_ELEMENTS and t.dtype == torch.float32 for t in tensors):
        steps_like_torch()


@cache
def steps_like_torch() -> bool:
    """Whether `plain_step` gives torch's values bit for bit here, checked once (as `compiled_sums` checks
    its folds): the fused multiply-add is what torch computes wherever its CPU kernels are vectorized."""
    if not (compiled.is_enabled() and compiled.loaded()):
        return False
    generator = torch.Generator().manual_seed(0)
    numel = compiled.MIN_ELEMENTS + 37
    theta, source, old = (torch.randn(numel, generator=generator) for _ in range(3))
    factor, share, rate = 0.3712345, 0.2718281, 0.7 * 0.2718281
    for divide in (False, True):
        total, target = torch.empty(numel), torch.empty(numel)
        _kernels()["plain_step"](theta.numpy(), source.numpy(), np.float32(factor), divide, old.numpy(),
                                 np.float32(share), np.float32(rate), total.numpy(), target.numpy())
        g = torch.div(source, factor) if divide else torch.mul(source, factor)
        if not (torch.equal(total, torch.add(old, g, alpha=share))
                and torch.equal(target, torch.sub(theta, g, alpha=rate))):
            return False
    return True


@cache
def _kernels() -> dict[str, Callable[..., Any]]:
    import numba

    fusing = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", fastmath={"contract"})
    """g·share + old and theta − g·rate contracted into fused multiply-adds, as torch's add and sub with an
    alpha are; g itself is a product (or quotient) that feeds no add, so it stays rounded on its own."""

    @fusing
    def plain_step(theta, source, factor, divide, old, share, rate, total, target):  # type: ignore[no-untyped-def]
        if divide:
            for i in range(theta.shape[0]):
                g = source[i] / factor
                total[i] = g * share + old[i]
                target[i] = theta[i] - g * rate
        else:
            for i in range(theta.shape[0]):
                g = source[i] * factor
                total[i] = g * share + old[i]
                target[i] = theta[i] - g * rate

    summing = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", fastmath={"reassoc"})
    """A sum in any order, so that it vectorizes; each difference and square is still one rounded op."""

    @summing
    def square_distance(a, b):  # type: ignore[no-untyped-def]
        total = 0.0
        for i in range(a.shape[0]):
            difference = np.float64(a[i] - b[i])
            total += difference * difference
        return total

    return {"plain_step": plain_step, "square_distance": square_distance}
