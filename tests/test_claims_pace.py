"""A learner's step claims are judged against its pace, and an honest learner whose pace changes is never
locked out: a claim above its measured rate is believed in part, heard all the same, and counted in
full within seconds; a claim no learner could have reached is refused with nothing changed."""

import torch

from diloco.config import Config
from diloco.core.actions import LearnerDead
from diloco.core.claims import FASTEST_STEP_S, RATE_SLACK_STEPS
from diloco.core.events import HeartbeatArrived, TimerFired
from diloco.fragments import Fragment
from diloco.strategies import build_strategy
from core_state import frozen, refused, same

TPS = 16 * 64
"""The default run's batch × sequence: what an honest learner declares."""
BEAT_S = 0.5


def run_core():
    """The syncer core as both drivers build it from the default config (shared budget on)."""
    spec = build_strategy(Config())
    core = spec.syncer_core({"w": torch.tensor([1.0, -1.0, 0.5, 2.0])}, [Fragment(0, ("w",), 4, False)], (0,),
                            embeddings=())
    core.budget = 10**15  # the budget is not what these tests are about
    core.declare(0, TPS)
    return core


def beat(core, now: float, step: int) -> list:
    """A heartbeat of learner 0 at `step` (its tokens honest), and a liveness check; what the core did."""
    actions = core.handle(HeartbeatArrived(0, step=step, tokens=step * TPS), now=now)
    return actions + core.handle(TimerFired(), now=now)


def drive(core, paces: list[tuple[float, float]], start: float = 0.0) -> list[tuple[float, int, int]]:
    """Heartbeats every BEAT_S for each (seconds, steps per second) in turn; per beat, (time, step claimed,
    step believed). No heartbeat may be refused and the learner must never be found dead."""
    seen, now, step = [], start, 0.0
    for seconds, pace in paces:
        for _ in range(round(seconds / BEAT_S)):
            now += BEAT_S
            step += pace * BEAT_S
            actions = beat(core, now, int(step))
            assert not any(isinstance(a, LearnerDead) for a in actions), f"found dead at {now:.1f} s"
            seen.append((now, int(step), core.claims.of(0, now).step))
    return seen


def test_a_learner_that_takes_a_minute_to_its_first_step_is_not_held_to_that_minute():
    """A 12B model loads and compiles for minutes after joining; its pace is measured from its first step."""
    core = run_core()
    seen = drive(core, [(60.0, 0.0), (30.0, 100.0)])
    assert all(claimed == believed for _, claimed, believed in seen)
    assert core.claims.of(0, 90.0).clipped == 0
    assert core.tokens_reported(0) == seen[-1][1] * TPS


def test_a_learner_that_speeds_up_twentyfold_is_heard_throughout_and_caught_up_within_seconds():
    core = run_core()
    seen = drive(core, [(20.0, 10.0), (30.0, 200.0)])
    behind = [now for now, claimed, believed in seen if believed < claimed]
    print(f"\nclaims believed in part: {len(behind)}, from {behind[0]:.1f} s to {behind[-1]:.1f} s")
    assert behind, "a 20x speed-up stayed within the rate bound: the test does not test the catch-up"
    assert behind[-1] - behind[0] <= 5.0, behind
    assert seen[-1][1] == seen[-1][2] and core.tokens_reported(0) == seen[-1][1] * TPS
    assert core.claims.of(0, seen[-1][0]).clipped == len(behind)


def test_a_liar_gains_no_more_than_its_rate_allows_per_claim():
    core = run_core()
    seen = drive(core, [(20.0, 10.0)])
    now, step = seen[-1][0], seen[-1][2]
    lie = step + 100_000  # possible at all (not refused), far above this learner's pace
    assert lie < (now + BEAT_S) / FASTEST_STEP_S
    beat(core, now + BEAT_S, lie)
    believed = core.claims.of(0, now + BEAT_S).step
    rate = 4 * 10.0
    assert believed <= step + RATE_SLACK_STEPS + BEAT_S * rate + 1, believed
    assert core.tokens_reported(0) == believed * TPS


def test_a_step_no_learner_could_have_reached_is_refused_with_nothing_changed():
    core = run_core()
    drive(core, [(5.0, 10.0)])
    before = frozen(core)
    reason = refused(lambda: core.handle(HeartbeatArrived(0, step=10**12, tokens=TPS), now=5.5))
    assert "any learner could have taken since it joined" in reason
    assert same(frozen(core), before)
