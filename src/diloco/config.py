"""Typed run configuration: dataclasses loaded from TOML and overridden with `--set key=value`.

Every key is checked against the dataclass field types, then against the rules in `config_rules.py`.
A problem raises `ConfigError` with a one-line message that names the key.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from diloco.config_rules import validate
from diloco.errors import ConfigError

Strategy = Literal["ddp", "diloco", "streaming", "async", "async-dn", "decoupled"]


@dataclass
class TrainConfig:
    tokens: int = 1_200_000
    """Total token budget, summed over all learners."""
    batch_size: int = 16
    """Sequences per inner step, per learner."""
    seq_len: int = 64
    lr: float = 3e-3
    """Peak learning rate of each learner's inner AdamW."""
    weight_decay: float = 0.1
    warmup_steps: int = 20
    schedule: Literal["cosine", "constant"] = "cosine"
    """Follows each learner's own step count, never the wall-clock."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 turns clipping off."""
    eval_points: int = 8
    """How many times the global model is evaluated during the run (the last one at the end)."""
    eval_batches: int = 8
    device: str = "auto"
    """Where a real learner trains: `auto` (the GPU when there is one), `cpu`, `cuda` or `cuda:N`. The
    simulator always trains on the CPU."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: forward and backward under bf16 autocast; parameters, optimizer state and syncing stay fp32."""
    compile: bool = False
    """torch.compile the model of a real learner."""


DEFAULT_SPEEDS = (1.0, 1.0, 0.5, 0.25)


@dataclass
class LearnersConfig:
    count: int = 4
    speeds: list[float] = field(default_factory=lambda: list(DEFAULT_SPEEDS))
    """Relative speeds, one per learner; empty means all 1. Setting it alone sets `count` too; setting
    `count` alone makes every learner equal. The default: two fast learners, one at half and one at a
    quarter of their speed, the heterogeneous fleet Decoupled DiLoCo is for."""
    jitter: float = 0.23
    """Simulator: relative standard deviation of each step's time, independent from step to step."""
    drift: float = 0.16
    """Simulator: relative standard deviation of a learner's slowly wandering speed (correlated over
    `drift_steps` steps): what lets equal learners drift apart. The defaults of jitter, drift and
    drift_steps are what `diloco run`'s learners show on a 2-core machine (docs/algorithms.md);
    jitter = drift = 0 is the lockstep model."""
    drift_steps: float = 10.0
    """Simulator: correlation time of the drift, in steps."""
    step_time_s: float = 0.05
    """Simulator: virtual seconds of one inner step at speed 1 (the built-in model's step in `diloco
    run` on a 2-core machine; set your learners' own to predict a real run)."""
    min: int = 0
    """`diloco run --ray`: the fewest learners the run trains on (it waits for capacity below that);
    0 means `count`."""
    max: int = 0
    """`diloco run --ray`: the most learners at once, started wherever matching capacity appears; 0 means
    `count`. Learners beyond `count` get new ids and train at speed 1."""

    def bounds(self) -> tuple[int, int]:
        """(min, max) learners of an elastic run, their zeros resolved to `count`."""
        return self.min or self.count, self.max or self.count


@dataclass
class OuterConfig:
    H: int = 50
    """Inner steps between two syncs of the same fragment."""
    fragments: int = 4
    tau: int = 2
    """Inner steps a learner keeps training between sending a fragment and merging the answer."""
    alpha: float = 0.25
    """Mixing: θ ← α·θ + (1 − α)·Θ̃ when merging; 0 overwrites (streaming and decoupled; DiLoCo
    always overwrites)."""
    lr: float = 0.7
    momentum: float = 0.9
    quorum: int = 1
    """Minimum learners K in a round of a fragment (decoupled); 0 means all learners alive."""
    grace: float = 1.0
    """γ: how long a round may wait for more learners after its quorum, as a share of its slack (with
    pacing: of half a sync period; without: of τ steps less the measured trip); 0 turns waiting off."""
    grace_cap_steps: float = 25.0
    """Upper bound of that wait, in the fastest learner's step times (a bound, not the mechanism)."""
    pacing: bool = True
    """Decoupled: the syncer predicts each learner's next push from its progress, holds rounds for the
    learners about to land, and tells each when to push next so that rounds gather everyone."""
    keep_progress: bool = False
    """Decoupled: a merge keeps what the learner trained since sending, θ ← Θ̃ + (θ − θ_sent)."""
    stale_weight: Literal["full", "inverse"] = "full"
    """Decoupled: how a push based on an older version weighs in its round: as any other (`full`), or
    divided by 1 + the versions it is behind (`inverse`)."""
    consolidate: bool = True
    """Decoupled: the run's last round of each fragment sets Θ to the learners' weighted mean."""
    merge: Literal["mean", "weighted", "rda"] = "rda"
    """How the decoupled syncer merges a round (DiLoCo and Streaming DiLoCo use the mean)."""
    dn_buffer: int = 0
    """Delayed Nesterov: arrivals per momentum update; 0 means the number of learners."""
    outlier: Literal["off", "clip", "reject"] = "clip"
    """A push larger than the fragment's own scale allows (a multiple of its norm, checked from the
    first push) is refused unless this is `off`; one larger than outlier_factor x the learners' median
    push size (core/outliers.py) is clipped to that bound (`clip`) or refused (`reject`). `clip` by
    default: an honest push can be large (a learner restarted from its own checkpoint), and a refused
    one comes back larger each time, so its learner would never be merged again; a clipped one moves Θ
    by at most the bound. In the default runs no honest push came within 1.7x of the bound."""
    outlier_factor: float = 5.0


