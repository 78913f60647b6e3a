"""Records of one process, fanned out to the sinks the run asked for."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.errors import DilocoError
from diloco.metrics.catalog import CATALOG
from diloco.metrics.sinks import JsonlSink, PrometheusSink, Sink, TensorBoardSink, WandbSink
from diloco.status.endpoint import LOOPBACK, HttpExposure


class MetricsLog:
    def __init__(self, sinks: list[Sink], origin: float | None = None) -> None:
        """`origin`: the clock value that is time 0 (a run's start); records carry time since it."""
        self.sinks = sinks
        self.origin = clock.now() if origin is None else origin

    def record(self, kind: str, time_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """One record; `time_s` defaults to now since the origin. Unknown metric names are a bug."""
        names = CATALOG.get(kind)
        if names is None:
            raise ValueError(f"unknown metric kind {kind!r}")
        record = {"kind": kind, "time_s": clock.now() - self.origin if time_s is None else time_s}
        for key, value in fields.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            record[key] = value
        for sink in self.sinks:
            sink.write(record)
        return record

    @property
    def prometheus_port(self) -> int | None:
        """The port the Prometheus endpoint got (port 0 asks for any free one); None without one."""
        return next((sink.port for sink in self.sinks if isinstance(sink, PrometheusSink)), None)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_metrics(out: Path | None, *, name: str = "metrics", tensorboard: bool = False, wandb: str = "",
                 prometheus_port: int | None = None, http: HttpExposure = LOOPBACK,
                 origin: float | None = None) -> MetricsLog:
    """The sinks a run asked for: OUT/NAME.jsonl always (when there is an OUT), TensorBoard under
    OUT/tensorboard/NAME, W&B into project `wandb`, a Prometheus endpoint on `prometheus_port` (on
    `http.host`, for those holding `http.credentials`)."""
    sinks: list[Sink] = []
    if out is not None:
        sinks.append(JsonlSink(out / f"{name}.jsonl"))
        if tensorboard:
            sinks.append(TensorBoardSink(out / "tensorboard" / name))
    elif tensorboard:
        raise DilocoError("metrics.tensorboard needs an output folder (--out)")
    if wandb:
        sinks.append(WandbSink(wandb, name, out))
    if prometheus_port is not None:
        sinks.append(PrometheusSink(prometheus_port, http.host, http.credentials))
    return MetricsLog(sinks, origin)
