"""A run's schedule, decided once for both drivers: each learner's planned steps and last step, and the
token marks at which Θ is evaluated."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.config import Config
from diloco.strategies import StrategySpec, build_strategy

STEP_CAP = 4
"""With a shared budget a learner stops when the syncer says the budget is spent; one that never hears
it (cut off from every shard, or every stop lost) stops at this many times its plan. Kept in both
drivers: in the simulator a stop always arrives before it binds, but it is the same rule."""


@dataclass(frozen=True)
class LearnerPlan:
    speed: float
    """Its speed relative to the configured step time (1: a full-speed chip)."""
    planned_steps: int
    """Inner steps it plans for: its learning-rate schedule spans them."""
    last_step: int
    """It stops by itself after this many steps (or earlier, when the syncer says the budget is spent)."""


def learner_plans(config: Config, syncing: bool = True, spec: StrategySpec | None = None) -> list[LearnerPlan]:
    """Every configured learner's plan. With a shared budget each learner's share of the tokens follows
    its speed (`StrategySpec.planned_steps`) and the syncer's stop ends its run, `STEP_CAP` bounding it;
    otherwise all take equal shares and stop at the end of theirs. `syncing` False: a learner training
    alone (no syncer to say stop) stops at its plan."""
    spec = spec or build_strategy(config)
    t = config.train
    speeds = config.speeds()
    plans = spec.planned_steps(speeds, config.token_budget(), t.batch_size * t.seq_len)
    waits_for_stop = spec.shared_budget and syncing
    return [LearnerPlan(speed=speed, planned_steps=max(1, planned),
                        last_step=planned * STEP_CAP if waits_for_stop else planned)
            for speed, planned in zip(speeds, plans)]


def learner_plan(config: Config, learner: int, syncing: bool = True) -> LearnerPlan:
    """One learner's plan; a learner beyond the configured count (one that joined an elastic run) plans
    like the last configured one, at full speed."""
    plans = learner_plans(config, syncing)
    if learner < len(plans):
        return plans[learner]
    last = plans[-1]
    return LearnerPlan(speed=1.0, planned_steps=last.planned_steps, last_step=last.last_step)


def planned_tokens(config: Config) -> list[int]:
    """Per configured learner, the tokens it plans to train: what progress is shown against."""
    t = config.train
    return [p.planned_steps * t.batch_size * t.seq_len for p in learner_plans(config)]


class EvalMarks:
    """Θ is evaluated each time the tokens trained by the whole fleet pass one of `train.eval_points - 1`
    evenly spaced marks, and once at the end. The count is the driver's best knowledge of tokens
    trained: the simulator's exact count at each step's end; the launcher's, the learners' progress
    reports as their syncers have them (one per step, so at most a step behind per learner)."""

    def __init__(self, config: Config) -> None:
        budget, points = config.token_budget(), config.train.eval_points
        self.marks = [budget * k // points for k in range(1, points)]

    def passed(self, tokens_trained: int) -> int:
        """How many marks `tokens_trained` has passed since last asked: one evaluation is due for each."""
        count = 0
        while self.marks and tokens_trained >= self.marks[0]:
            self.marks.pop(0)
            count += 1
        return count
