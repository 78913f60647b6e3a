"""Reading a run folder (summary.json, metrics.jsonl) once, for every plot and table.

Tolerant by design: a run killed mid-write leaves a truncated last line, a newer diloco may write
kinds and fields this one does not know, and a real run's threads may append slightly out of order.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from diloco.errors import DilocoError

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"

Record = dict[str, Any]


class EvalPoint(NamedTuple):
    """One held-out evaluation of the global model Θ."""

    time_s: float
    tokens: float
    loss: float


@dataclass(frozen=True)
class Run:
    """What one run folder holds: its summary (None for a run that did not finish) and its records."""

    folder: Path
    summary: dict[str, Any] | None
    records: list[Record]

    @property
    def name(self) -> str:
        """The folder's own name, which is how people tell runs apart (resolved, so `.` has one)."""
        return self.folder.resolve().name

    def of_kind(self, kind: str) -> list[Record]:
        """Records of one kind, in time order."""
        return [r for r in self.records if r["kind"] == kind]

    def eval_points(self) -> list[EvalPoint]:
        """Θ's loss over time: the eval records, else the summary's eval_curve (runs without metrics)."""
        points = _eval_points(self.of_kind("eval"))
        if not points and self.summary is not None:
            points = _eval_points(self.summary.get("eval_curve") or [])
        return points

    def is_virtual_time(self) -> bool:
        """True when times are the simulator's virtual clock (the summary's `clock` says)."""
        return self.summary is None or clock_of(self.summary) == "virtual"

    def by_learner(self) -> dict[int, list[Record]]:
        """Learner records grouped per learner (one learner = one link), each in time order."""
        groups: dict[int, list[Record]] = {}
        for record in self.of_kind("learner"):
            learner = record.get("learner")
            if isinstance(learner, int) and not isinstance(learner, bool):
                groups.setdefault(learner, []).append(record)
        return dict(sorted(groups.items()))


def load_run(folder: Path, need_summary: bool = True) -> Run:
    """Read ``folder``; a DilocoError naming it when it is not a run folder (or lacks a needed summary)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DilocoError(f"{folder}: no such run folder")
    summary_path, metrics_path = folder / SUMMARY, folder / METRICS
    summary = _read_summary(summary_path) if summary_path.is_file() else None
    if summary is None and need_summary:
        raise DilocoError(f"{folder} has no {SUMMARY}: not a finished diloco run folder")
    records = read_metrics(metrics_path) if metrics_path.is_file() else []
    if summary is None and not records:
        raise DilocoError(f"{folder} has neither {SUMMARY} nor {METRICS}: not a diloco run folder")
    return Run(folder, summary, records)


def read_metrics(path: Path) -> list[Record]:
    """Every well-formed record of a metrics.jsonl, sorted by time; lines that do not parse are skipped."""
    records: list[Record] = []
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a truncated last line, or a line two writers interleaved
                continue
            if _is_record(record):
                records.append(record)
    records.sort(key=lambda r: r["time_s"])  # stable: same-time records keep their written order
    return records


def number(record: dict[str, Any], key: str) -> float | None:
    """``record[key]`` when it is a finite number, else None (missing, null, NaN, a string...)."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class AllLearnersTokens:
    """Tokens trained over all learners at any moment, from the learner records. Θ's eval tokens count the
    same way, so a learner's training loss and Θ's eval loss can share one tokens axis."""

    def __init__(self, learner_records: list[Record]) -> None:
        latest: dict[int, float] = {}
        self.times: list[float] = []
        self.totals: list[float] = []
        for record in learner_records:
            learner, tokens = record.get("learner"), number(record, "tokens")
            if isinstance(learner, int) and tokens is not None:
                latest[learner] = tokens
                self.times.append(record["time_s"])
                self.totals.append(sum(latest.values()))

    def at(self, time_s: float) -> float:
        """The total after every record up to and including ``time_s``."""
        index = bisect.bisect_right(self.times, time_s)
        return self.totals[index - 1] if index else 0.0


def _is_record(value: Any) -> bool:
    """A JSON object with a kind and a time: anything else on a line is not a record of any version."""
    return isinstance(value, dict) and isinstance(value.get("kind"), str) and number(value, "time_s") is not None


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DilocoError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(summary, dict):
        raise DilocoError(f"{path}: expected a JSON object")
    return summary


def _eval_points(entries: list[Any]) -> list[EvalPoint]:
    points = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        time_s, tokens, loss = number(entry, "time_s"), number(entry, "tokens"), number(entry, "loss")
        if time_s is not None and tokens is not None and loss is not None:
            points.append(EvalPoint(time_s, tokens, loss))
    return sorted(points)


def clock_of(summary: dict[str, Any]) -> str:
    """`real` or `virtual`; summaries written before `clock` existed: real ones had `wall_clock_s`."""
    return summary.get("clock") or ("real" if "wall_clock_s" in summary else "virtual")