@dataclass
class CrashConfig:
    learner: int = 0
    at_s: float = 0.0
    """Virtual time of the crash."""


@dataclass
class OutageConfig:
    learner: int = 0
    """The learner whose link goes down (when `region` is empty)."""
    region: str = ""
    """A region that goes down as a whole instead (`regions`): its learners crash for the duration."""
    at_s: float = 0.0
    duration_s: float = 0.0


@dataclass
class FailuresConfig:
    crashes: list[CrashConfig] = field(default_factory=list)
    """Crashes at given times, e.g. [{learner = 2, at_s = 60}]."""
    mtbf_s: float = 0.0
    """Mean time between random crashes of each learner; 0 turns random crashes off."""
    recovery_s: float = 30.0
    """From a crash until the learner is back and asks for Θ."""
    detect_s: float = 5.0
    """The silence after which the syncer counts a learner as dead (or 5 of its measured heartbeat
    intervals, if longer): rounds stop counting on it. Both the simulator and the real runtime."""
    restore: Literal["checkpoint", "fresh"] = "checkpoint"
    """Inner-optimizer state after a crash: the learner's own last checkpoint, or a fresh AdamW (both
    drivers; data position and step always come from the checkpoint)."""
    checkpoint_every: int = 25
    """Inner steps between a learner's checkpoints of its optimizer state and data position."""
    outages: list[OutageConfig] = field(default_factory=list)
    """Link outages, e.g. [{learner = 1, at_s = 30, duration_s = 20}]: nothing crosses that link meanwhile;
    or regional outages, e.g. [{region = "eu", at_s = 30, duration_s = 60}]: the region's learners crash and
    are back when it ends (simulator)."""


CodecName = Literal["fp32", "bf16", "int8", "int4", "fp4"]


@dataclass
class CodecConfig:
    up: CodecName = "fp32"
    """How outer gradients travel to the syncer."""
    down: CodecName = "fp32"
    """How new global values travel back (as the difference to what the learner holds)."""
    block: int = 64
    """Elements per scale of int8, int4 and fp4."""
    error_feedback: bool = False
    """Learners add what the uplink codec lost last time to their next push of the same tensor."""


@dataclass
class LinkConfig:
    bandwidth_mbit: float = 100.0
    """Each learner's link, per direction (with `regions`: what a region's `lan` and `wan` leave out)."""
    latency_ms: float = 50.0


@dataclass
class RegionLinkConfig(LinkConfig):
    """The WAN link from a region to one named other region, in that direction; the keys it leaves out
    are the region's `wan`."""

    region: str = ""


@dataclass
class RegionConfig:
    """A group of learners behind one WAN link: `[[regions]]` tables, learners numbered in region order."""

    name: str = ""
    speeds: list[float] = field(default_factory=list)
    """Its learners' relative speeds: one entry per learner."""
    lan: LinkConfig = field(default_factory=LinkConfig)
    """Each of its learners' own link inside the region."""
    wan: LinkConfig = field(default_factory=LinkConfig)
    """Its link to any other region (from here to there), unless `wan_to` names that region."""
    wan_to: list[RegionLinkConfig] = field(default_factory=list)
    """Links to named regions that differ from `wan`, e.g. [{region = "ap", latency_ms = 80}]."""
    syncer: bool = False
    """The syncer runs here (exactly one region): its learners reach it over their LAN alone."""


