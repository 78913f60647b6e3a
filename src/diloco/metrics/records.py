"""Records built the same way by both drivers, from the cores' own counters."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from diloco.core.learner_core import LearnerCore
from diloco.core.syncer_core import RoundRecord
from diloco.metrics.log import MetricsLog


class LearnerMeter:
    """A learner's record every `every_steps` inner steps; tokens per second since the previous one.

    With `at_pushes`, also at every step that made a push (its core's sequence number moved), written on
    the training thread as soon as the step has queued it, before the link thread can have encoded and
    sent it (and the first step it meters, whose push it cannot tell): a learner killed between periodic
    records then does not show more tokens merged than its records say it trained (`diloco chaos` counts a life's training from its last record, and such a push
    read as counted twice)."""

    def __init__(self, log: MetricsLog, learner: int, every_steps: int, at_pushes: bool = False) -> None:
        self.log, self.learner, self.every_steps, self.at_pushes = log, learner, every_steps, at_pushes
        self._last: tuple[float, int] | None = None
        self._last_seq: int | None = None

    def step(self, time_s: float, *, steps: int, tokens: int, busy_fraction: float, step_time_s: float,
             bytes_up: int, bytes_down: int, loss: Callable[[], float | None], core: LearnerCore | None,
             final: bool = False) -> None:
        """Record if this step is on the period, sent a push (`at_pushes`), or is the learner's last (`final`)."""
        pushed = self.at_pushes and core is not None and core.seq != self._last_seq
        if core is not None:
            self._last_seq = core.seq
        if steps % self.every_steps and not final and not pushed:
            return
        last_time, last_tokens = self._last or (0.0, 0)
        rate = (tokens - last_tokens) / (time_s - last_time) if time_s > last_time else None
        self._last = (time_s, tokens)
        self.log.record("learner", time_s, learner=self.learner, tokens=tokens, steps=steps, tokens_per_s=rate,
                        step_time_s=step_time_s, busy_fraction=busy_fraction, bytes_up=bytes_up,
                        bytes_down=bytes_down, loss=loss(),
                        outer_grad_norm=core.last_push_norm if core else None,
                        staleness=core.last_staleness if core else None,
                        last_merged_version=max(core.anchor_versions) if core else None)


class RoundMeter:
    """A record for each round the syncer core closed since the last call."""

    def __init__(self, log: MetricsLog, shard: int = 0, origin: float = 0.0) -> None:
        """`origin`: the core's clock value at the run's start (0 in the simulator, Unix time for real)."""
        self.log, self.shard, self.origin = log, shard, origin
        self.seen = 0

    def emit(self, rounds: list[RoundRecord]) -> None:
        for r in rounds[self.seen:]:
            self.log.record("round", r.closed_at - self.origin, shard=self.shard, fragment=r.fragment,
                            version=r.version, participants=list(r.participants), stale=r.stale,
                            staleness=list(r.staleness), time_to_quorum_s=r.time_to_quorum_s, held_s=r.held_s,
                            update_norm=r.update_norm, cosine=r.cosine, tokens=r.tokens, final=r.final)
        self.seen = len(rounds)


def resident_memory_bytes() -> int:
    """This process's resident memory (Linux); 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def records_of(path: Path, kind: str) -> list[dict[str, Any]]:
    """The records of one kind in a JSONL metrics file, in order (a line a kill cut short is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line a kill cut short
        if record.get("kind") == kind:
            records.append(record)
    return records


def learner_lives(metrics: Path) -> dict[int, list[dict[str, Any]]]:
    """Per learner, the last `learner` record of each life. A life begins at its `start` record (written
    with its first step) or, in files without them, where the counters fall (a restart counts its tokens
    from zero; a resumed one keeps counting steps, so a life of one step shows no fall)."""
    lives: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(metrics.glob("learner-*.jsonl")):
        ends: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a kill cut short
            kind = record.get("kind")
            if kind == "start" and current is not None:
                ends.append(current)
                current = None
            elif kind == "learner":
                if current is not None and (record["tokens"] < current["tokens"] or record["steps"] < current["steps"]):
                    ends.append(current)
                current = record
                lives.setdefault(record["learner"], ends)
        if current is not None:
            ends.append(current)
    return lives
