"""The rules a config must follow beyond its types: each failure names its key, in a fixed order."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.config import (ClusterConfig, Config, DataConfig, FailuresConfig, LearnersConfig, LinkConfig, ModelConfig,
                               OuterConfig, RegionConfig, Strategy, TrainConfig)


MAX_TOKENS = 2**53
"""Token counts above it are no longer exact as floats (rates, shares and budgets are computed in floats)."""
MAX_LEARNERS = 4096
"""The syncer keeps a copy of Θ (or of its fragments) and a ledger per learner: more cannot fit in memory."""
MAX_CODEC_BLOCK = 2**20
"""Elements per scale of the block codecs: one scale per million elements already quantizes coarsely."""
MAX_STEPS = 2**31 - 1
"""Step counts (H, warmup, checkpoint and metrics intervals): far beyond any run, still a 32-bit int."""
MAX_SEED = 2**63 - 1
"""The largest seed torch and numpy both take."""
MAX_QUANTITY = 1e9
"""Largest magnitude of any non-integer number in a config (a time of 30 years, a rate of 10^9): above
it no run has such a quantity, and products of it (lr × Δ, a time × a rate) leave float32."""
LEARNING_RATES = {"train.lr": 1.0, "outer.lr": 10.0, "regional.lr": 10.0}
"""The largest learning rate each step can live with: the inner AdamW moves each weight by about lr per
step; the outer Nesterov step moves Θ by lr × the merged progress (honest: 0.7 to 1)."""


def _require(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {rule}; got {value!r}")


def _require_at_most(value: int, high: int, key: str, low: int = 1, why: str = "") -> None:
    """An upper bound, checked once the lower one holds; the message gives the whole range."""
    _require(value <= high, key, f"must be in [{low:,}, {high:,}]" + (f": {why}" if why else ""), value)


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


def _validate_finite(config: Config) -> None:
    """No infinity or NaN anywhere: a rate, factor, speed or time that is not finite makes Θ or the
    schedule non-finite (and `x > 0` alone lets infinity through)."""
    for key, value in _numbers(config, ""):
        _require(math.isfinite(value), key, "must be a finite number", value)


def _validate_quantities(config: Config) -> None:
    """Every non-integer number within ±MAX_QUANTITY, and the learning rates within what a step can take:
    a value the type allows but training cannot live with (outer.lr = 1e308 makes every outer step fail)
    is refused here, once, not by every push."""
    for key, high in LEARNING_RATES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        _require(value <= high, key, f"must be at most {high:g}", value)
    for key, value in _numbers(config, ""):
        if isinstance(value, float):
            _require(abs(value) <= MAX_QUANTITY, key, f"must be within ±{MAX_QUANTITY:g}", value)


def validate(config: Config) -> None:
    """Rules the types cannot say. Each failure names its key.

    The first failing rule is the one reported, so the checks run in a fixed order, section by section.
    """
    _validate_finite(config)
    _validate_quantities(config)
    _validate_regions(config.regions)
    _validate_counts(config)
    _validate_bounds(config)
    _validate_train(config.train)
    _validate_learners(config.learners)
    _validate_cluster(config.cluster)
    _validate_outer(config.outer, config.strategy, config.learners.count)
    _validate_failures(config.failures, config.learners.count, [r.name for r in config.regions])
    _validate_link(config.link, "link")
    _validate_model(config.model, config.train.seq_len)
    _require(config.codec.block > 0, "codec.block", "must be positive", config.codec.block)
    _require_at_most(config.codec.block, MAX_CODEC_BLOCK, "codec.block")
    _validate_data(config.data)
    _validate_token_budget(config.train, config.learners.count)
    _validate_topology(config)


def _validate_topology(config: Config) -> None:
    """The regional tier and placement by links need regions and a strategy that syncs through a syncer."""
    if config.topology == "regional":
        _require(bool(config.regions), "topology", "may be 'regional' only with [[regions]]", config.topology)
        _require(config.strategy != "ddp", "topology",
                 "must be 'flat' for ddp, which all-reduces gradients and has no syncer", config.topology)
    if config.placement == "links":
        _require(bool(config.regions), "placement", "may be 'links' only with [[regions]]", config.placement)
        _require(config.strategy != "ddp", "placement",
                 "must be 'syncer' for ddp, which all-reduces gradients and has no syncer", config.placement)
    r = config.regional
    _require(r.push_every >= 1, "regional.push_every", "must be at least 1", r.push_every)
    _require(r.lr > 0, "regional.lr", "must be positive", r.lr)
    _require(0 <= r.momentum < 1, "regional.momentum", "must be in [0, 1)", r.momentum)


def _validate_counts(config: Config) -> None:
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
        _require(value > 0, key, "must be positive", value)
    _require(config.seed >= 0, "seed", "must be zero or positive", config.seed)


def _validate_bounds(config: Config) -> None:
    """Upper bounds of the counts and sizes, once they are positive: beyond them a run cannot work (it
    cannot fit in memory, or a count stops being exact)."""
    t, lc, o, m = config.train, config.learners, config.outer, config.model
    _require_at_most(config.seed, MAX_SEED, "seed", low=0, why="what torch and numpy take")
    _require_at_most(t.tokens, MAX_TOKENS, "train.tokens", why="2^53, above which token counts are not exact")
    _require_at_most(lc.count, MAX_LEARNERS, "learners.count",
                     why="the syncer keeps a copy of Θ and a ledger per learner")
    for key, value, high in (("train.batch_size", t.batch_size, 2**20), ("train.seq_len", t.seq_len, 2**20),
                             ("train.eval_points", t.eval_points, 10_000),
                             ("train.eval_batches", t.eval_batches, 10_000),
                             ("outer.H", o.H, MAX_STEPS), ("outer.fragments", o.fragments, 2**16),
                             ("model.layers", m.layers, 2**12), ("model.width", m.width, 2**20),
                             ("model.heads", m.heads, 2**12),
                             ("metrics.every_steps", config.metrics.every_steps, MAX_STEPS),
                             ("failures.checkpoint_every", config.failures.checkpoint_every, MAX_STEPS)):
        _require_at_most(value, high, key)
    for key, value, high in (("train.warmup_steps", t.warmup_steps, MAX_STEPS),
                             ("outer.dn_buffer", o.dn_buffer, MAX_STEPS), ("model.context", m.context, 2**20),
                             ("data.vocab_size", config.data.vocab_size, 2**32)):
        if value >= 0:  # a negative one is refused with its own rule, below
            _require_at_most(value, high, key, low=0)


def _validate_train(t: TrainConfig) -> None:
    """The inner optimizer's settings and the device name, which is a free string."""
    _require(t.lr > 0, "train.lr", "must be positive", t.lr)
    _require(t.weight_decay >= 0, "train.weight_decay", "must be zero or positive", t.weight_decay)
    _require(t.warmup_steps >= 0, "train.warmup_steps", "must be zero or positive", t.warmup_steps)
    _require(t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:"), "train.device",
             "must be auto, cpu, cuda or cuda:N", t.device)
    _require(t.grad_clip >= 0, "train.grad_clip", "must be zero or positive (0 turns clipping off)", t.grad_clip)


