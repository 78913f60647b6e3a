"""Rules that turn several learners' outer gradients for one tensor into one.

- `mean`: the plain average (DiLoCo).
- `weighted`: the average weighted by each learner's weight (token-weighted merging).
- `rda`: radial-directional averaging: the weighted mean norm along the weighted mean direction,
  Δ = (Σ w‖Δ_m‖ / Σ w) · unit(Σ w·unit(Δ_m)). Plain averaging of nearly orthogonal updates shrinks
  them by about 1/√M; RDA keeps the norm so η need not be re-tuned when M changes. Embedding tensors
  take the weighted mean instead: their deltas are not near-orthogonal. When the directions cancel
  out, the weighted mean is used too, since no direction is left to scale.

The arithmetic cannot overflow for finite inputs: a norm that overflows float32 is taken in float64, and weights are float64
(Python floats) that must sum to a finite total (the syncer caps each at a multiple of the typical one).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch

MergeRule = Literal["mean", "weighted", "rda"]
MERGE_RULES: tuple[str, ...] = ("mean", "weighted", "rda")
_CANCEL_TOLERANCE = 1e-6
"""Below this fraction of the summed weights, the directions are taken to have cancelled out."""


def _norm(tensor: torch.Tensor) -> float:
    """‖tensor‖: in float32 as DiLoCo runs always took it (bit for bit), in float64 where that overflows."""
    norm = float(torch.linalg.vector_norm(tensor.to(torch.float32)))
    return norm if math.isfinite(norm) else float(torch.linalg.vector_norm(tensor, dtype=torch.float64))


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    total = float(sum(weights))
    out = torch.zeros_like(deltas[0], dtype=torch.float32)
    for delta, w in zip(deltas, weights):
        out.add_(delta.to(torch.float32), alpha=w / total)
    return out


def radial_directional(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    total = float(sum(weights))
    direction = torch.zeros_like(deltas[0], dtype=torch.float32)
    radius = 0.0
    for delta, w in zip(deltas, weights):
        norm = _norm(delta)
        radius += w * norm / total
        if norm > 0:
            direction.add_(delta.to(torch.float32), alpha=w / norm)
    length = _norm(direction)
    if length <= _CANCEL_TOLERANCE * total:
        return weighted_mean(deltas, weights)
    return direction.mul_(radius / length)


def merge_fragment(deltas: Sequence[dict[str, torch.Tensor]], weights: Sequence[float], rule: MergeRule,
                   embeddings: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Merge each tensor of a fragment over the learners that pushed it."""
    if not deltas:
        raise ValueError("nothing to merge")
    if len(deltas) != len(weights) or any(w < 0 for w in weights) or not 0 < sum(weights) < math.inf:
        raise ValueError(f"merge needs one non-negative weight per push with a positive sum, got {list(weights)}")
    if rule == "mean":
        weights = [1.0] * len(deltas)
    merged = {}
    for name in deltas[0]:
        tensors = [d[name] for d in deltas]
        use_rda = rule == "rda" and name not in embeddings
        merged[name] = radial_directional(tensors, weights) if use_rda else weighted_mean(tensors, weights)
    return merged
