"""The arithmetic of a round, apart from who decides when: a push's weight, the round's share, the new Θ.

A push is folded into its round's running sums as it arrives (`outer.merge.MergeSums`), so its weight is
fixed then: its token weight, at most WEIGHT_CAP × the typical weight (the lower median of its own, the
weights already in the round and the other learners' last known ones: one learner claiming a huge
batch cannot own a merge), divided by 1 + its staleness under the `inverse` rule. The new values of the
fragment and of its outer optimizer are computed into new tensors (the core's recycled buffers,
`scratch.py`), reading Θ and the optimizer's state without writing them, and checked finite before
anything is committed (`merging.py` commits them); if they are not, RoundRefused is raised.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from diloco.core.accumulate import Contribution, norm_of, remember_norm
from diloco.core.refusals import RoundRefused
from diloco.core.rounds import FragmentState, OuterOptimizer
from diloco.outer.buffers import NewTensor, fp32_like
import diloco.outer.compiled_step as compiled_step
from diloco.codecs.base import all_finite as tensor_finite
from diloco.outer.merge import MergeRule

WEIGHT_CAP = 16.0
"""Most a contribution may weigh, in typical weights. Honest pushes in the default runs weigh at most
4.2× the typical (learners at different speeds push different token counts): 16 leaves 4× margin."""


def judged_weight(state: FragmentState, contribution: Contribution, raw: float, last_weight: dict[int, float],
                  stale_weight: str, arriving: tuple[float, ...] = ()) -> float:
    """A contribution's weight in the merge: its token weight `raw`, capped against the typical weight
    of the others in the round (`arriving`: one not in yet) and of the learners absent from it
    (`last_weight`), lowered by staleness if asked."""
    others = [c.weight for m, c in state.pending.items() if m != contribution.learner]
    others += [w for m, w in last_weight.items() if m not in state.pending]
    pool = sorted([raw, *arriving, *others])
    weight = min(raw, WEIGHT_CAP * pool[(len(pool) - 1) // 2])
    if stale_weight == "inverse":
        weight /= 1 + state.version - contribution.base_version
    return weight


def participation_share(contributions: list[Contribution], last_weight: dict[int, float],
                        counted: Iterable[int]) -> float:
    """The round's weight over the weight of every learner `counted` (absent ones at their last known)."""
    present = {c.learner for c in contributions}
    known = list({**last_weight, **{c.learner: c.weight for c in contributions}}.values())
    typical = sum(known) / len(known)
    absent = sum(last_weight.get(m, typical) for m in set(counted) - present)
    weight = sum(c.weight for c in contributions)
    return weight / (weight + absent)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Every element of each finite (`codecs.base.all_finite`: one pass without a mask)."""
    return all(tensor_finite(t) for t in tensors)


def finite(tensor: torch.Tensor) -> bool:
    """Every element finite, from the tensor's norm where that is finite (`norm_of`: the outlier bound reads
    the same norm of a new Θ, so one pass serves both), else element by element (a norm of large finite
    values overflows float32)."""
    return math.isfinite(norm_of(tensor)) or all_finite([tensor])


DISTANCE_CHUNK = 1 << 18
"""Elements per piece of `distance`: a difference that stays in cache."""


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖, a piece at a time (torch.dist would write the whole difference to memory first): about one
    read of each. A float64 norm of each piece cost 1.6 ns per element here, six passes over memory."""
    return from_squares(squared_pieces(a.reshape(-1), b.reshape(-1)), a, b)


def squared_pieces(a: torch.Tensor, b: torch.Tensor) -> float:
    """Σ ‖a − b‖² over pieces of DISTANCE_CHUNK elements of flat `a` and `b` (from a multiple of it), each
    piece's norm in float32 and their squares summed in float64; where the compiled loop takes them, every
    square summed in float64 in one pass (`compiled_step.square_distance`: a metric's last bits differ)."""
    compiled = compiled_step.square_distance(a, b)
    return compiled if compiled is not None else _torch_pieces(a, b)