@dataclass(frozen=True, eq=False)
class Hop:
    """One link on a learner's way to the syncer: `up` carries traffic from `near` to `far` (towards the
    syncer), `down` back. A learner's LAN hop is its own; a WAN hop is its region's, shared by the
    region's learners (and named by its two ends, so that whoever else sends between them shares it)."""

    kind: Literal["lan", "wan"]
    near: str
    """`learner M` for a LAN hop, the learner's region for a WAN hop."""
    far: str
    """The region towards the syncer."""
    up: LinkConfig
    down: LinkConfig

    @property
    def name(self) -> str:
        return f"{self.near} LAN" if self.kind == "lan" else f"{self.near}→{self.far} (WAN)"


@dataclass
class RegionalConfig:
    """The regional tier (`topology = "regional"`): one syncer per region between its learners and the
    global syncer (`core/regional.py`)."""

    push_every: int = 1
    """Regional rounds of a fragment per push of it to the global syncer."""
    lr: float = 1.0
    """The regional rounds' outer step: lr 1 without momentum moves the region's Θ by its learners' mean
    progress, and leaves the outer optimizer to the global syncer."""
    momentum: float = 0.0
    codec: Literal["", "fp32", "bf16", "int8", "int4", "fp4"] = ""
    """How the regional syncer's pushes travel to the global syncer; empty: `codec.up`."""


@dataclass
class ModelConfig:
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 0
    """Longest sequence the model accepts; 0 means train.seq_len."""
    dropout: float = 0.0
    factory: str = ""
    """`module:callable` returning any nn.Module whose forward(inputs, targets) is a scalar loss."""


@dataclass
class DataConfig:
    source: str = "shakespeare"
    """`shakespeare` (bundled, byte-level) or the path of a flat binary file of token ids."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a token file, as nanoGPT writes them."""
    vocab_size: int = 0
    """Vocabulary of a token file; 0 means the largest id in it plus one."""
    eval_fraction: float = 0.05


@dataclass
class MetricsConfig:
    every_steps: int = 10
    """Inner steps between two records of a learner's metrics."""
    tensorboard: bool = False
    """Also write TensorBoard event files under OUT/tensorboard (needs the `tensorboard` extra)."""
    wandb: str = ""
    """A Weights & Biases project to log to (needs wandb installed); empty: off."""


@dataclass
class ClusterConfig:
    """Where `diloco run --ray` places its processes (the local launcher ignores this section)."""

    learner_cpus: float = 1.0
    """CPUs each learner process reserves."""
    learner_gpus: float = 0.0
    """GPUs each learner process reserves."""
    learner_processes: int = 1
    """Processes of one learner (data-parallel ranks under torchrun): started together, on one node."""
    learner_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each learner reserves, e.g. {chip_h100 = 1}."""
    learner_labels: dict[str, str] = field(default_factory=dict)
    """Node labels a learner's node must carry, e.g. {region = "eu-west"}."""
    syncer_cpus: float = 1.0
    """CPUs each syncer shard reserves (shards never ask for a GPU)."""
    syncer_labels: dict[str, str] = field(default_factory=dict)
    """Node labels a shard's node must carry."""
    storage: str = ""
    """A folder every node sees (NFS, a mounted bucket): shards' state and journals, learners'
    checkpoints and reports, logs. Empty: the run's output folder, which must then be shared."""
    price_label: str = "price_per_hour"
    """The node label that holds a node's price per hour: the cheapest matching nodes fill first."""
    region_label: str = "region"
    """The node label that names a node's region, for the reports."""
    below_min_timeout_s: float = 300.0
    """How long the run may stay below `learners.min` learners before it stops (state saved)."""
    emulate_link: bool = True
    """Shape each learner's traffic to `link.*`, as on one machine. Turn it off where the links between
    nodes are the real ones being studied."""


