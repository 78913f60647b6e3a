"""The outer settings a run's learners follow, as the syncer tells them at Join: the syncer's config is
the one that counts. A learner rebuilds the strategy's spec from them and takes its core from it."""

from __future__ import annotations

from diloco.config import Config
from diloco.errors import DilocoError
from diloco.strategies import StrategySpec, Wiring, build_strategy
from diloco.v1 import diloco_pb2 as pb


def settings_of(config: Config) -> pb.Settings:
    spec = build_strategy(config)
    if spec.exchange != "outer":
        raise DilocoError(f"strategy {spec.name!r} all-reduces gradients every step; the real runtime runs the "
                          f"strategies that sync through a syncer (diloco, streaming, async, async-dn, decoupled). "
                          f"Use `diloco sim` for {spec.name}, or torch DDP itself")
    codec = config.codec
    return pb.Settings(strategy=spec.name, fragments=spec.fragments, period=spec.H,
                       learner_periods=list(spec.learner_H), tau=spec.tau, alpha=spec.alpha,
                       wait_for_updates=spec.wait_for_updates, codec_up=codec.up, codec_down=codec.down,
                       block=codec.block, error_feedback=codec.error_feedback, learners=len(config.speeds()),
                       token_budget=config.token_budget(), shared_budget=spec.shared_budget,
                       keep_progress=spec.keep_progress)


def spec_of(settings: pb.Settings) -> StrategySpec:
    """The learner's side of the strategy, as the syncer's settings give it."""
    return StrategySpec(name=settings.strategy, exchange="outer", H=settings.period,
                        learner_H=tuple(settings.learner_periods), fragments=settings.fragments, tau=settings.tau,
                        alpha=settings.alpha, wait_for_updates=settings.wait_for_updates,
                        keep_progress=settings.keep_progress, shared_budget=settings.shared_budget,
                        wiring=Wiring(codec_up=settings.codec_up, codec_down=settings.codec_down,
                                      block=settings.block, error_feedback=settings.error_feedback,
                                      budget=settings.token_budget))


def check_shards(config: Config, count: int) -> None:
    fragments = build_strategy(config).fragments
    if count > fragments:
        raise DilocoError(f"{count} syncer shards but only {fragments} fragments (outer.fragments): every shard "
                          f"must own at least one fragment")
