"""Typed run configuration, as data: one dataclass per TOML section (`*_section.py`, each with its own
rules), the whole (`run_config.py`), the loader (`toml_loader.py`) and the topology queries
(`topology.py`: `Topology(config)`)."""

from diloco.config.cluster_section import ClusterConfig
from diloco.config.codec_section import CodecConfig, CodecName
from diloco.config.data_section import DataConfig
from diloco.config.failures_section import CrashConfig, FailuresConfig, OutageConfig
from diloco.config.learners_section import DEFAULT_SPEEDS, LearnersConfig
from diloco.config.metrics_section import MetricsConfig
from diloco.config.model_section import ModelConfig
from diloco.config.outer_section import OuterConfig, Strategy
from diloco.config.regions_section import LinkConfig, RegionalConfig, RegionConfig, RegionLinkConfig
from diloco.config.run_config import Config, validate
from diloco.config.toml_loader import config_from_dict, load_config, parse_override
from diloco.config.topology import Hop, Topology
from diloco.config.train_section import TrainConfig

__all__ = ["DEFAULT_SPEEDS", "ClusterConfig", "CodecConfig", "CodecName", "Config", "CrashConfig", "DataConfig",
           "FailuresConfig", "Hop", "LearnersConfig", "LinkConfig", "MetricsConfig", "ModelConfig", "OuterConfig",
           "OutageConfig", "RegionConfig", "RegionLinkConfig", "RegionalConfig", "Strategy", "Topology",
           "TrainConfig", "config_from_dict", "load_config", "parse_override", "validate"]