@dataclass
class Config:
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
        return list(self.learners.speeds) or [1.0] * self.learners.count

    # ------------------------------------------------------------ regions: the one place to ask

    def learners_of(self, region: str) -> range:
        """The ids of a region's learners (empty for a name that is not a region)."""
        first = 0
        for r in self.regions:
            if r.name == region:
                return range(first, first + len(r.speeds))
            first += len(r.speeds)
        return range(0)

    def region_of(self, learner: int) -> str | None:
        """The region of a learner; None without regions, or for an id beyond them (an elastic run's extra
        learners)."""
        return next((r.name for r in self.regions if learner in self.learners_of(r.name)), None)

    def syncer_region(self) -> str | None:
        return next((r.name for r in self.regions if r.syncer), None)

    def wan_link(self, source: str, target: str) -> LinkConfig:
        """The WAN link from region `source` to region `target`: its `wan_to` entry, else its `wan`."""
        region = next(r for r in self.regions if r.name == source)
        return next((w for w in region.wan_to if w.region == target), region.wan)

    @property
    def tiered(self) -> bool:
        """The regional tier is on (`topology = "regional"` with regions)."""
        return self.topology == "regional" and bool(self.regions)

    def route(self, learner: int, home: str | None = None) -> list[Hop]:
        """The links a learner's messages cross to the shard in region `home` (default: the syncer's), in
        order (back: in reverse): its LAN, then, flat and outside that region, its region's WAN link there
        (`region_route`); with the regional tier its syncer is its region's, over the LAN alone. Empty
        without regions: `link`."""
        region, syncer = self.region_of(learner), self.syncer_region()
        if region is None or syncer is None:
            return []
        lan = next(r.lan for r in self.regions if r.name == region)
        hops = [Hop("lan", f"learner {learner}", region, lan, lan)]
        return hops if self.tiered else hops + self.region_route(region, home)

    def homes(self, fragments: int) -> list[str]:
        """The regions that home some of `fragments` fragments, in `[[regions]]` order (by default the
        syncer's alone)."""
        homes = set(self.fragment_homes(fragments))
        return [r.name for r in self.regions if r.name in homes]

    def fragment_homes(self, fragments: int) -> list[str]:
        """The region of each fragment's home shard (empty without regions)."""
        syncer = self.syncer_region()
        if syncer is None:
            return []
        if self.placement == "syncer":
            return [syncer] * fragments
        from diloco.network.homes import Site, place

        senders = {r.name for r in self.tier_regions()}
        speeds = self.speeds()
        sites = [Site(r.name, (1.0 if r.name in senders else 0.0) if self.tiered
                      else sum(speeds[m] for m in self.learners_of(r.name)),
                      {o.name: self.wan_link(r.name, o.name).bandwidth_mbit for o in self.regions if o is not r},
                      {o.name: self.wan_link(r.name, o.name).latency_ms for o in self.regions if o is not r})
                 for r in self.regions]
        return place(sites, fragments, preferred=syncer, answer_ratio=self._answer_ratio())

    def _answer_ratio(self) -> float:
        """An answer's wire bytes over a push's, for the global syncer's senders (their codecs differ)."""
        from diloco.codecs.registry import get_codec

        up = self.regional.codec or self.codec.up if self.tiered else self.codec.up
        numel, block = 1 << 20, self.codec.block
        return get_codec(self.codec.down, block).wire_bytes(numel, block) / get_codec(up, block).wire_bytes(numel, block)

    def tier_regions(self) -> list[RegionConfig]:
        """With the regional tier, the regions that have learners, in order: their syncers are the global
        syncer's learners, numbered from 0. Empty without the tier."""
        return [r for r in self.regions if r.speeds] if self.tiered else []

    def region_period(self, region: str) -> float:
        """A region's pacing period in its fastest learner's steps: H steps of the fastest learner of all,
        in time, so that every region syncs on the same grid (not rounded: a half-speed region with H = 5
        syncs every 2.5 of its steps, as the others every 5 of theirs)."""
        speeds, members = self.speeds(), self.learners_of(region)
        return self.outer.H * max(speeds[m] for m in members) / max(speeds)

    def region_route(self, region: str, home: str | None = None) -> list[Hop]:
        """The WAN hop from a region to region `home` (default: the syncer's; none from that region)."""
        home = home or self.syncer_region()
        if home is None or region == home:
            return []
        return [Hop("wan", region, home, self.wan_link(region, home), self.wan_link(home, region))]

    def emulated_link(self, learner: int | None, home: str | None = None) -> LinkConfig:
        """One link standing for a learner's route towards the shards in region `home` (default: the
        syncer's), as the real runtime shapes it: the slowest hop's bandwidth and the sum of the latencies
        (`link` without regions, or without an id)."""
        hops = self.route(learner, home) if learner is not None else []
        if not hops:
            return self.link
        return LinkConfig(bandwidth_mbit=min(h.up.bandwidth_mbit for h in hops),
                          latency_ms=sum(h.up.latency_ms for h in hops))

    def token_budget(self) -> int:
        """`train.tokens`, rounded down to whole steps of equal shares of every learner."""
        count = len(self.speeds())
        per_step = self.train.batch_size * self.train.seq_len
        return self.train.tokens // (count * per_step) * count * per_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file, then each `key=value` override, then validation."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_toml(Path(path))
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    return config_from_dict(raw)


