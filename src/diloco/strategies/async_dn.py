"""Asynchronous Local-SGD with Delayed Nesterov and Dynamic Local Updates (arXiv 2401.09135).

- Delayed Nesterov: the momentum moves once every N arrivals (N = `outer.dn_buffer`, by default the
  number of learners); arrivals in between take plain steps.
- Dynamic local updates: learner w runs H_w = ⌊H·v_w / max v⌋ inner steps per push, so that all
  learners finish a round at about the same time. v is the learner's speed (`learners.speeds`; the
  simulator's model of the hardware).
"""

from diloco.config import Config
from diloco.strategies.spec import StrategySpec


def build(config: Config) -> StrategySpec:
    o = config.outer
    speeds = config.speeds()
    fastest = max(speeds)
    periods = tuple(max(1, int(o.H * v / fastest)) for v in speeds)
    return StrategySpec(name="async-dn", exchange="outer", H=o.H, learner_H=periods, outer_lr=o.lr,
                        outer_momentum=o.momentum, optimizer="delayed-nesterov",
                        dn_buffer=o.dn_buffer or len(speeds), merge_rule="mean", quorum=1, grace=0.0,
                        wait_for_updates=True, shared_budget=True)
