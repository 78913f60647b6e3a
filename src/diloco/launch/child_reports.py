"""What `diloco run`'s children left behind, read back for the summary: their metrics merged into one
file, each learner's report (or, for one that vanished, what its metrics last said), its outcome."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diloco.core.accounting import ledger_of
from diloco.errors import DilocoError
from diloco.launch.processes import Started
from diloco.driver_kit.run_summary import LearnerOutcome, learner_token_split
from diloco.outputs import write_output
from diloco.results import LearnerReport
from diloco.transport.calls import ShardClient


def merge_metrics(folder: Path, into: Path) -> None:
    """Every process's records in one file, ordered by time; a line cut short by a kill is dropped."""
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    records.sort(key=lambda r: r.get("time_s", 0.0))
    write_output(into, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def report_from_metrics(learner: int, last: dict[str, Any], speed: float) -> dict[str, Any]:
    """What a learner that vanished without its report last recorded, in the report's shape: its time
    from the run's start (it had no other clock), the busy part of it, its bytes."""
    wall = last.get("time_s", 0.0)
    return {"learner": learner, "speed": speed, "tokens": last["tokens"], "steps": last["steps"],
            "busy_s": last.get("busy_fraction", 0.0) * wall, "waiting_s": 0.0, "wall_s": wall,
            "busy_fraction": last.get("busy_fraction", 0.0), "bytes_up": last.get("bytes_up", 0),
            "bytes_down": last.get("bytes_down", 0), "peak_message_bytes_up": 0, "eval_loss": None,
            "reported": False}


def learner_outcomes(learners: list[dict[str, Any]], lives: dict[int, list[dict[str, Any]]],
                     syncers: list[dict[str, Any]], numel: dict[int, int]) -> list[LearnerOutcome]:
    """Each learner's outcome from its report, its lives (`learner_lives`) and its syncers' reports (its
    region's with the regional tier), whose ledgers and rounds are its own."""
    rounds = [r for shard in syncers for r in shard.get("rounds", [])]
    outcomes = []
    for r in learners:
        m = r["learner"]
        # A learner that was killed and restarted trained in each of its lives: count them all.
        trained = sum(life["tokens"] for life in lives[m]) if m in lives else r["tokens"]
        report = LearnerReport(
            learner=m, speed=r["speed"], tokens=trained, steps=r["steps"], busy_s=r["busy_s"],
            waiting_s=r["waiting_s"], down_s=0.0, crashes=len(lives[m]) - 1 if m in lives else 0,
            bytes_up=r["bytes_up"], bytes_down=r["bytes_down"], eval_loss=r.get("eval_loss"))
        outcomes.append(LearnerOutcome(report, learner_token_split(trained, *ledger_of(syncers, m), numel), rounds))
    return outcomes


def unfinished_syncers(syncers: list[tuple[Started, ShardClient]], waited_s: float) -> str:
    """Why the run could not end: each syncer (shard or region) still not finished, where it stands (whom
    it holds, whether it was told to stop, a region whether it left the global syncer) and its last log
    lines, so a hang at the end is diagnosed from the error alone."""
    parts = []
    for child, client in syncers:
        try:
            report = json.loads(client.status().report_json)
        except DilocoError as exc:
            parts.append(f"{child.name} does not answer ({exc})")
            continue
        if report.get("finished"):
            continue
        stands = (f"joined {report.get('joined')}, left {report.get('left')}, "
                  f"told to stop: {'yes' if report.get('told_to_stop') else 'no'}")
        if "left_upstream" in report:
            stands += f", left the global syncer: {'yes' if report['left_upstream'] else 'no'}"
        parts.append(f"{child.name} ({stands}); its log ({child.log_path}) ends:\n{child.log_tail(10)}")
    return (f"the syncer did not finish its last rounds within {waited_s:g} s after every learner left: "
            + ("\n".join(parts) or "each finished as this was written"))
