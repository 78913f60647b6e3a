"""Strategies: each is a small module that turns the config into a `StrategySpec`.

Every strategy runs on the same machinery (replicas, cores, drivers); a spec only says how the
learners exchange progress. Later strategies add a module and a line in `BUILDERS`.
"""

from __future__ import annotations

from typing import Callable

from diloco.config import Config
from diloco.strategies import async_dn, async_local_sgd, ddp, decoupled, diloco, streaming
from diloco.strategies.spec import StrategySpec

BUILDERS: dict[str, Callable[[Config], StrategySpec]] = {
    "ddp": ddp.build,
    "diloco": diloco.build,
    "streaming": streaming.build,
    "async": async_local_sgd.build,
    "async-dn": async_dn.build,
    "decoupled": decoupled.build,
}


def build_strategy(config: Config) -> StrategySpec:
    return BUILDERS[config.strategy](config)


__all__ = ["StrategySpec", "build_strategy", "BUILDERS"]
