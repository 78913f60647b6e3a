"""Data-parallel: every learner all-reduces its gradients after every step and stays identical.

A step ends when the slowest learner has its gradients and the ring all-reduce over the slowest link
is done: each learner sends and receives 2·(M−1)/M of the gradient bytes.
"""

from diloco.config import Config
from diloco.strategies.spec import StrategySpec


def build(config: Config) -> StrategySpec:
    return StrategySpec(name="ddp", exchange="gradients")
