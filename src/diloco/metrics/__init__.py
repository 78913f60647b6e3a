"""What every learner, link, round and shard is doing: one catalog of metric names, recorded by the
simulator and the real runtime alike, written to JSONL, TensorBoard, Weights & Biases and Prometheus."""

from diloco.metrics.catalog import CATALOG, KINDS
from diloco.metrics.log import MetricsLog, open_metrics

__all__ = ["CATALOG", "KINDS", "MetricsLog", "open_metrics"]
