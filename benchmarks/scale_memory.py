"""scale.py's memory: the shards' RSS sampled from /proc, and the model that predicts a combination's peak
before it runs."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any


from scale_model import BASE_RSS_BYTES, DEFAULT_BYTES_PER_PARAM, GIB



def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """Every 0.2 s: each shard's VmRSS and VmHWM, the learners' RSS, and MemAvailable; below `min_free`,
    it kills every child of the run (the watchdog)."""

    def __init__(self, shards: list[subprocess.Popen], min_free: int, on_low: callable) -> None:
        self.shards, self.min_free, self.on_low = shards, min_free, on_low
        self.learners: list[subprocess.Popen] = []
        self.loaded = False
        """Set once the learners start: from then on, VmRSS counts towards `rss_load`."""
        self.rss_load = [0] * len(shards)
        self.rss_max = [0] * len(shards)
        self.hwm = [0] * len(shards)
        self.learners_rss = 0
        self.min_available = mem_available()
        self.low: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        for i, proc in enumerate(self.shards):
            s = proc_status(proc.pid)
            if not s:
                continue
            self.rss_max[i] = max(self.rss_max[i], s.get("VmRSS", 0))
            self.hwm[i] = max(self.hwm[i], s.get("VmHWM", 0))
            if self.loaded:
                self.rss_load[i] = max(self.rss_load[i], s.get("VmRSS", 0))
        if self.learners:
            self.learners_rss = max(self.learners_rss,
                                    sum(proc_status(p.pid).get("VmRSS", 0) for p in self.learners))
        available = mem_available()
        self.min_available = min(self.min_available, available)
        if available < self.min_free and self.low is None:
            self.low = (f"MemAvailable fell to {available / GIB:.2f} GiB (under --min-free-gib "
                        f"{self.min_free / GIB:g}); shard RSS {max(self.rss_max) / GIB:.2f} GiB: stopped")
            self.on_low()

    @contextlib.contextmanager
    def probing(self):
        """This script's own Status calls: what they cost the shard (building the report, and its
        `memory`) is no part of the load, so VmRSS meanwhile does not count towards `rss_load`."""
        loaded, self.loaded = self.loaded, False
        try:
            yield
        finally:
            self.sample()
            self.loaded = loaded

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


@dataclass
class MemoryModel:
    """A shard's peak RSS ≈ BASE + P_shard x (a + b x learners), fitted on this invocation's runs."""

    runs: list[dict[str, Any]] = field(default_factory=list)

    def coefficients(self, key: tuple) -> tuple[float, float, str]:
        points = [(r["learners"], (r["hwm_bytes"] - BASE_RSS_BYTES) / r["params_per_shard"]) for r in self.runs
                  if r["key"] == key and r["params_per_shard"] >= 5_000_000]
        a0, b0 = DEFAULT_BYTES_PER_PARAM
        if not points:
            return a0, b0, "default"
        xs = sorted({x for x, _ in points})
        if len(xs) == 1:
            x, y = xs[0], max(y for lx, y in points if lx == xs[0])
            return max(0.0, y - b0 * x), b0, f"fitted on {len(points)} run(s), learner slope default"
        mx = statistics.fmean(x for x, _ in points)
        my = statistics.fmean(y for _, y in points)
        b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
        b = max(0.0, b)
        a = max(max(y - b * x for x, y in points), 0.0)  # the upper envelope: a prediction to plan by
        return a, b, f"fitted on {len(points)} runs"

    def predict(self, key: tuple, params_per_shard: int, learners: int) -> tuple[int, str]:
        a, b, how = self.coefficients(key)
        return int(BASE_RSS_BYTES + params_per_shard * (a + b * learners)), how
