"""A run's summary, built once for both drivers from what each learner reported and what its syncer
merged: token accounting in whole tokens, one goodput, the eval curve's last point at the run's end."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco.core.accounting import learner_round_stats, learner_tokens, round_stats
from diloco.core.rounds import RoundRecord
from diloco.results import LearnerReport, RunResult

TOKEN_KINDS = ("merged", "stale", "lost")


def whole_tokens(shares: Mapping[str, float]) -> dict[str, int]:
    """A learner's merged, stale and lost tokens in whole tokens. They are fractional because each is
    averaged over the model's parameters: a push carries one fragment, so a learner's tokens are merged
    fragment by fragment, each weighted by its share of the parameters. Each is rounded by the largest
    remainder, so that the three still add up to their exact (whole) sum: trained = merged + stale + lost
    when nothing was counted twice, and no share moves by a whole token."""
    floors = {k: math.floor(shares[k]) for k in TOKEN_KINDS}
    short = round(sum(shares[k] for k in TOKEN_KINDS)) - sum(floors.values())
    for k in sorted(TOKEN_KINDS, key=lambda k: floors[k] - shares[k])[:max(0, short)]:
        floors[k] += 1
    return floors


def learner_token_split(trained: int, merged: Mapping[int, int], stale: Mapping[int, int],
                        numel: Mapping[int, int]) -> dict[str, int]:
    """One learner's tokens merged on time, merged stale and lost (`core/accounting.py`), in whole tokens."""
    return whole_tokens(learner_tokens(trained, merged, stale, numel))


def fleet_goodput(busy_s: Sequence[float], training_time_s: float) -> float:
    """The one goodput: the share of the fleet's time spent in inner steps, Σ busy / (learners × the run's
    training time). Every learner holds its chip for the whole run, so time spent waiting for a round,
    down after a crash, starting up, or idle after finishing early all count against it. It is the
    mean of the learners' `busy_fraction`s."""
    if not busy_s or not training_time_s:
        return 1.0
    return sum(busy_s) / (training_time_s * len(busy_s))


@dataclass
class LearnerOutcome:
    """One learner's part of the run, in either driver: its report (`busy_fraction`, `tokens_lost` and
    `rounds` left to `build_run_result`), where its tokens went, and the rounds it could take part in."""

    report: LearnerReport
    tokens_split: dict[str, int]
    """Merged, stale and lost (`learner_token_split`)."""
    round_records: Sequence[RoundRecord | Mapping[str, Any]] | None = None
    """Its syncer's rounds; None: there were no rounds (data-parallel)."""


def build_run_result(*, strategy: str, outcomes: Sequence[LearnerOutcome], training_time_s: float,
                     eval_curve: list[dict[str, float]],
                     round_records: Sequence[RoundRecord | Mapping[str, Any]] | None, **fields: Any) -> RunResult:
    """The run's result from its learners' outcomes. `round_records`: every round of the global syncer
    (None: there were none, data-parallel). The eval curve's last point (the final Θ) is placed at the
    run's end. `fields`: what only one driver knows (rounds, peak message, duplicates, links, clock, ...)."""
    reports = [dataclasses.replace(
        o.report, busy_fraction=fleet_goodput([o.report.busy_s], training_time_s), tokens_lost=o.tokens_split["lost"],
        rounds=learner_round_stats(o.round_records, o.report.learner) if o.round_records is not None else {})
        for o in outcomes]
    eval_curve[-1]["time_s"] = training_time_s
    losses = [r.eval_loss for r in reports if r.eval_loss is not None]
    total = {k: sum(o.tokens_split[k] for o in outcomes) for k in TOKEN_KINDS}
    return RunResult(
        strategy=strategy, learners=len(reports), tokens=sum(r.tokens for r in reports),
        final_eval_loss=eval_curve[-1]["loss"], training_time_s=training_time_s,
        wire_bytes_up=sum(r.bytes_up for r in reports), wire_bytes_down=sum(r.bytes_down for r in reports),
        goodput=fleet_goodput([r.busy_s for r in reports], training_time_s),
        tokens_merged=total["merged"], tokens_stale=total["stale"], tokens_lost=total["lost"],
        per_learner=reports, eval_curve=eval_curve,
        round_stats=round_stats(round_records) if round_records is not None else {},
        learners_eval_loss_mean=sum(losses) / len(losses) if losses else None, **fields)
