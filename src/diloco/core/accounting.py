"""What a run's tokens became and what its rounds looked like: one definition, for every driver.

Tokens, per learner, each fragment weighted by its share of the model's parameters:
- merged: pushed, and merged in the round the push was based on;
- stale: pushed, and merged in a later round (the push's base version was behind its round's);
- lost: trained but never merged (a crash before the push, a push the syncer never received);
- counted twice: merged beyond what was trained (a fragment whose merged tokens exceed the learner's
  trained ones): a bug to report, never hidden inside `lost`.
Conservation: trained = merged + stale + lost − counted twice. The simulator, `diloco run` and
`diloco chaos` all take these definitions from `learner_tokens`; the tests check them against what
the simulator knows was lost.

Rounds: how many learners each gathered (mean and histogram), how stale its pushes were (histogram, in
versions), and how long it was held open after its quorum.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterable, Mapping

from diloco.core.syncer_core import RoundRecord


def by_parameters(per_fragment: Mapping[int, int], numel: Mapping[int, int], parameters: int) -> float:
    """A per-fragment token count, averaged over the model's parameters."""
    return sum(tokens * numel[p] for p, tokens in per_fragment.items()) / parameters


def learner_tokens(trained: float, merged: Mapping[int, int], stale: Mapping[int, int],
                   numel: Mapping[int, int]) -> dict[str, float]:
    """One learner's tokens over all its lives: trained, merged on time, stale, lost, counted twice;
    `merged` and `stale` per fragment (summed over shards), `numel` the fragments' sizes."""
    parameters = sum(numel.values())
    counted = {p: merged.get(p, 0) + stale.get(p, 0) for p in numel}
    lost = sum((trained - counted[p]) * n for p, n in numel.items() if trained > counted[p]) / parameters
    over = sum((counted[p] - trained) * n for p, n in numel.items() if counted[p] > trained) / parameters
    return {"trained": trained, "merged": by_parameters(merged, numel, parameters),
            "stale": by_parameters(stale, numel, parameters), "lost": lost, "counted_twice": over}


def ledger_of(shard_reports: Iterable[Mapping[str, Any]], learner: int) -> tuple[dict[int, int], dict[int, int]]:
    """A learner's merged and stale tokens per fragment, from every shard's report (`shards.json`)."""
    merged: dict[int, int] = {}
    stale: dict[int, int] = {}
    for report in shard_reports:
        entry = report.get("ledger", {}).get(str(learner), report.get("ledger", {}).get(learner, {}))
        for kind, into in (("merged", merged), ("stale", stale)):
            for p, tokens in entry.get(kind, {}).items():
                into[int(p)] = into.get(int(p), 0) + tokens
    return merged, stale


def _plain(record: RoundRecord | Mapping[str, Any]) -> Mapping[str, Any]:
    return dataclasses.asdict(record) if isinstance(record, RoundRecord) else record


def _histogram(values: Iterable[int]) -> dict[str, int]:
    counts = Counter(values)
    return {str(k): counts[k] for k in sorted(counts)}


def round_stats(rounds: Iterable[RoundRecord | Mapping[str, Any]]) -> dict[str, Any]:
    """Participants per round, staleness of the merged pushes, time held open: over all rounds."""
    records = [_plain(r) for r in rounds]
    sizes = [len(r["participants"]) for r in records]
    held = [r["held_s"] for r in records]
    return {
        "rounds": len(records),
        "participants_mean": sum(sizes) / len(sizes) if sizes else 0.0,
        "participants_histogram": _histogram(sizes),
        "staleness_histogram": _histogram(s for r in records for s in r["staleness"]),
        "stale_fraction": (sum(1 for r in records for s in r["staleness"] if s) / sum(sizes)) if sizes else 0.0,
        "held_s_total": sum(held),
        "held_s_mean": sum(held) / len(held) if held else 0.0,
    }


def learner_round_stats(rounds: Iterable[RoundRecord | Mapping[str, Any]], learner: int) -> dict[str, Any]:
    """The rounds one learner's pushes were merged in: how many, their mean size, how stale its pushes were."""
    mine = [(r, r["staleness"][list(r["participants"]).index(learner)])
            for r in map(_plain, rounds) if learner in r["participants"]]
    return {
        "rounds": len(mine),
        "participants_mean": sum(len(r["participants"]) for r, _ in mine) / len(mine) if mine else 0.0,
        "staleness_histogram": _histogram(s for _, s in mine),
        "held_s_total": sum(r["held_s"] for r, _ in mine),
    }
