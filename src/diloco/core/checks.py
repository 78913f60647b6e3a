"""Admission, the syncer core's part that decides what it takes: every number a learner sends is a claim,
bounded here before anything changes.

A refused message raises ProtocolError with one line saying why, and leaves the core as it was.
Pushed tensors must be finite and, with the outlier rule on, no larger than `outliers.py` allows (an
outlier is clipped or refused); counters must be plausible (`claims.py`): steps no faster than the
learner's rate, tokens no more than its tokens per step, sequence numbers no jump (a report beyond the
rate is believed in part, not refused: `claims.py`). It keeps what it
judges against: the learners' declared rates and accepted claims, and the history of push sizes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from diloco.core.claims import (MAX_SEQ_JUMP, Claims, impossible_step, overlap_problem, plausible, step_problem,
                                 token_problem)
from diloco.core.accumulate import delta_norm, delta_shape
from diloco.core.closing import all_finite
from diloco.core.membership import Membership
from diloco.core.merging import Merging
from diloco.core.messages import Progress, Push
from diloco.core.outliers import NormHistory
from diloco.core.refusals import ProtocolError
from diloco.core.undo import UndoLog

MAX_STEP_TIME_S = 3600.0
"""A reported inner step longer than an hour is taken for a broken clock, not a slow chip."""
MAX_COUNTER = 2**63 - 1
"""Steps and tokens a learner may claim: past this, a counter is a lie (or a wrapped integer)."""
MAX_DUE_S = 1e9
"""Longest a learner may say it will take to push a fragment again."""
MAX_FRAGMENTS = 1 << 16
"""Fragments a learner's schedule may name."""
MAX_THETA_RMS = 1e3
"""Largest root-mean-square a tensor of Θ may have, seeded or loaded: trained models' tensors have RMS
well below 10 (weights ~0.02-1, norms' gains ~1); a seed above it is an attack (3e38 would scale the
outlier bounds up with it) or a broken model, and either would make every later step meaningless."""


def theta_problem(values: dict[str, torch.Tensor]) -> str | None:
    """Why `values` cannot be a model's parameters (a tensor not finite, or of RMS above MAX_THETA_RMS),
    or None: what seeding Θ (Init) and loading a saved Θ both check."""
    for name, value in values.items():
        if not value.is_floating_point():
            return f"tensor {name!r} is not a float tensor"
        if not all_finite([value]):
            return f"tensor {name!r} holds NaN or Inf"
        rms = float(torch.linalg.vector_norm(value, dtype=torch.float64)) / math.sqrt(max(value.numel(), 1))
        if not rms <= MAX_THETA_RMS:
            return f"tensor {name!r} has RMS {rms:.4g}, above the {MAX_THETA_RMS:g} a model's parameters can have"
    return None


