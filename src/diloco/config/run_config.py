"""The whole run configuration (`Config`: one section per table) and the order its rules are checked in.

Every section's own rules live next to it (`*_section.py`); the rules that combine sections are here. The
first failing rule is the one reported, so the checks run in a fixed order, section by section.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from diloco.config.cluster_section import ClusterConfig, check_cluster
from diloco.config.codec_section import CodecConfig, check_codec
from diloco.config.data_section import DataConfig, check_data
from diloco.config.failures_section import FailuresConfig, check_failures
from diloco.config.learners_section import LearnersConfig, check_learners
from diloco.config.metrics_section import MetricsConfig
from diloco.config.model_section import ModelConfig, check_model
from diloco.config.outer_section import OuterConfig, Strategy, check_outer
from diloco.config.regions_section import (LinkConfig, RegionalConfig, RegionConfig, check_link, check_regional,
                                          check_regions)
from diloco.config.rules import (LEARNING_RATES, MAX_LEARNERS, MAX_QUANTITY, MAX_SEED, MAX_STEPS, MAX_TOKENS, require,
                                 require_at_most)
from diloco.config.train_section import TrainConfig, check_token_budget, check_train


@dataclass
class Config:
    """A run, as data: one field per TOML table (`[train]`, `[[regions]]`, …) and the top-level keys."""

    seed: int = 0
    strategy: Strategy = "decoupled"
    train: TrainConfig = field(default_factory=TrainConfig)
    learners: LearnersConfig = field(default_factory=LearnersConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    failures: FailuresConfig = field(default_factory=FailuresConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    regions: list[RegionConfig] = field(default_factory=list)
    """Where learners and the syncer are (`[[regions]]`); empty: every learner has its own `link` to the
    syncer. Given, they set `learners.speeds` and `learners.count`."""
    topology: Literal["flat", "regional"] = "flat"
    """`flat`: every learner syncs with the syncer. `regional`: with its region's syncer over the LAN, which
    syncs with the global syncer over the WAN (needs regions)."""
    regional: RegionalConfig = field(default_factory=RegionalConfig)
    placement: Literal["syncer", "links"] = "syncer"
    """Where fragments' home shards run (needs regions for `links`). `syncer`: all in the syncer's region.
    `links`: spread over the regions to keep the busiest WAN link, then the WAN bytes, then the round trip
    least (`network/homes.py`); the syncer's region is preferred on a tie."""

    def speeds(self) -> list[float]:
        """One relative speed per learner (all 1 when `learners.speeds` is empty). Where learners are, and
        the links between them, is asked of `Topology(config)` (`config/topology.py`)."""
        return list(self.learners.speeds) or [1.0] * self.learners.count

    def token_budget(self) -> int:
        """`train.tokens`, rounded down to whole steps of equal shares of every learner."""
        count = len(self.speeds())
        per_step = self.train.batch_size * self.train.seq_len
        return self.train.tokens // (count * per_step) * count * per_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate(config: Config) -> None:
    """Rules the types cannot say, in a fixed order (the first failure is the one reported)."""
    _check_finite(config)
    _check_quantities(config)
    check_regions(config.regions)
    _check_counts(config)
    _check_bounds(config)
    check_train(config.train)
    check_learners(config.learners)
    check_cluster(config.cluster)
    require(config.cluster.learner_processes == 1 or not any(n > 1 for n in config.learners.ranks),
            "learners.ranks", "sets processes per learner for `diloco run`; `diloco run --ray` takes them from "
            f"cluster.learner_processes (= {config.cluster.learner_processes}): set one of the two",
            config.learners.ranks)
    check_outer(config.outer, config.strategy, config.learners.count)
    check_failures(config.failures, config.learners.count, [r.name for r in config.regions])
    check_link(config.link, "link")
    check_model(config.model, config.train.seq_len)
    check_codec(config.codec)
    check_data(config.data)
    check_token_budget(config.train, config.learners.count)
    _check_topology(config)


def _numbers(node: Any, key: str) -> list[tuple[str, Any]]:
    """Every number in the config with its key, in field order: sections and lists walked."""
    if dataclasses.is_dataclass(node):
        return [pair for f in dataclasses.fields(node)
                for pair in _numbers(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)]
    if isinstance(node, list):
        return [pair for i, item in enumerate(node) for pair in _numbers(item, f"{key}[{i}]")]
    if isinstance(node, dict):
        return [pair for name, item in node.items() for pair in _numbers(item, f"{key}.{name}")]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return [(key, node)]
    return []


