"""What a strategy decides: how learners exchange progress, and how the syncer merges it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.outer.delayed_nesterov import DelayedNesterov
from diloco.outer.merge import MergeRule
from diloco.outer.nesterov import Nesterov


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
    wait_for_updates: bool = True
    """Whether a learner stops at step t + τ until its answer is in."""
    shared_budget: bool = False
    """False: every learner trains an equal share of the tokens. True: learners train at their own
    speed until the total budget is spent, so faster learners train more of it."""

    def period(self, learner: int) -> int:
        return self.learner_H[learner] if self.learner_H else self.H

    def outer_optimizer(self) -> Nesterov | DelayedNesterov:
        """A fresh outer optimizer for one fragment."""
        if self.optimizer == "delayed-nesterov":
            return DelayedNesterov(self.outer_lr, self.outer_momentum, self.dn_buffer)
        return Nesterov(self.outer_lr, self.outer_momentum)

    def planned_steps(self, speeds: list[float], budget: int, tokens_per_step: int) -> list[int]:
        """Inner steps each learner plans for (its learning-rate schedule spans them). With a shared
        budget, a learner's share of the tokens follows its speed; otherwise all take equal shares."""
        if not self.shared_budget:
            return [budget // tokens_per_step // len(speeds)] * len(speeds)
        return [max(1, round(budget * s / sum(speeds) / tokens_per_step)) for s in speeds]
