"""DiLoCo (arXiv 2311.08105): every H steps, all learners wait, the syncer averages their outer
gradients over the whole model and takes a Nesterov step; everyone restarts from the new Θ.

One fragment, no overlap, overwrite on merge: `outer.fragments`, `outer.tau` and `outer.alpha` do
not apply.
"""

from diloco.config import Config
from diloco.strategies.spec import StrategySpec


def build(config: Config) -> StrategySpec:
    o = config.outer
    return StrategySpec(name="diloco", exchange="outer", H=o.H, fragments=1, tau=0, alpha=0.0,
                        outer_lr=o.lr, outer_momentum=o.momentum, merge_rule="mean", wait_for_updates=True)