def _check_finite(config: Config) -> None:
    """No infinity or NaN anywhere: a rate, factor, speed or time that is not finite makes Θ or the
    schedule non-finite (and `x > 0` alone lets infinity through)."""
    for key, value in _numbers(config, ""):
        require(math.isfinite(value), key, "must be a finite number", value)


def _check_quantities(config: Config) -> None:
    """Every non-integer number within ±MAX_QUANTITY, and the learning rates within what a step can take:
    a value the type allows but training cannot live with (outer.lr = 1e308 makes every outer step fail)
    is refused here, once, not by every push."""
    for key, high in LEARNING_RATES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        require(value <= high, key, f"must be at most {high:g}", value)
    for key, value in _numbers(config, ""):
        if isinstance(value, float):
            require(abs(value) <= MAX_QUANTITY, key, f"must be within ±{MAX_QUANTITY:g}", value)


def _check_counts(config: Config) -> None:
    """Counts and sizes across sections that must be positive, then the seed: checked first, as the
    later rules (divisions, ranges up to a count) only make sense once these hold."""
    t, lc, o, m = config.train, config.learners, config.outer, config.model
    positive_ints = {
        "train.tokens": t.tokens, "train.batch_size": t.batch_size, "train.seq_len": t.seq_len,
        "train.eval_points": t.eval_points, "train.eval_batches": t.eval_batches,
        "learners.count": lc.count, "outer.H": o.H, "outer.fragments": o.fragments,
        "model.layers": m.layers, "model.width": m.width, "model.heads": m.heads,
        "metrics.every_steps": config.metrics.every_steps,
    }
    for key, value in positive_ints.items():
        require(value > 0, key, "must be positive", value)
    require(config.seed >= 0, "seed", "must be zero or positive", config.seed)


def _check_bounds(config: Config) -> None:
    """Upper bounds of the counts and sizes, once they are positive: beyond them a run cannot work (it
    cannot fit in memory, or a count stops being exact)."""
    t, lc, o, m = config.train, config.learners, config.outer, config.model
    require_at_most(config.seed, MAX_SEED, "seed", low=0, why="what torch and numpy take")
    require_at_most(t.tokens, MAX_TOKENS, "train.tokens", why="2^53, above which token counts are not exact")
    require_at_most(lc.count, MAX_LEARNERS, "learners.count",
                    why="the syncer keeps a copy of Θ and a ledger per learner")
    for key, value, high in (("train.batch_size", t.batch_size, 2**20), ("train.seq_len", t.seq_len, 2**20),
                             ("train.eval_points", t.eval_points, 10_000),
                             ("train.eval_batches", t.eval_batches, 10_000),
                             ("outer.H", o.H, MAX_STEPS), ("outer.fragments", o.fragments, 2**16),
                             ("model.layers", m.layers, 2**12), ("model.width", m.width, 2**20),
                             ("model.heads", m.heads, 2**12),
                             ("metrics.every_steps", config.metrics.every_steps, MAX_STEPS),
                             ("failures.checkpoint_every", config.failures.checkpoint_every, MAX_STEPS)):
        require_at_most(value, high, key)
    for key, value, high in (("train.warmup_steps", t.warmup_steps, MAX_STEPS),
                             ("outer.dn_buffer", o.dn_buffer, MAX_STEPS), ("model.context", m.context, 2**20),
                             ("data.vocab_size", config.data.vocab_size, 2**32)):
        if value >= 0:  # a negative one is refused with its own rule, below
            require_at_most(value, high, key, low=0)


def _check_topology(config: Config) -> None:
    """The regional tier and placement by links need regions and a strategy that syncs through a syncer."""
    if config.topology == "regional":
        require(bool(config.regions), "topology", "may be 'regional' only with [[regions]]", config.topology)
        require(config.strategy != "ddp", "topology",
                "must be 'flat' for ddp, which all-reduces gradients and has no syncer", config.topology)
    if config.placement == "links":
        require(bool(config.regions), "placement", "may be 'links' only with [[regions]]", config.placement)
        require(config.strategy != "ddp", "placement",
                "must be 'syncer' for ddp, which all-reduces gradients and has no syncer", config.placement)
    check_regional(config.regional)
