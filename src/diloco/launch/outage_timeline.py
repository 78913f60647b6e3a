"""The timeline of each syncer-shard kill in a `diloco chaos` run, from the records every process already
writes: where the seconds of an outage went, so that it is explained by numbers, not guessed at.

All on the run's one time axis (each child's metrics count from the launcher's start, `ORIGIN_ENV`), and
given as seconds after the kill:

- `restarted_s`: the launcher handed the shard's command to a spare (or started a fresh process): the
  chosen `--restart-after` delay, and the launcher noticing it is due;
- `resume_began_s`, `resumed_s` and the resume's parts (`resume` record: state loaded, checked, journal
  read, replayed, and how many events): the new process's own work;
- `serving_s`: it listens (`serving` record);
- per learner, when its first heartbeat and its first push got through again (`reconnect` records);
  `learners_back_s`: when the last learner got any call through, the outage's end as the learners
  lived it, and `outage_s`, the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESUME_PARTS = ("load_s", "check_s", "read_s", "replay_s")


def _records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines() if path.is_file() else ():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line a kill cut short
    return records


def _first(records: list[dict[str, Any]], kind: str, after: float, before: float, **match: Any
           ) -> dict[str, Any] | None:
    """The first record of `kind` in (after, before) whose fields match."""
    return next((r for r in records if r.get("kind") == kind and after < r["time_s"] < before
                 and all(r.get(k) == v for k, v in match.items())), None)


def shard_outages(metrics: Path, kills: list[dict[str, Any]], origin_unix: float) -> list[dict[str, Any]]:
    """One timeline per syncer-shard kill that was restarted. `kills`: the chaos command's, each with
    `victim`, `at_s`, and `killed_unix` and `restarted_unix` (when it was killed and restarted)."""
    learners = {path.stem: _records(path) for path in sorted(metrics.glob("learner-*.jsonl"))}
    outages = []
    shard_kills = [k for k in kills if k["victim"].startswith("syncer-") and k.get("restarted_unix")]
    for kill in shard_kills:
        shard = int(kill["victim"].split("-")[1])
        killed = kill["killed_unix"] - origin_unix
        later = [k["killed_unix"] - origin_unix for k in shard_kills if k["victim"] == kill["victim"]
                 and k["killed_unix"] > kill["killed_unix"]]
        until = min(later, default=float("inf"))
        shard_records = _records(metrics / f"{kill['victim']}.jsonl")
        resume = _first(shard_records, "resume", killed, until, shard=shard)
        serving = _first(shard_records, "serving", killed, until, shard=shard)
        timeline: dict[str, Any] = {"victim": kill["victim"], "at_s": kill["at_s"],
                                    "restarted_s": kill["restarted_unix"] - origin_unix - killed}
        if resume is not None:
            timeline.update(resume_began_s=resume["time_s"] - resume["resume_s"] - killed,
                            resumed_s=resume["time_s"] - killed, events_replayed=resume["events"],
                            resume_parts_s={part: resume[part] for part in RESUME_PARTS})
        if serving is not None:
            timeline["serving_s"] = serving["time_s"] - killed
        back: dict[str, dict[str, float]] = {}
        for name, records in learners.items():
            for call, push in (("heartbeat", False), ("push", True)):
                record = _first(records, "reconnect", killed, until, shard=shard, push=push)
                if record is not None:
                    back.setdefault(name, {})[call] = record["time_s"] - killed
        timeline["learners"] = back
        if back:
            timeline["outage_s"] = timeline["learners_back_s"] = max(min(calls.values()) for calls in back.values())
        outages.append(timeline)
    return outages


def describe(outage: dict[str, Any]) -> str:
    """One line a user reads: where the outage's seconds went."""
    def at(key: str) -> str:
        return f"{outage[key]:.2f}" if key in outage else "?"

    parts = outage.get("resume_parts_s", {})
    resume = (f"resume {at('resume_began_s')}–{at('resumed_s')} (load {parts['load_s']:.2f}, check "
              f"{parts['check_s']:.2f}, journal {parts['read_s']:.2f}, replay {parts['replay_s']:.2f} of "
              f"{outage['events_replayed']} events)" if parts else "nothing to resume (Θ not seeded yet)")
    pushes = [calls["push"] for calls in outage.get("learners", {}).values() if "push" in calls]
    pushed = f", pushes through by {max(pushes):.2f}" if pushes else ""
    back = f"every learner back +{at('learners_back_s')} s" if outage.get("learners") else "no learner had joined"
    return (f"{outage['victim']} killed at {outage['at_s']:.1f} s: restarted +{at('restarted_s')}, {resume}, "
            f"serving +{at('serving_s')}, {back}{pushed}")
