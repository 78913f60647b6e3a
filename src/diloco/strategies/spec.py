"""What a strategy decides: how learners exchange progress, and how the syncer merges it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.outer.merge import MergeRule


@dataclass(frozen=True)
class StrategySpec:
    name: str
    exchange: Literal["gradients", "outer"]
    """`gradients`: all-reduce every inner step (data-parallel). `outer`: outer gradients via the syncer."""
    H: int = 1
    fragments: int = 1
    tau: int = 0
    alpha: float = 0.0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    merge_rule: MergeRule = "mean"
    wait_for_updates: bool = True
    """Whether a learner stops at step t + τ until its answer is in (synchronous strategies)."""
