"""Strategies: each is a small module that turns the config into a `StrategySpec`.

Every strategy runs on the same machinery (replicas, cores, drivers); a spec only says how the
learners exchange progress. Later strategies add a module and a line in `BUILDERS`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from diloco.config import Config
from diloco.strategies import async_dn, async_local_sgd, ddp, decoupled, diloco, streaming
from diloco.strategies.spec import StrategySpec, Wiring

BUILDERS: dict[str, Callable[[Config], StrategySpec]] = {
    "ddp": ddp.build,
    "diloco": diloco.build,
    "streaming": streaming.build,
    "async": async_local_sgd.build,
    "async-dn": async_dn.build,
    "decoupled": decoupled.build,
}


def build_strategy(config: Config) -> StrategySpec:
    """The strategy's spec, wired to the config's codecs, outlier rule and budget: what builds the cores."""
    c = config.codec
    wiring = Wiring(codec_up=c.up, codec_down=c.down, block=c.block, error_feedback=c.error_feedback,
                    outlier=config.outer.outlier, outlier_factor=config.outer.outlier_factor,
                    budget=config.token_budget(), detect_s=config.failures.detect_s,
                    batch_tokens=config.train.batch_size * config.train.seq_len)
    return dataclasses.replace(BUILDERS[config.strategy](config), wiring=wiring)


__all__ = ["StrategySpec", "Wiring", "build_strategy", "BUILDERS"]
