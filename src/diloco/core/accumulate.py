"""What a fragment's open round keeps per learner: a few numbers and a sample, not its pushes.

The syncer's memory must not grow with the number of learners, so a push is folded into its round's
running sums when it arrives and then dropped (`outer.merge.MergeSums`: Σ w·Δ for the weighted mean and
the final consolidation, Σ Δ for the plain mean, Σ w·Δ/‖Δ‖ and Σ w·‖Δ‖ for radial-directional averaging).
Per learner, a round keeps its counters, its weight and a fixed sample of its Δ (at most SAMPLE
coordinates), from which the round's cosine diagnostic is taken.

A push's weight is therefore fixed when it arrives (`closing.judged_weight`). A learner's second push in
the same round (only its final push can be one: a learner has one push of a fragment in flight) extends
its contribution: it is added with the weight, and for the direction the norm, of the learner's first.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from diloco.cache_chunks import coded_of
from diloco.core.messages import Push
from diloco.outer.merge import tensor_norm

NORMS_KEPT = 256
"""Tensors whose norm `norm_of` remembers: a few pushes' worth."""
_norms: dict[int, tuple[weakref.ref, int, float]] = {}


def norm_of(tensor: torch.Tensor) -> float:
    """`tensor_norm`, taken once per tensor: a push's deltas are read by the finite check (a norm is finite
    exactly when every element is), the outlier bound and the radial merge, one pass for all three.
    Θ's new values are measured as a round closes (their finite check), so the outlier bound's ‖Θ_p‖
    takes no pass of its own. Remembered by identity and version (a tensor written again, as the core's
    recycled buffers are, `scratch.py`, has a new version)."""
    hit = _norms.get(id(tensor))
    if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
        return hit[2]
    norm = tensor_norm(tensor)
    remember_norm(tensor, norm)
    return norm


def remember_norm(tensor: torch.Tensor, norm: float) -> None:
    """What `norm_of(tensor)` gives until the tensor is written again. A round's new Θ is measured as its
    step writes each chunk (`closing.next_theta`): its squares summed in float64, so it is finite exactly when
    every element is, and its last bits differ from a float32 norm's (it bounds outliers, nothing else)."""
    if len(_norms) >= NORMS_KEPT:
        _norms.clear()
    _norms[id(tensor)] = (weakref.ref(tensor), tensor._version, norm)


def delta_norm(deltas: Mapping[str, torch.Tensor], name: str) -> float:
    """`norm_of(deltas[name])`, from its codes where a push keeps them (`cache_chunks.coded_of`): a shard
    that folds pushes from their codes never decodes them."""
    coded = coded_of(deltas, name)
    return coded.norm() if coded is not None else norm_of(deltas[name])


def delta_shape(deltas: Mapping[str, torch.Tensor], name: str) -> torch.Size:
    coded = coded_of(deltas, name)
    return coded.shape if coded is not None else deltas[name].shape


SAMPLE = 4096
"""Coordinates per fragment kept of each contribution for the cosine: all of them in smaller fragments."""


@dataclass
class Contribution:
    """One learner's pushes in the open round of a fragment: its counters, weight and sample."""

    learner: int
    base_version: int
    tokens: int
    steps: int
    last_seq: int
    weight: float
    """Its token weight (capped, divided by staleness where that rule is on), fixed at its first push."""
    norms: dict[str, float]
    """‖Δ‖ per tensor of its first push: the scale of its direction in radial-directional averaging."""
    sample: torch.Tensor
    arrived: float = 0.0
    """When its latest push here arrived."""
    final: bool = False
    trip: float | None = None
    """Its latest push's arrival (our clock) less its sending (the learner's clock)."""
    answered: bool = True
    """Its latest push asks for an answer (`Push.answered`)."""

    def add(self, push: Push, now: float, sample: torch.Tensor) -> None:
        self.last_seq = max(self.last_seq, push.seq)
        self.base_version = min(self.base_version, push.base_version)
        self.tokens += push.tokens
        self.steps += push.steps
        self.sample = self.sample + sample
        self.arrived, self.trip = now, trip_of(push, now)
        self.final = self.final or push.final
        self.answered = push.answered

    def plain(self) -> dict:
        return {"learner": self.learner, "base_version": self.base_version, "tokens": self.tokens,
                "steps": self.steps, "last_seq": self.last_seq, "weight": self.weight, "norms": dict(self.norms),
                "sample": self.sample, "arrived": self.arrived, "final": self.final, "trip": self.trip,
                "answered": self.answered}


def trip_of(push: Push, now: float) -> float | None:
    return None if push.sent_at is None else now - push.sent_at


class Sampler:
    """The fixed coordinates of a fragment that stand for it in the cosine: evenly spaced over the
    fragment's tensors in order, every coordinate when there are at most SAMPLE."""

    def __init__(self, numels: dict[str, int]) -> None:
        total = sum(numels.values())
        stride = max(1, math.ceil(total / SAMPLE))
        self.indices: dict[str, torch.Tensor] = {}
        offset = 0
        for name, numel in numels.items():
            first = (-offset) % stride
            if first < numel:
                self.indices[name] = torch.arange(first, numel, stride)
            offset += numel

    def sample(self, deltas: Mapping[str, torch.Tensor]) -> torch.Tensor:
        parts = [coded.sample(index) if (coded := coded_of(deltas, name)) is not None
                 else deltas[name].reshape(-1)[index].to(torch.float64) for name, index in self.indices.items()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