class Admission:
    def __init__(self, membership: Membership, merging: Merging, *, undo: UndoLog, outlier: str,
                 outlier_factor: float, max_tokens_per_step: int) -> None:
        self.membership, self.merging, self.undo = membership, merging, undo
        self.outlier, self.outlier_factor = outlier, outlier_factor
        self.claims = Claims(undo, max_tokens_per_step)
        """Declared rates and accepted claims: what a learner's next counters are judged against."""
        self.norms = NormHistory(list(merging.fragments), undo)
        """Per fragment and learner, the sizes of the latest pushes accepted as they were (`outliers.py`)."""

    def check_push(self, push: Push, now: float) -> None:
        """Raise ProtocolError for a push this syncer must refuse; nothing changes either way."""
        members = self.membership
        if push.learner not in members.ledger:
            raise ProtocolError(f"push from learner {push.learner}, which never joined")
        if push.fragment not in self.merging.fragments:
            raise ProtocolError(f"push for fragment {push.fragment}, which this syncer does not hold")
        state = self.merging.fragments[push.fragment]
        if not 0 <= push.base_version <= state.version:
            raise ProtocolError(f"push of fragment {push.fragment} based on version {push.base_version}, "
                                f"but the latest is {state.version}")
        if not (0 <= push.tokens <= MAX_COUNTER and 0 <= push.steps <= MAX_COUNTER and 0 <= push.step <= MAX_COUNTER):
            raise ProtocolError(f"push of fragment {push.fragment} with counters out of range (tokens "
                                f"{push.tokens}, steps {push.steps}, step {push.step})")
        if not (math.isfinite(push.step_time_s) and 0 <= push.step_time_s <= MAX_STEP_TIME_S) or \
                (push.sent_at is not None and not math.isfinite(push.sent_at)):
            raise ProtocolError(f"push of fragment {push.fragment} with an impossible step time "
                                f"({push.step_time_s!r} s) or send time ({push.sent_at!r})")
        if set(push.deltas) != set(state.fragment.names):
            raise ProtocolError(f"push of fragment {push.fragment} does not carry exactly the fragment's tensors")
        for name in push.deltas:
            if (shape := delta_shape(push.deltas, name)) != self.merging.theta[name].shape:
                raise ProtocolError(f"push of fragment {push.fragment}: tensor {name!r} has shape "
                                    f"{tuple(shape)}, expected {tuple(self.merging.theta[name].shape)}")
        for name in push.deltas:  # the norm, taken once for all: finite exactly when every element is
            if not math.isfinite(delta_norm(push.deltas, name)) and not all_finite([push.deltas[name]]):
                raise ProtocolError(f"push of fragment {push.fragment}: tensor {name!r} holds a value that is not finite")
        entry = members.ledger[push.learner]
        last_seq = max(entry.last_seq, members.session_start.get(push.learner, 0))
        if push.seq > last_seq + MAX_SEQ_JUMP:
            raise ProtocolError(f"push of fragment {push.fragment} numbered {push.seq}, more than {MAX_SEQ_JUMP} "
                                f"above the learner's last ({last_seq})")
        if push.seq <= entry.last_seq:
            return  # a retry of a push already taken: counted once, nothing more to check
        tokens_per_step = self.claims.tokens_per_step(push.learner)
        if push.tokens > push.steps * tokens_per_step:
            raise ProtocolError(f"push of fragment {push.fragment} claims {push.tokens} tokens in {push.steps} steps, "
                                f"above {tokens_per_step} per step")
        counters = self.claims.of(push.learner, now)
        problem = step_problem(counters, push.step, now) or \
            overlap_problem(counters, push.fragment, push.step, push.steps)
        if problem:
            raise ProtocolError(f"push of fragment {push.fragment}: {problem}")
        if self.outlier != "off":
            norm, hard, soft = self.outlier_bounds(push)
            if norm > hard:
                raise ProtocolError(f"push of fragment {push.fragment} refused: its norm {norm:.4g} is above "
                                    f"{hard:.4g}, the most the fragment's own scale allows")
            if self.outlier == "reject" and soft is not None and norm > soft:
                raise ProtocolError(f"push of fragment {push.fragment} refused as an outlier: its norm {norm:.4g} "
                                    f"is above the bound {soft:.4g} (outlier factor {self.outlier_factor:g} "
                                    f"x the learners' median push)")


    def check_progress(self, report: Progress, now: float) -> None:
        """Raise ProtocolError for a progress report (or heartbeat) this syncer must refuse; nothing changes."""
        members = self.membership
        if report.learner not in members.ledger:
            raise ProtocolError(f"progress from learner {report.learner}, which never joined")
        if not (0 <= report.step <= MAX_COUNTER and 0 <= report.tokens <= MAX_COUNTER):
            raise ProtocolError(f"progress of learner {report.learner} with counters out of range "
                                f"(step {report.step}, tokens {report.tokens})")
        if not (math.isfinite(report.step_time_s) and 0 <= report.step_time_s <= MAX_STEP_TIME_S):
            raise ProtocolError(f"progress of learner {report.learner} with an impossible step time "
                                f"({report.step_time_s!r} s)")
        if len(report.due_in_s) > MAX_FRAGMENTS or \
                not all(math.isfinite(d) and 0 <= d <= MAX_DUE_S for d in report.due_in_s):
            raise ProtocolError(f"progress of learner {report.learner} with an impossible schedule "
                                f"({len(report.due_in_s)} fragments, due in {list(report.due_in_s)[:4]} s)")
        counters = self.claims.of(report.learner, now)
        problem = impossible_step(counters, report.step, now) or \
            token_problem(counters, report.step, report.tokens, self.claims.tokens_per_step(report.learner), members.budget)
        if problem:
            raise ProtocolError(f"progress of learner {report.learner}: {problem}")

    def believe_progress(self, learner: int, step: int, tokens: int, now: float) -> tuple[int, int]:
        """Keep a checked report's counters as far as they are plausible (`claims.plausible`: clipped, not
        refused); return the step and tokens believed."""
        counters = self.claims.of(learner, now)
        believed = plausible(counters, step, tokens, self.claims.tokens_per_step(learner), now)
        counters = self.claims.accept(learner, believed[0], now, believed[1])
        if believed != (step, tokens):
            counters.clipped += 1
        return believed

    def admit_push(self, push: Push, now: float) -> Push | None:
        """Take a checked push's counters: None for a retry of one already taken (counted once), else the
        push as it is to be merged (an outlier clipped)."""
        self.claims.tick(now)
        entry = self.membership.entry(push.learner)
        if push.seq <= entry.last_seq:
            entry.duplicates += 1
            return None
        entry.last_seq = entry.fragment_seqs[push.fragment] = push.seq
        entry.pushes += 1
        covered = self.claims.accept(push.learner, push.step, now).covered
        covered[push.fragment] = max(covered.get(push.fragment, push.step), push.step)
        return self.bounded(push)

    def outlier_bounds(self, push: Push) -> tuple[float, float, float | None]:
        """The push's norm, the most any push may have (refused above), and the most the history allows
        (clipped or refused above; None before there is any history)."""
        state = self.merging.fragments[push.fragment]
        norm = self.norms.of_push(push)
        theta_norm = self.norms.of_theta(push.fragment, state.version,
                                         {n: self.merging.theta[n] for n in state.fragment.names})
        return norm, self.norms.hard_bound(theta_norm), self.norms.soft_bound(push.fragment, push.steps,
                                                                             self.outlier_factor)

    def bounded(self, push: Push) -> Push:
        """Clip an outlier (rule `clip`); a push accepted as it was votes in the outlier history."""
        if self.outlier == "off":
            return push
        norm, _, bound = self.outlier_bounds(push)
        if bound is not None and norm > bound:  # only `clip` gets here: `reject` refused it in `check_push`
            self.membership.entry(push.learner).clipped += 1
            return dataclasses.replace(push, deltas={n: d * (bound / norm) for n, d in push.deltas.items()})
        self.norms.accept(push.fragment, push.learner, norm, push.steps)
        return push

    def state_dict(self) -> dict:
        return {"norms": self.norms.state_dict(), **self.claims.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "norms" in state:  # saved before the outlier history was kept per learner: it starts afresh
            self.norms.load_state_dict(state["norms"])
        self.claims.load_state_dict(state)