def _validate_learners(lc: LearnersConfig) -> None:
    """The fleet: one speed per learner (when given) and the simulator's step-time noise."""
    if lc.speeds:
        _require(len(lc.speeds) == lc.count, "learners.speeds",
                 f"must have one entry per learner (learners.count = {lc.count})", lc.speeds)
        for i, s in enumerate(lc.speeds):
            _require(s > 0, f"learners.speeds[{i}]", "must be positive", s)
    _require(0 <= lc.jitter < 1, "learners.jitter", "must be in [0, 1)", lc.jitter)
    _require(0 <= lc.drift < 1, "learners.drift", "must be in [0, 1)", lc.drift)
    _require(lc.drift_steps > 0, "learners.drift_steps", "must be positive", lc.drift_steps)
    _require(lc.step_time_s > 0, "learners.step_time_s", "must be positive", lc.step_time_s)
    _require(lc.min >= 0, "learners.min", "must be zero (the count) or positive", lc.min)
    _require(lc.max >= 0, "learners.max", "must be zero (the count) or positive", lc.max)
    _require(lc.min <= lc.count, "learners.min", f"must be at most learners.count ({lc.count})", lc.min)
    _require(lc.max == 0 or lc.max >= lc.count, "learners.max", f"must be at least learners.count ({lc.count})",
             lc.max)
    _require_at_most(lc.max, MAX_LEARNERS, "learners.max", low=0, why="the syncer keeps a ledger per learner")


