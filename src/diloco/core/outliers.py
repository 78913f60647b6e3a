"""The outlier rule: how large a push may be, so that Θ only ever moves by a bounded, finite step.

A push's size is measured as ‖Δ‖/√steps (an outer gradient grows about as a random walk of its inner
steps: measured, this spreads honest pushes 2× less than the raw norm). Two bounds:

- a hard bound, the fragment's own scale, from the very first push: ‖Δ‖ ≤ THETA_RATIO·‖Θ_p‖ + FLOOR.
  A push above it is refused whatever the rule (unless the rule is `off`): no honest learner sends
  one. Measured in the default `diloco sim` (4 learners, 300k and 1.2M tokens): honest ‖Δ‖/‖Θ_p‖ has
  median 0.1 and peaks at 1.8 (fragment 0, the embeddings, in the first rounds); THETA_RATIO = 10
  leaves 5× margin.
- a soft bound, from the history: outlier_factor × a reference size × √steps. A push above it is
  clipped to it (rule `clip`, the default) or refused (`reject`). Each learner has one vote, the median
  of its last WINDOW accepted sizes; the reference is the lower median over the learners' votes, and
  may grow at most GROWTH× per accepted push. Only pushes accepted as they were enter the history
  (refused and clipped ones do not), so an insider cannot walk the bound up: with two learners the
  reference is the smaller vote, and with more the median stays between the honest votes whatever one
  learner pushes; with one learner it grows at most GROWTH× per push. Measured with the default runs,
  the largest honest size was 2.8× the reference (factor 5 leaves the margin).

Why clip by default: an honest push can be large for a reason (a learner restarted from its own
checkpoint, a burst of hard data), and a refused one is refused again with more progress in it each
time, so the learner would never be merged again. A clipped one moves Θ by at most the bound, and the
learner is told (`clipped`), logged, and takes the merged Θ with its next answer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

import torch

from diloco.core.accumulate import delta_norm
from diloco.core.messages import Push
from diloco.core.undo import UndoLog


THETA_RATIO = 10.0
"""Largest ‖Δ‖/‖Θ_p‖ a push may have (honest pushes: median 0.1, at most 1.8, measured)."""
FLOOR = 8.0
"""Added to the fragment-scale bound, so that a fragment whose Θ is (near) zero can still move."""
WINDOW = 8
"""Accepted pushes per learner and fragment whose median is that learner's vote."""
GROWTH = 1.25
"""Most the reference size may grow per accepted push of a fragment."""


def push_norm(deltas: Mapping[str, torch.Tensor]) -> float:
    """‖Δ‖ over a fragment's tensors: each tensor's in float32 (float64 where that overflows), summed in
    float64, so no finite float32 input overflows it."""
    return math.sqrt(sum(delta_norm(deltas, name) ** 2 for name in deltas))


def _lower_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


class NormHistory:
    """Per fragment, each learner's recent accepted push sizes, and the reference they give."""

    def __init__(self, fragments: list[int], undo: UndoLog | None = None) -> None:
        self.undo = undo or UndoLog()
        """Where a change made in a transaction keeps what it replaced (`undo.py`)."""
        self.sizes: dict[int, dict[int, deque[float]]] = {p: {} for p in fragments}
        self.reference: dict[int, float | None] = dict.fromkeys(fragments)
        """Per fragment, the reference size the latest accepted push was measured against."""
        self._votes: dict[int, dict[int, float]] = {p: {} for p in fragments}
        self._current: dict[int, float | None] = {}
        """Per fragment, each learner's vote and the reference they give now: recounted only when a push is
        accepted, so that a check costs the same whatever the number of learners."""
        self._theta_norm: dict[int, tuple[int, float]] = {}
        self._push_norm: tuple[tuple[int, int, int, int], float] | None = None
        """Measured once each: ‖Θ_p‖ per fragment version, and the latest push's (checked, then taken;
        known by its identity, not held)."""

    def of_push(self, push: Push) -> float:
        key = (id(push.deltas), push.learner, push.fragment, push.seq)
        if self._push_norm is None or self._push_norm[0] != key:
            self.undo.keep_attrs(self, "_push_norm")
            self._push_norm = (key, push_norm(push.deltas))
        return self._push_norm[1]

    def of_theta(self, fragment: int, version: int, values: dict[str, torch.Tensor]) -> float:
        """‖Θ_p‖ of `fragment` at `version`, whose tensors are `values`."""
        cached = self._theta_norm.get(fragment)
        if cached is None or cached[0] != version:  # Θ_p changes only with its version
            self.undo.keep(self._theta_norm, fragment)
            cached = self._theta_norm[fragment] = (version, push_norm(values))
        return cached[1]

    def current_reference(self, fragment: int) -> float | None:
        """Lower median of the learners' votes, grown at most GROWTH× since the last accepted push."""
        if fragment not in self._current:
            self.undo.keep(self._current, fragment)
            self._current[fragment] = self._count_votes(fragment)
        return self._current[fragment]

    def _count_votes(self, fragment: int) -> float | None:
        votes = list(self._votes[fragment].values())
        if not votes:
            return None
        reference = _lower_median(votes)
        previous = self.reference[fragment]
        return reference if previous is None else min(reference, GROWTH * previous)

    @staticmethod
    def hard_bound(theta_norm: float) -> float:
        """The largest ‖Δ‖ any push of a fragment whose Θ has norm `theta_norm` may have."""
        return THETA_RATIO * theta_norm + FLOOR

    def soft_bound(self, fragment: int, steps: int, factor: float) -> float | None:
        """The largest ‖Δ‖ a push of `steps` inner steps may have unclipped (None: no history yet)."""
        reference = self.current_reference(fragment)
        return None if reference is None else factor * reference * math.sqrt(max(steps, 1))

    def accept(self, fragment: int, learner: int, norm: float, steps: int) -> None:
        """A push accepted as it was (not clipped): its size votes from now on."""
        self.undo.keep(self.sizes[fragment], learner, lambda kept: deque(kept, maxlen=WINDOW))
        self.undo.keep(self.reference, fragment)
        self.undo.keep(self._votes[fragment], learner)
        self.undo.keep(self._current, fragment)
        sizes = self.sizes[fragment].setdefault(learner, deque(maxlen=WINDOW))
        sizes.append(norm / math.sqrt(max(steps, 1)))
        self._votes[fragment][learner] = _lower_median(list(sizes))
        self._current.pop(fragment, None)
        self.reference[fragment] = self.current_reference(fragment)
        self._current.pop(fragment, None)  # the reference it grows from moved

    def state_dict(self) -> dict:
        return {"sizes": {p: {m: list(s) for m, s in by.items()} for p, by in self.sizes.items()},
                "reference": dict(self.reference)}

    def load_state_dict(self, state: dict) -> None:
        self.sizes = {p: {m: deque(s, maxlen=WINDOW) for m, s in by.items()} for p, by in state["sizes"].items()}
        self.reference = dict(state["reference"])
        self._votes = {p: {m: _lower_median(list(s)) for m, s in by.items() if s} for p, by in self.sizes.items()}
        self._current = {}
