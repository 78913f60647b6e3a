"""`[cluster]`: where `diloco run --ray` places its processes and what each reserves."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.config.rules import require, require_at_most


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


def check_cluster(c: ClusterConfig) -> None:
    """What a Ray launcher reserves per process: nothing negative, and a learner that needs something."""
    require(c.learner_processes > 0, "cluster.learner_processes", "must be positive", c.learner_processes)
    require_at_most(c.learner_processes, 4096, "cluster.learner_processes")
    for key, value in (("cluster.learner_cpus", c.learner_cpus), ("cluster.learner_gpus", c.learner_gpus),
                       ("cluster.syncer_cpus", c.syncer_cpus),
                       *((f"cluster.learner_resources.{k}", v) for k, v in c.learner_resources.items())):
        require(value >= 0, key, "must be zero or positive", value)
    require(c.learner_cpus + c.learner_gpus + sum(c.learner_resources.values()) > 0, "cluster.learner_cpus",
            "a learner must reserve something (CPUs, GPUs or a custom resource)", c.learner_cpus)
    for key, names in (("cluster.learner_resources", c.learner_resources), ("cluster.learner_labels", c.learner_labels),
                       ("cluster.syncer_labels", c.syncer_labels)):
        for name in names:
            require(bool(name.strip()), key, "names must not be empty", name)
    require(c.below_min_timeout_s > 0, "cluster.below_min_timeout_s", "must be positive", c.below_min_timeout_s)
