"""Asynchronous Local-SGD (arXiv 2401.09135), the naive baseline: each learner pushes its whole-model
outer gradient every H of its own steps, and the syncer applies every arrival at once through
Nesterov, as its share of the learners (1/M of it when all push alike: the outer learning rate of an
average). A learner waits only for its own answer, never for another learner.

Applying arrivals one by one compounds the momentum: expect it to lose quality against `async-dn`.
"""

from diloco.config import Config
from diloco.strategies.spec import StrategySpec


def build(config: Config) -> StrategySpec:
    o = config.outer
    return StrategySpec(name="async", exchange="outer", H=o.H, outer_lr=o.lr, outer_momentum=o.momentum,
                        merge_rule="mean", quorum=1, grace=0.0, participation=True, wait_for_updates=True,
                        shared_budget=True)
