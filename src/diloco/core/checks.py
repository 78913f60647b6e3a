"""What the syncer refuses: every number a learner sends is a claim, bounded here before anything changes.

A refused message raises ProtocolError with one line saying why, and leaves the core as it was.
Pushed tensors must be finite and, with the outlier rule on, no larger than `outliers.py` allows;
counters must be plausible (`claims.py`): steps no faster than the learner's rate, tokens no more than
its tokens per step, sequence numbers no jump.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from diloco.core.closing import all_finite
from diloco.core.outliers import outlier_bounds
from diloco.core.claims import MAX_SEQ_JUMP, overlap_problem, step_problem, token_problem
from diloco.core.messages import Progress, Push
from diloco.core.rounds import ProtocolError

if TYPE_CHECKING:
    from diloco.core.syncer_core import SyncerCore

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


def check_push(core: SyncerCore, push: Push, now: float) -> None:
    """Raise ProtocolError for a push this syncer must refuse; nothing changes either way."""
    if push.learner not in core.ledger:
        raise ProtocolError(f"push from learner {push.learner}, which never joined")
    if push.fragment not in core.fragments:
        raise ProtocolError(f"push for fragment {push.fragment}, which this syncer does not hold")
    state = core.fragments[push.fragment]
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
    for name, delta in push.deltas.items():
        if delta.shape != core.theta[name].shape:
            raise ProtocolError(f"push of fragment {push.fragment}: tensor {name!r} has shape "
                                f"{tuple(delta.shape)}, expected {tuple(core.theta[name].shape)}")
    for name, delta in push.deltas.items():
        if not all_finite([delta]):
            raise ProtocolError(f"push of fragment {push.fragment}: tensor {name!r} holds a value that is not finite")
    entry = core.ledger[push.learner]
    last_seq = max(entry.last_seq, core.session_start.get(push.learner, 0))
    if push.seq > last_seq + MAX_SEQ_JUMP:
        raise ProtocolError(f"push of fragment {push.fragment} numbered {push.seq}, more than {MAX_SEQ_JUMP} "
                            f"above the learner's last ({last_seq})")
    if push.seq <= entry.last_seq:
        return  # a retry of a push already taken: counted once, nothing more to check
    tokens_per_step = core.claims.tokens_per_step(push.learner)
    if push.tokens > push.steps * tokens_per_step:
        raise ProtocolError(f"push of fragment {push.fragment} claims {push.tokens} tokens in {push.steps} steps, "
                            f"above {tokens_per_step} per step")
    counters = core.claims.of(push.learner, now)
    problem = step_problem(counters, push.step, now) or \
        overlap_problem(counters, push.fragment, push.step, push.steps)
    if problem:
        raise ProtocolError(f"push of fragment {push.fragment}: {problem}")
    if core.outlier != "off":
        norm, hard, soft = outlier_bounds(core, push)
        if norm > hard:
            raise ProtocolError(f"push of fragment {push.fragment} refused: its norm {norm:.4g} is above "
                                f"{hard:.4g}, the most the fragment's own scale allows")
        if core.outlier == "reject" and soft is not None and norm > soft:
            raise ProtocolError(f"push of fragment {push.fragment} refused as an outlier: its norm {norm:.4g} "
                                f"is above the bound {soft:.4g} (outlier factor {core.outlier_factor:g} "
                                f"x the learners' median push)")


def check_progress(core: SyncerCore, report: Progress, now: float) -> None:
    """Raise ProtocolError for a progress report (or heartbeat) this syncer must refuse; nothing changes."""
    if report.learner not in core.ledger:
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
    counters = core.claims.of(report.learner, now)
    problem = step_problem(counters, report.step, now) or \
        token_problem(counters, report.step, report.tokens, core.claims.tokens_per_step(report.learner), core.budget)
    if problem:
        raise ProtocolError(f"progress of learner {report.learner}: {problem}")
