"""Decoupled DiLoCo: learners never wait; the syncer merges whatever has arrived, a fragment at a time.

P fragments on staggered offsets (as Streaming DiLoCo), answers merged τ steps after sending with α,
a minimum quorum K per round, an adaptive grace window γ, token-weighted merging and radial-
directional averaging (`outer.merge`). Each round's step is scaled by the share of the learners it
heard from, and the Nesterov momentum moves once those shares add up to a full round (delayed
Nesterov, generalised to partial rounds): with every learner in every round it is plain Nesterov.
"""

from diloco.config import Config
from diloco.strategies.spec import StrategySpec


def build(config: Config) -> StrategySpec:
    o = config.outer
    return StrategySpec(name="decoupled", exchange="outer", H=o.H, fragments=o.fragments, tau=o.tau,
                        alpha=o.alpha, outer_lr=o.lr, outer_momentum=o.momentum, optimizer="delayed-nesterov",
                        dn_buffer=0, merge_rule=o.merge,
                        quorum=o.quorum or None, grace=o.grace, grace_cap_steps=o.grace_cap_steps, participation=True,
                        wait_for_updates=False, shared_budget=True)
