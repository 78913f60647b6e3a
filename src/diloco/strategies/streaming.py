"""Streaming DiLoCo (arXiv 2501.18512): P fragments on staggered offsets, so only |θ|/P crosses the
link at a time; each answer is merged τ steps after sending, mixed in with α.

Still synchronous: every learner takes part in every round and waits at t + τ if the answer is late.
"""

from diloco.config import Config
from diloco.strategies.spec import StrategySpec


def build(config: Config) -> StrategySpec:
    o = config.outer
    return StrategySpec(name="streaming", exchange="outer", H=o.H, fragments=o.fragments, tau=o.tau,
                        alpha=o.alpha, outer_lr=o.lr, outer_momentum=o.momentum, merge_rule="mean",
                        wait_for_updates=True)