def step_squares(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(`squared_pieces(a, b)`, Σ a² in float64), while a step's chunk is in cache: where the compiled loop
    takes them, both from one read of each."""
    both = compiled_step.squares(a, b)
    if both is not None:
        return both
    return _torch_pieces(a, b), float(torch.linalg.vector_norm(a, dtype=torch.float64)) ** 2


def _torch_pieces(a: torch.Tensor, b: torch.Tensor) -> float:
    squares = 0.0
    for start in range(0, a.numel(), DISTANCE_CHUNK):
        stop = min(start + DISTANCE_CHUNK, a.numel())
        squares += float(torch.linalg.vector_norm(torch.sub(a[start:stop], b[start:stop]))) ** 2
    return squares


def from_squares(squares: float, a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ from `squared_pieces` summed over all of them; in float64 where that overflowed."""
    found = math.sqrt(squares)
    return found if math.isfinite(found) else float(torch.dist(a.double(), b.double()))


def next_theta(state: FragmentState, theta: dict[str, torch.Tensor], *, rule: MergeRule, embeddings: frozenset[str],
               share: float, consolidate: bool, new: NewTensor = fp32_like
               ) -> tuple[dict[str, torch.Tensor], OuterOptimizer, float]:
    """The fragment's Θ and outer optimizer after its open round, as new tensors from `new` (Θ and the
    optimizer's state are read, never written): the outer step, or with `consolidate` the weighted mean of
    the learners' models (Θ ← Θ − Δ̄); plus the correction waiting. Also the update's norm ‖Θ_new − Θ‖,
    read from each chunk of the step as it is written (`distance`'s pieces, the same value). Raises
    RoundRefused, with nothing changed, where either would not be finite: only what the step made is
    checked, the rest was before, and of that only what its compiled loops did not check as they wrote it."""
    names = list(state.fragment.names)
    after = {n: new(theta[n]) for n in names}
    optimizer, unchecked = state.optimizer, []
    pieces: dict[tuple[str, int], tuple[float, float, int]] = {}

    def written(name: str, start: int, stop: int, squares: tuple[float, float] | None) -> None:
        """On the thread that stepped the chunk: its squares as the step's loop summed them, else read now."""
        measured = squares or step_squares(after[name].view(-1)[start:stop], theta[name].reshape(-1)[start:stop])
        pieces[(name, start)] = (*measured, after[name]._version)

    if consolidate:
        for n in names:
            mean = state.sums.weighted_mean(n)
            torch.sub(theta[n], mean.whole(new(mean.tensor)), out=after[n])
    else:
        optimizer = state.optimizer.fork()
        unchecked = optimizer.step({n: theta[n] for n in names}, state.sums.merged_lazily(names, rule, embeddings),
                                   share, out=after, new=new, written=written if state.correction is None else None)
    if state.correction is not None:
        for n in names:
            after[n].add_(state.correction[n])
    if consolidate or state.correction is not None:
        update_norm = math.sqrt(sum(distance(after[n], theta[n]) ** 2 for n in names))
    else:
        squares, own, version = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), dict.fromkeys(names, -1)
        for name, start in sorted(pieces):  # in the chunks' order, whichever threads stepped them
            squares[name] += pieces[(name, start)][0]
            own[name] += pieces[(name, start)][1]
            version[name] = max(version[name], pieces[(name, start)][2])
        update_norm = math.sqrt(sum(from_squares(squares[n], after[n], theta[n]) ** 2 for n in names))
        for n in names:  # for the finite check below and the next outlier bound, if nothing wrote it since
            if version[n] == after[n]._version:
                remember_norm(after[n], math.sqrt(own[n]))
    if not (all(finite(t) for t in after.values()) and all_finite(unchecked)):
        raise RoundRefused(f"round {state.version + 1} of fragment {state.fragment.index} would make Θ or the "
                           f"outer optimizer's state non-finite: refused, nothing changed")
    return after, optimizer, update_norm


def corrected_theta(state: FragmentState, theta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fragment's Θ with the correction waiting for it; RoundRefused where that is not finite."""
    after = {n: theta[n] + state.correction[n] for n in state.fragment.names}
    if not all_finite(after.values()):
        raise RoundRefused(f"a correction of fragment {state.fragment.index} would make Θ non-finite: refused")
    return after
