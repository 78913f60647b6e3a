"""Strategies: each is a small module that turns the config into a `StrategySpec`.

Every strategy runs on the same machinery (replicas, cores, drivers); a spec only says how the
learners exchange progress. Later strategies add a module and a line in `BUILDERS`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from diloco.codecs.base import all_finite
from diloco.config import Config
from diloco.errors import DilocoError
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
    spec = dataclasses.replace(BUILDERS[config.strategy](config), wiring=wiring)
    if spec.exchange == "outer":
        check_outer_step(spec)
    return spec


def check_outer_step(spec: StrategySpec) -> None:
    """One outer step on a probe tensor, at start-up: a config the outer optimizer cannot step with is one
    line now, rather than every push failing inside the core while Θ never moves."""
    optimizer = spec.outer_optimizer()
    probe = {"probe": torch.ones(1)}
    try:
        for _ in range(2):
            optimizer.step(probe, {"probe": torch.full((1,), 1e-3)})
    except (RuntimeError, ValueError, OverflowError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DilocoError(f"the config's outer step fails (outer.lr {spec.outer_lr:g}, outer.momentum "
                          f"{spec.outer_momentum:g}): {first}") from None
    if not all_finite(probe["probe"]):
        raise DilocoError(f"the config's outer step makes Θ non-finite (outer.lr {spec.outer_lr:g}, "
                          f"outer.momentum {spec.outer_momentum:g})")


__all__ = ["StrategySpec", "Wiring", "build_strategy", "BUILDERS"]
