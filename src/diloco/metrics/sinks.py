"""Where records go. Each sink takes whole records ({"kind", "time_s", fields...})."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Protocol, Sequence

from diloco.errors import DilocoError
from diloco.metrics.catalog import CATALOG, LABELS
from diloco.outputs import writing


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, flushed per record so a killed run keeps what it measured."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self._lock, writing(self.path):
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _source(record: dict[str, Any]) -> str:
    labels = LABELS[record["kind"]]
    return "-".join(f"{label}{record[label]}" for label in labels if record.get(label) is not None) or "run"


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's metrics as numbers, its labels left out: a list of learners counts its items, a list
    of numbers gives their mean, a flag is 0 or 1."""
    out = {}
    for name in CATALOG[record["kind"]]:
        value = record.get(name)
        if isinstance(value, list):
            value = len(value) if name == "participants" else (sum(value) / len(value) if value else None)
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            out[name] = float(value)
    return out


class TensorBoardSink:
    def __init__(self, logdir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise DilocoError("metrics.tensorboard needs tensorboard: pip install 'diloco[tensorboard]'") from None
        self.writer = SummaryWriter(str(logdir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["time_s"] * 1000)  # milliseconds since the run started: one axis for all
        for name, value in _numbers(record).items():
            self.writer.add_scalar(f"{record['kind']}/{_source(record)}/{name}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, name: str, out: Path | None) -> None:
        try:
            import wandb
        except ImportError:
            raise DilocoError("metrics.wandb is set but Weights & Biases is not installed: pip install wandb") \
                from None
        self.run = wandb.init(project=project, name=name, dir=str(out) if out else None, reinit=True)

    def write(self, record: dict[str, Any]) -> None:
        prefix = f"{record['kind']}/{_source(record)}"
        self.run.log({f"{prefix}/{n}": v for n, v in _numbers(record).items()} | {"time_s": record["time_s"]})

    def close(self) -> None:
        self.run.finish()


class PrometheusSink:
    """Gauges `diloco_<kind>_<name>{labels}` holding each metric's latest value, served at `/metrics` on
    `host:port` by the same hardened server as the status page (with `credentials`, only to requests
    that carry one)."""

    def __init__(self, port: int, host: str = "127.0.0.1", credentials: Sequence[bytes] = ()) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

        from diloco.status.endpoint import HttpEndpoint, join_bind

        self.registry = CollectorRegistry()
        self.gauges = {(kind, name): Gauge(f"diloco_{kind}_{name}", help_text, LABELS[kind], registry=self.registry)
                       for kind, names in CATALOG.items() for name, help_text in names.items()}

        def exposition() -> tuple[str, bytes]:
            return CONTENT_TYPE_LATEST, generate_latest(self.registry)

        bind = join_bind(host, port)
        try:
            self.endpoint = HttpEndpoint({"/metrics": exposition, "/": exposition}, bind, credentials=credentials,
                                         name="metrics")
        except OSError as exc:
            raise DilocoError(f"cannot serve Prometheus metrics on {bind}: {exc.strerror or exc}") from None
        self.port = self.endpoint.port

    def write(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        labels = [str(record.get(label, "")) for label in LABELS[kind]]
        for name, value in _numbers(record).items():
            gauge = self.gauges[(kind, name)]
            (gauge.labels(*labels) if labels else gauge).set(value)

    def close(self) -> None:
        self.endpoint.close()