def _validate_cluster(c: ClusterConfig) -> None:
    """What a Ray launcher reserves per process: nothing negative, and a learner that needs something."""
    _require(c.learner_processes > 0, "cluster.learner_processes", "must be positive", c.learner_processes)
    _require_at_most(c.learner_processes, 4096, "cluster.learner_processes")
    for key, value in (("cluster.learner_cpus", c.learner_cpus), ("cluster.learner_gpus", c.learner_gpus),
                       ("cluster.syncer_cpus", c.syncer_cpus),
                       *((f"cluster.learner_resources.{k}", v) for k, v in c.learner_resources.items())):
        _require(value >= 0, key, "must be zero or positive", value)
    _require(c.learner_cpus + c.learner_gpus + sum(c.learner_resources.values()) > 0, "cluster.learner_cpus",
             "a learner must reserve something (CPUs, GPUs or a custom resource)", c.learner_cpus)
    for key, names in (("cluster.learner_resources", c.learner_resources), ("cluster.learner_labels", c.learner_labels),
                       ("cluster.syncer_labels", c.syncer_labels)):
        for name in names:
            _require(bool(name.strip()), key, "names must not be empty", name)
    _require(c.below_min_timeout_s > 0, "cluster.below_min_timeout_s", "must be positive", c.below_min_timeout_s)


def _validate_outer(o: OuterConfig, strategy: Strategy, learners: int) -> None:
    """The outer loop: sync schedule, outer optimizer, quorum and grace window, outlier filter.

    Fragments must fit in H only for the strategies that stagger them over the H steps.
    """
    _require(o.fragments <= o.H or strategy not in ("streaming", "decoupled"), "outer.fragments",
             f"must be at most outer.H ({o.H}) so that fragments sync on distinct steps", o.fragments)
    _require(0 <= o.tau < o.H, "outer.tau", f"must be in [0, outer.H) = [0, {o.H})", o.tau)
    _require(0 <= o.alpha <= 1, "outer.alpha", "must be in [0, 1]", o.alpha)
    _require(o.lr > 0, "outer.lr", "must be positive", o.lr)
    _require(0 <= o.momentum < 1, "outer.momentum", "must be in [0, 1)", o.momentum)
    _require(0 <= o.quorum <= learners, "outer.quorum", f"must be in [0, learners.count] = [0, {learners}]", o.quorum)
    _require(o.grace >= 0, "outer.grace", "must be zero or positive (0 turns the grace window off)", o.grace)
    _require(o.grace_cap_steps >= 0, "outer.grace_cap_steps", "must be zero or positive", o.grace_cap_steps)
    _require(o.dn_buffer >= 0, "outer.dn_buffer", "must be zero or positive", o.dn_buffer)
    _require(o.outlier_factor > 1, "outer.outlier_factor", "must be above 1", o.outlier_factor)


def _validate_failures(f: FailuresConfig, learners: int, regions: list[str]) -> None:
    """Scheduled crashes and outages must name an existing learner (or region); then the random-failure
    knobs."""
    for kind, events in (("crashes", f.crashes), ("outages", f.outages)):
        for i, event in enumerate(events):
            key = f"failures.{kind}[{i}]"
            _require(0 <= event.learner < learners, f"{key}.learner", f"must be in [0, {learners})", event.learner)
            _require(event.at_s >= 0, f"{key}.at_s", "must be zero or positive", event.at_s)
    for i, outage in enumerate(f.outages):
        _require(outage.duration_s > 0, f"failures.outages[{i}].duration_s", "must be positive", outage.duration_s)
        _require(not outage.region or outage.region in regions, f"failures.outages[{i}].region",
                 f"must name a region ({_known(regions)})", outage.region)
    _require(f.mtbf_s >= 0, "failures.mtbf_s", "must be zero or positive (0: no random crashes)", f.mtbf_s)
    _require(f.recovery_s >= 0, "failures.recovery_s", "must be zero or positive", f.recovery_s)
    _require(f.detect_s >= 0, "failures.detect_s", "must be zero or positive", f.detect_s)
    _require(f.checkpoint_every > 0, "failures.checkpoint_every", "must be positive", f.checkpoint_every)