def _read_toml(path: Path) -> dict[str, Any]:
    """The file's TOML; a missing, unreadable, non-UTF-8 or malformed file is a one-line error."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}): TOML files are UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} nests too deeply to be a config") from None


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value`: the value is read as TOML; a bare word that is not TOML is taken as a string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    text = text.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = text
    return key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def config_from_dict(raw: dict[str, Any]) -> Config:
    config = _build(Config, raw, prefix="")
    learners_raw = raw.get("learners", {})
    if isinstance(learners_raw, dict) and config.learners.speeds and "count" not in learners_raw:
        config.learners.count = len(config.learners.speeds)
    if isinstance(learners_raw, dict) and "count" in learners_raw and "speeds" not in learners_raw:
        config.learners.speeds = []
    if config.regions:
        _derive_from_regions(config, raw)
    _check_outage_targets(raw)
    validate(config)
    return config


def _derive_from_regions(config: Config, raw: dict[str, Any]) -> None:
    """What regions imply (the raw tables are well-formed by now, `_build` took them): link keys a region
    leaves out, and the learners, which `learners.speeds` or `learners.count` may repeat but not contradict."""
    link_keys = [f.name for f in dataclasses.fields(LinkConfig)]
    for region, region_raw in zip(config.regions, raw["regions"]):
        for side in ("lan", "wan"):
            _fill_missing(getattr(region, side), region_raw.get(side, {}), config.link, link_keys)
        for entry, entry_raw in zip(region.wan_to, region_raw.get("wan_to", [])):
            _fill_missing(entry, entry_raw, region.wan, link_keys)
    speeds = [s for r in config.regions for s in r.speeds]
    given = raw.get("learners", {})
    if "speeds" in given and config.learners.speeds != speeds and (config.learners.speeds or set(speeds) - {1.0}):
        raise ConfigError(f"config key 'learners.speeds' must be the regions' speeds {speeds} or be left out "
                          f"(regions set it); got {config.learners.speeds!r}")
    if "count" in given and config.learners.count != len(speeds):
        raise ConfigError(f"config key 'learners.count' must be {len(speeds)}, the regions' learners, or be left "
                          f"out (regions set it); got {config.learners.count!r}")
    config.learners.speeds, config.learners.count = speeds, len(speeds)


def _fill_missing(target: Any, given: dict[str, Any], source: Any, keys: list[str]) -> None:
    for key in keys:
        if key not in given:
            setattr(target, key, getattr(source, key))


def _check_outage_targets(raw: dict[str, Any]) -> None:
    """An outage names a learner (its link goes down) or a region (its learners crash), not both."""
    failures = raw.get("failures", {})
    for i, outage in enumerate(failures.get("outages", []) if isinstance(failures, dict) else []):
        if isinstance(outage, dict) and "learner" in outage and "region" in outage:
            raise ConfigError(f"config key 'failures.outages[{i}]' names a learner and a region: give one; "
                              f"got {outage!r}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.')}' must be a section (a table)")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            where = f"'{prefix}{key}'"
            raise ConfigError(f"unknown config key {where} (known here: {', '.join(sorted(names))})")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        hint = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, raw[f.name], prefix=key + ".")
        else:
            values[f.name] = _coerce(raw[f.name], hint, key)
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            named = ", ".join('""' if c == "" else str(c) for c in choices)
            raise ConfigError(f"config key '{key}' must be one of {named}; got {value!r}")
        return value
    if origin in (list, typing.List):
        (item_hint,) = get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' must be a list, e.g. [1, 1, 0.5]; got {value!r}")
        if dataclasses.is_dataclass(item_hint):
            return [_build(item_hint, v, prefix=f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_hint, item_hint = get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a table, e.g. {{name = 1}}; got {value!r}")
        return {_coerce(k, key_hint, key): _coerce(v, item_hint, f"{key}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported config type for {key}: {hint}")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be true or false; got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be an integer; got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be a number; got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' must be a string; got {value!r}")
        return value
    raise TypeError(f"unsupported config type for {key}: {hint}")
