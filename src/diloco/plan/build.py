"""From a config and the plan's own flags to a `Deployment`; and the run's exact totals where the
simulator's schedule can be replayed."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

from diloco.errors import DilocoError
from diloco.plan import units
from diloco.plan.deployment import Deployment, Region
from diloco.plan.layout import Layout, assumed_layout, model_layout
from diloco.plan.syncer_cost import LEARNER_FLOPS, PLAN_STEP_TOKENS, step_time_s

if TYPE_CHECKING:
    from diloco.config import Config
    from diloco.plan.replay import ReplayResult


def parse_regions(text: str, default_latency_s: float) -> tuple[Region, ...]:
    """`us=2,eu=5Gbit@80ms`: each region's WAN bandwidth (bare numbers are Gbit/s) and latency."""
    regions: list[Region] = []
    for item in text.split(","):
        name, sep, spec = item.strip().partition("=")
        name = name.strip()
        if not sep or not name or not spec.strip():
            raise DilocoError(f"--regions: expected NAME=RATE[@LATENCY] items such as us=2,eu=5@80ms, got {item!r}")
        if any(r.name == name for r in regions):
            raise DilocoError(f"--regions: region {name!r} is named twice")
        rate, _, latency = spec.partition("@")
        flag = f"--regions {name}"
        regions.append(Region(name, units.bandwidth_bps(flag, rate),
                              units.seconds(flag, latency, "ms", allow_zero=True) if latency else default_latency_s))
    return tuple(regions)


def step_tokens(args: argparse.Namespace) -> int | None:
    """Tokens per inner step: `--step-tokens`; for a `--params` plan without it, PLAN_STEP_TOKENS."""
    if args.step_tokens:
        return units.count("--step-tokens", args.step_tokens)
    return PLAN_STEP_TOKENS if args.params else None


def derived_step(args: argparse.Namespace) -> tuple[float, str] | None:
    """A `--params` plan's step time from the model's FLOPs, unless `--step-time` or
    `--set learners.step_time_s` gives it: (seconds, how it was found)."""
    if not args.params or args.step_time is not None or any(
            s.startswith("learners.step_time_s") for s in args.set or []):
        if args.learner_flops is not None:
            units.flops("--learner-flops", args.learner_flops)  # checked, though the step time is given
        return None
    flops = units.flops("--learner-flops", args.learner_flops) if args.learner_flops else LEARNER_FLOPS
    tokens = step_tokens(args) or PLAN_STEP_TOKENS
    return step_time_s(units.count("--params", args.params), tokens, flops), (
        f"6 × params × {tokens:,} tokens ÷ {flops / 1e15:.3g} PFLOP/s per learner")


def build_deployment(config: Config, args: argparse.Namespace) -> Deployment:
    """The deployment the config and the command's flags describe (the model is built unless --params)."""
    from diloco.strategies import build_strategy

    fragments = build_strategy(config).fragments
    layout = assumed_layout(units.count("--params", args.params), fragments) if args.params else None
    if args.regions and config.regions:
        raise DilocoError("--regions: the config has [[regions]] already; plan one or the other")
    regions = parse_regions(args.regions, config.link.latency_ms / 1e3) if args.regions else ()
    explicit_tokens = args.config is not None or args.tokens is not None or any(
        s.startswith("train.tokens") for s in args.set or [])
    derived = derived_step(args)
    d = deployment(config, layout, regions=regions,
                   shards=units.integer("--shards", args.shards) if args.shards else None,
                   shard_memory_bytes=units.memory_bytes("--shard-memory", args.shard_memory)
                   if args.shard_memory else None,
                   tokens_per_step=step_tokens(args), with_totals=explicit_tokens)
    cores = units.positive("--shard-cores", args.shard_cores) if args.shard_cores else None
    return replace(d, step_time_source=derived[1] if derived else "", shard_cores=cores)


def deployment(config: Config, layout: Layout | None = None, *, regions: tuple[Region, ...] = (),
               shards: int | None = None, shard_memory_bytes: float | None = None,
               tokens_per_step: int | None = None, with_totals: bool = True) -> Deployment:
    """The deployment of a config: its strategy, learners, links and codecs, on `layout` (default: the
    configured model's own fragments). `tokens_per_step` other than batch × seq_len takes `train.tokens`
    as the budget as it is."""
    from diloco.strategies import build_strategy

    spec = build_strategy(config)
    layout = layout or model_layout(config, spec.fragments)
    if len(regions) > config.learners.count:
        raise DilocoError(f"--regions: {len(regions)} regions for {config.learners.count} learners: every region "
                          "needs at least one learner")
    own = config.train.batch_size * config.train.seq_len
    tokens = (config.token_budget() if tokens_per_step is None else config.train.tokens) if with_totals else None
    return Deployment(
        strategy=spec.name, exchange=spec.exchange, synchronous=spec.exchange == "gradients" or spec.quorum is None,
        waits=spec.wait_for_updates, staggered=config.strategy in ("streaming", "decoupled"), layout=layout,
        H=spec.H, tau=spec.tau, step_time_s=config.learners.step_time_s, speeds=tuple(config.speeds()),
        bandwidth_bps=config.link.bandwidth_mbit * 1e6, latency_s=config.link.latency_ms / 1e3,
        codec_up=config.codec.up, codec_down=config.codec.down, block=config.codec.block, optimizer=spec.optimizer,
        merge_rule=spec.merge_rule, consolidate=spec.consolidate, regions=regions, shards=shards,
        shard_memory_bytes=shard_memory_bytes, tokens_per_step=tokens_per_step or own, tokens=tokens,
        reproducible=config.outer.reproducible, network=config if config.regions else None)


def replayed_run(config: Config, d: Deployment, args: argparse.Namespace) -> ReplayResult | None:
    """The simulator's run replayed, when the deployment is the config's own run and a synchronous one
    (or data-parallel) on the real model: its totals and each link's bytes are then exact."""
    from diloco.plan.replay import replay, replay_problem

    if d.tokens is None or not d.layout.exact or d.regions or args.step_tokens is not None:
        return None
    if replay_problem(config) is not None:
        return None
    return replay(config, d.layout)