def _validate_link(ln: LinkConfig, key: str) -> None:
    """A simulated (or emulated) link: some bandwidth, no negative latency."""
    _require(ln.bandwidth_mbit > 0, f"{key}.bandwidth_mbit", "must be positive", ln.bandwidth_mbit)
    _require(ln.latency_ms >= 0, f"{key}.latency_ms", "must be zero or positive", ln.latency_ms)


def _known(names: list[str]) -> str:
    return f"known: {', '.join(names)}" if names else "no regions are configured"


def _validate_regions(regions: list[RegionConfig]) -> None:
    """Checked before the counts, which regions set: names unique, links that carry something, WAN
    overrides towards other existing regions, one syncer, and some learner somewhere."""
    names = [r.name for r in regions]
    for i, region in enumerate(regions):
        key = f"regions[{i}]"
        _require(bool(region.name.strip()), f"{key}.name", "must not be empty", region.name)
        _require(region.name not in names[:i], f"{key}.name",
                 f"must be unique (regions[{names.index(region.name)}] has it too)", region.name)
        for j, speed in enumerate(region.speeds):
            _require(speed > 0, f"{key}.speeds[{j}]", "must be positive", speed)
        _validate_link(region.lan, f"{key}.lan")
        _validate_link(region.wan, f"{key}.wan")
        targets = [w.region for w in region.wan_to]
        for j, wan in enumerate(region.wan_to):
            _require(wan.region in names and wan.region != region.name, f"{key}.wan_to[{j}].region",
                     f"must name another region than {region.name!r} ({_known(names)})", wan.region)
            _require(wan.region not in targets[:j], f"{key}.wan_to[{j}].region", "must not repeat an earlier entry",
                     wan.region)
            _validate_link(wan, f"{key}.wan_to[{j}]")
    if regions:
        syncers = [i for i, r in enumerate(regions) if r.syncer]
        _require(len(syncers) == 1, "regions", "must have exactly one region with syncer = true",
                 [names[i] for i in syncers])
        _require(any(r.speeds for r in regions), "regions", "must give at least one learner (a region's speeds)",
                 {r.name: r.speeds for r in regions})


def _validate_model(m: ModelConfig, seq_len: int) -> None:
    """Shape rules the transformer needs: heads split the width, the context holds a training sequence."""
    _require(m.width % m.heads == 0, "model.heads", f"must divide model.width ({m.width})", m.heads)
    _require(m.context == 0 or m.context >= seq_len, "model.context",
             f"must be 0 or at least train.seq_len ({seq_len})", m.context)
    _require(0 <= m.dropout < 1, "model.dropout", "must be in [0, 1)", m.dropout)
    _require(m.factory == "" or ":" in m.factory, "model.factory", "must look like 'package.module:callable'",
             m.factory)


def _validate_data(d: DataConfig) -> None:
    """The eval split must leave both parts non-empty; a vocab_size of 0 means "read it off the data"."""
    _require(0 < d.eval_fraction < 1, "data.eval_fraction", "must be in (0, 1)", d.eval_fraction)
    _require(d.vocab_size >= 0, "data.vocab_size", "must be zero or positive", d.vocab_size)


def _validate_token_budget(t: TrainConfig, learners: int) -> None:
    """Checked last, as it combines sections: the budget must give every learner at least one step."""
    tokens_per_round = learners * t.batch_size * t.seq_len
    _require(t.tokens >= tokens_per_round, "train.tokens",
             f"must cover at least one step of every learner ({tokens_per_round} tokens)", t.tokens)
