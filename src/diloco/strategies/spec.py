"""What a strategy decides: how learners exchange progress, and how the syncer merges it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Literal

import torch

from diloco.codecs import get_codec
from diloco.core.learner_core import LearnerCore
from diloco.core.regional import RegionalSyncer
from diloco.core.rounds import OuterOptimizer
from diloco.core.claims import tokens_per_step_ceiling
from diloco.core.syncer_core import SyncerCore
from diloco.fragments import Fragment, Schedule
from diloco.outer.delayed_nesterov import DelayedNesterov
from diloco.outer.merge import MergeRule
from diloco.outer.nesterov import Nesterov

if TYPE_CHECKING:
    from diloco.config import RegionalConfig

NEVER_DUE = 1 << 62
"""A period no step count reaches: a regional syncer pushes after its rounds, not on a schedule."""


@dataclass(frozen=True)
class Wiring:
    """What the cores take from the config beyond the strategy itself: codecs, the outlier rule, the
    shared budget. Filled by `build_strategy` (or, on a real learner, from the syncer's settings)."""

    codec_up: str = "fp32"
    codec_down: str = "fp32"
    block: int = 64
    error_feedback: bool = False
    outlier: str = "off"
    outlier_factor: float = 5.0
    budget: int | None = None
    detect_s: float = 5.0
    """The silence after which the syncer counts a learner as dead."""
    batch_tokens: int | None = None
    """The run's batch × sequence: what bounds the tokens per step a learner may declare."""


@dataclass(frozen=True)
class StrategySpec:
    name: str
    exchange: Literal["gradients", "outer"]
    """`gradients`: all-reduce every inner step (data-parallel). `outer`: outer gradients via the syncer."""
    H: int = 1
    learner_H: tuple[int, ...] = ()
    """Per-learner periods (dynamic local updates); empty means H for everyone."""
    fragments: int = 1
    tau: int = 0
    alpha: float = 0.0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    optimizer: Literal["nesterov", "delayed-nesterov"] = "nesterov"
    dn_buffer: int = 1
    merge_rule: MergeRule = "mean"
    quorum: int | None = None
    """Minimum pushes in a round; None means every learner alive (synchronous)."""
    grace: float = 0.0
    grace_cap_steps: float = 0.0
    participation: bool = False
    """Scale a round's merged update by the share of the learners it heard from (see SyncerCore)."""
    pacing: bool = False
    """The syncer predicts arrivals, holds rounds for them and aligns the learners' pushes (core/pacing.py)."""
    consolidate: bool = False
    """The run's last round of each fragment sets Θ to the learners' weighted mean."""
    keep_progress: bool = False
    """A merge keeps what the learner trained since sending: θ ← Θ̃ + (θ − θ_sent)."""
    stale_weight: Literal["full", "inverse"] = "full"
    """How a stale push weighs in its round: fully, or divided by 1 + the versions it is behind."""
    wait_for_updates: bool = True
    """Whether a learner stops at step t + τ until its answer is in."""
    shared_budget: bool = False
    """False: every learner trains an equal share of the tokens. True: learners train at their own
    speed until the total budget is spent, so faster learners train more of it."""
    in_learner_order: bool = False
    """The syncer folds a round's pushes in learner order, whatever order they came in (reproducible runs)."""
    wiring: Wiring = field(default_factory=Wiring)

    def period(self, learner: int) -> int:
        return self.learner_H[learner] if learner < len(self.learner_H) else self.H

    def outer_optimizer(self) -> Nesterov | DelayedNesterov:
        """A fresh outer optimizer for one fragment."""
        if self.optimizer == "delayed-nesterov":
            return DelayedNesterov(self.outer_lr, self.outer_momentum, self.dn_buffer)
        return Nesterov(self.outer_lr, self.outer_momentum)

    def syncer_core(self, params: dict[str, torch.Tensor], fragments: list[Fragment], members: Iterable[int], *,
                    embeddings: Iterable[str], optimizer: Callable[[], OuterOptimizer] | None = None,
                    period: float | None = None, counts_budget: bool = True) -> SyncerCore:
        """The syncer's core for this strategy: the one place its arguments are wired, for both drivers.
        A regional syncer's differs in its outer step, its pacing period and the budget it leaves to the
        global syncer."""
        w = self.wiring
        return SyncerCore(params, fragments, members, optimizer=optimizer or self.outer_optimizer,
                          merge_rule=self.merge_rule, embeddings=embeddings, quorum=self.quorum, grace=self.grace,
                          grace_cap_steps=self.grace_cap_steps, tau=self.tau, participation=self.participation,
                          down_codec=get_codec(w.codec_down, w.block), outlier=w.outlier,
                          outlier_factor=w.outlier_factor, pacing=self.pacing, period=period or self.H,
                          consolidate=self.consolidate, stale_weight=self.stale_weight,
                          budget=w.budget if self.shared_budget and counts_budget else None, detect_s=w.detect_s,
                          max_tokens_per_step=tokens_per_step_ceiling(w.batch_tokens),
                          in_learner_order=self.in_learner_order)

    def regional_syncer(self, region: int, params: dict[str, torch.Tensor], versions: list[int],
                        fragments: list[Fragment], members: Iterable[int], *, embeddings: Iterable[str],
                        settings: RegionalConfig, period: float, first_seq: int = 0, encode_later: bool = False
                        ) -> RegionalSyncer:
        """A region's syncer (`core/regional.py`), starting from the global Θ at `versions`: its rounds over
        `members` step with `settings.lr`/`momentum` and pace at `period` of its fastest learner's steps;
        its pushes up travel in `settings.codec` (default: the uplink's)."""
        w = self.wiring
        down = self.syncer_core(params, fragments, members, embeddings=embeddings, period=period,
                                optimizer=lambda: Nesterov(settings.lr, settings.momentum), counts_budget=False)
        mirror = {n: t.detach().to(torch.float32).clone() for n, t in params.items()}
        up = LearnerCore(region, mirror, fragments, Schedule(NEVER_DUE, len(fragments)), tau=0, alpha=0.0,
                         wait_for_updates=False, versions=versions, first_seq=first_seq,
                         codec=get_codec(settings.codec or w.codec_up, w.block), error_feedback=w.error_feedback,
                         encode_later=encode_later, keep_progress=True)
        return RegionalSyncer(region, down, up, push_every=settings.push_every, global_period=self.H)

    def learner_core(self, learner: int, params: dict[str, torch.Tensor], fragments: list[Fragment], *,
                     versions: list[int] | None = None, step: int = 0, first_seq: int = 0,
                     encode_later: bool = False) -> LearnerCore:
        """A learner's core for this strategy, for both drivers."""
        w = self.wiring
        return LearnerCore(learner, params, fragments, Schedule(self.period(learner), len(fragments)), tau=self.tau,
                           alpha=self.alpha, wait_for_updates=self.wait_for_updates, versions=versions, step=step,
                           first_seq=first_seq, codec=get_codec(w.codec_up, w.block),
                           error_feedback=w.error_feedback, encode_later=encode_later,
                           keep_progress=self.keep_progress)

    def planned_steps(self, speeds: list[float], budget: int, tokens_per_step: int) -> list[int]:
        """Inner steps each learner plans for (its learning-rate schedule spans them). With a shared
        budget, a learner's share of the tokens follows its speed; otherwise all take equal shares."""
        if not self.shared_budget:
            return [budget // tokens_per_step // len(speeds)] * len(speeds)
        return [max(1, round(budget * s / sum(speeds) / tokens_per_step)) for s in speeds]
