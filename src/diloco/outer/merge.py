"""Rules that turn several learners' outer gradients for one tensor into one.

- `mean`: the plain average (DiLoCo).
- `weighted`: the average weighted by each learner's weight (token-weighted merging).
- `rda`: radial-directional averaging: the weighted mean norm along the weighted mean direction,
  Δ = (Σ w‖Δ_m‖ / Σ w) · unit(Σ w·unit(Δ_m)). Plain averaging of nearly orthogonal updates shrinks
  them by about 1/√M; RDA keeps the norm so η need not be re-tuned when M changes. Embedding tensors
  take the weighted mean instead: their deltas are not near-orthogonal. When the directions cancel
  out, the weighted mean is used too, since no direction is left to scale.

The merge is folded as pushes arrive (`MergeSums`): the syncer keeps these sums for a round, not the
pushes, so its memory does not grow with the number of learners. The list forms below fold a list.

The arithmetic cannot overflow for finite inputs: a norm that overflows float32 is taken in float64, and weights are float64
(Python floats) that must sum to a finite total (the syncer caps each at a multiple of the typical one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Callable, Literal, Sequence

import torch

from diloco.cache_chunks import Coded, Scaled, add_scaled, coded_of
from diloco.outer.buffers import NewTensor, fp32_like

MergeRule = Literal["mean", "weighted", "rda"]
Adder = Callable[[list[torch.Tensor | None], "torch.Tensor | Coded", list[float]], list[torch.Tensor]]
"""add(totals, delta, alphas): each total + alpha·delta (alpha·delta where the total is None)."""
GroupAdder = Callable[[list[torch.Tensor | None], list[Coded], list[list[float]]], "list[torch.Tensor] | None"]
"""add_group(totals, deltas, alphas): `Adder` of each delta in turn, in one go; None where it cannot, with
nothing written."""
MERGE_RULES: tuple[str, ...] = ("mean", "weighted", "rda")
CANCEL_TOLERANCE = 1e-6
"""Below this fraction of the summed weights, the directions are taken to have cancelled out."""


def tensor_norm(tensor: torch.Tensor) -> float:
    """‖tensor‖: in float32 as DiLoCo runs always took it (bit for bit), in float64 where that overflows."""
    norm = float(torch.linalg.vector_norm(tensor.to(torch.float32)))
    return norm if math.isfinite(norm) else float(torch.linalg.vector_norm(tensor, dtype=torch.float64))


WAIT_SHARE = 0.5
"""Coded pushes whose adds may wait for their round's close, in fp32 copies of their fragment's bytes: each
sum is then read and written once for all of them instead of once a push (a round of eight 4-bit pushes
makes two passes over its sums, not sixteen). Beyond it they are made at once: what they hold stays bounded
(`diloco plan` counts it, `plan/memory.py`)."""


@dataclass
class MergeSums:
    """Running sums of one round's outer gradients, per tensor: Σ w·Δ (weighted mean), Σ Δ (plain mean,
    kept only where asked), Σ w·Δ/‖Δ‖ and Σ w·‖Δ‖ (radial-directional). Each sum is replaced, never
    changed in place, so a caller's earlier reference stays as it was (the syncer's transactions)."""

    weighted: dict[str, torch.Tensor] = field(default_factory=dict)
    plain_sum: dict[str, torch.Tensor] = field(default_factory=dict)
    directions: dict[str, torch.Tensor] = field(default_factory=dict)
    radius: dict[str, float] = field(default_factory=dict)
    weight: float = 0.0
    """Σ w over the contributions."""
    count: int = 0
    """Contributions, for the plain mean."""
    waiting: list[tuple[str, Coded, tuple[str, ...], list[float]]] = field(default_factory=list)
    """Adds of coded pushes folded `later` and not yet made (tensor, push, which sums, alphas): `settle`."""

    def fold(self, deltas: Mapping[str, torch.Tensor], weight: float, *, radial: dict[str, float],
             weighted: bool = True, plain: bool = False, new: bool = True, own_norms: bool = False,
             add: Adder | None = None, later: bool = False) -> None:
        """Add one outer gradient with `weight`. `radial` names the tensors averaged radially, each with
        the norm that scales its direction (its own, or for a learner's later push, its first one's);
        `own_norms`: they are these deltas' own norms, not taken again. `new`: a contribution of its own,
        not more of one already in. `add(totals, delta, alphas)` adds to all of a tensor's sums at once,
        reading the delta once (default: into new tensors). `later`: a coded tensor's adds wait for `settle`
        (its weight and norm count now); the sums are not to be read until then."""
        add = add or _added
        for name in deltas:
            coded = coded_of(deltas, name)  # a push folded from its codes, never decoded
            delta = coded if coded is not None else deltas[name].to(torch.float32)
            keys: list[str] = []
            alphas: list[float] = []
            if weighted:
                keys.append("weighted"), alphas.append(weight)
            if plain:
                keys.append("plain_sum"), alphas.append(1.0)
            if name in radial:
                norm = radial[name] if own_norms else coded.norm() if coded is not None else tensor_norm(delta)
                self.radius[name] = self.radius.get(name, 0.0) + weight * norm
                if radial[name] > 0:
                    keys.append("directions"), alphas.append(weight / radial[name])
            if later and coded is not None:
                coded.norm()  # its codes checked now, as folding it would: a bad push is refused on its own
                self.waiting.append((name, coded, tuple(keys), alphas))
            else:
                self._put(name, keys, add([getattr(self, key).get(name) for key in keys], delta, alphas))
        if new:
            self.weight += weight
            self.count += 1

    def waiting_bytes(self) -> int:
        """The bytes of the pushes whose adds wait (`fold(later=True)`): their wire forms, held until `settle`."""
        return sum(coded.nbytes() for _, coded, _, _ in self.waiting)

    def settle(self, add: Adder, add_group: GroupAdder) -> None:
        """Make the adds waiting (`fold(later=True)`), each tensor's in the order they were folded: together
        where `add_group` can (each sum then read and written once for all of them), else one by one."""
        waiting, self.waiting = self.waiting, []
        by_name: dict[str, list[tuple[str, Coded, tuple[str, ...], list[float]]]] = {}
        for item in waiting:
            by_name.setdefault(item[0], []).append(item)
        for name, items in by_name.items():
            keys = items[0][2]
            if all(item[2] == keys for item in items):
                made = add_group([getattr(self, key).get(name) for key in keys], [item[1] for item in items],
                                 [item[3] for item in items])
                if made is not None:
                    self._put(name, keys, made)
                    continue
            for _, delta, keys, alphas in items:
                self._put(name, keys, add([getattr(self, key).get(name) for key in keys], delta, alphas))

    def _put(self, name: str, keys: Sequence[str], totals: list[torch.Tensor]) -> None:
        for key, total in zip(keys, totals):
            getattr(self, key)[name] = total

    def mean(self, name: str) -> Scaled:
        return Scaled(self.plain_sum[name], self.count, divide=True)

    def weighted_mean(self, name: str) -> Scaled:
        return Scaled(self.weighted[name], self.weight, divide=True)

    def radial_directional(self, name: str) -> Scaled:
        """The weighted mean norm along the weighted mean direction; the weighted mean where the
        directions cancel out."""
        direction = self.directions.get(name)
        length = tensor_norm(direction) if direction is not None else 0.0
        if length <= CANCEL_TOLERANCE * self.weight:
            return self.weighted_mean(name)
        return Scaled(direction, self.radius[name] / self.weight / length)

    def merged_lazily(self, names: Sequence[str], rule: MergeRule,
                      embeddings: set[str] | frozenset[str] = frozenset()) -> dict[str, Scaled]:
        """The round's merged outer gradient per tensor, not yet written: the outer step reads it a chunk
        at a time (`cache_chunks.Scaled`)."""
        if rule == "mean":
            return {name: self.mean(name) for name in names}
        return {name: self.radial_directional(name) if rule == "rda" and name not in embeddings
                else self.weighted_mean(name) for name in names}

    def merged(self, names: Sequence[str], rule: MergeRule, embeddings: set[str] | frozenset[str] = frozenset(),
               new: NewTensor = fp32_like) -> dict[str, torch.Tensor]:
        """The round's merged outer gradient per tensor, each a new tensor from `new`."""
        return {name: m.whole(new(m.tensor)) for name, m in self.merged_lazily(names, rule, embeddings).items()}

    def tensors(self) -> list[torch.Tensor]:
        return [*self.weighted.values(), *self.plain_sum.values(), *self.directions.values()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def plain(self) -> dict:
        if self.waiting:
            raise RuntimeError("a round's sums were read with adds still waiting: settle them first")
        return {"weighted": dict(self.weighted), "plain_sum": dict(self.plain_sum),
                "directions": dict(self.directions), "radius": dict(self.radius), "weight": self.weight,
                "count": self.count}

    @classmethod
    def of(cls, plain: dict) -> MergeSums:
        return cls(dict(plain["weighted"]), dict(plain["plain_sum"]), dict(plain["directions"]),
                   dict(plain["radius"]), float(plain["weight"]), int(plain["count"]))


def _added(totals: list[torch.Tensor | None], delta: torch.Tensor | Coded, alphas: list[float]) -> list[torch.Tensor]:
    """total + alpha·delta for each, as new tensors."""
    return add_scaled([torch.empty(delta.shape, dtype=torch.float32, device=delta.device) for _ in totals],
                      totals, delta, alphas)


def _check(count: int, weights: Sequence[float]) -> None:
    if not count:
        raise ValueError("nothing to merge")
    if count != len(weights) or any(w < 0 for w in weights) or not 0 < sum(weights) < math.inf:
        raise ValueError(f"merge needs one non-negative weight per push with a positive sum, got {list(weights)}")


def merge_fragment(deltas: Sequence[dict[str, torch.Tensor]], weights: Sequence[float], rule: MergeRule,
                   embeddings: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Merge each tensor of a fragment over the learners that pushed it, all at once."""
    _check(len(deltas), weights)
    sums = MergeSums()
    for delta, w in zip(deltas, weights):
        radial = {n: tensor_norm(t) for n, t in delta.items() if rule == "rda" and n not in embeddings}
        sums.fold(delta, w, radial=radial, weighted=rule != "mean", plain=rule == "mean")
    return sums.merged(list(deltas[0]), rule, embeddings)


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    return merge_fragment([{"t": d} for d in deltas], weights, "weighted")["t"]


def radial_directional(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    return merge_fragment([{"t": d} for d in deltas], weights, "rda")["t"]
