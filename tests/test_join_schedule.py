"""A learner that (re)joins a paced run is told when to push each fragment first (`Merging.join_schedule`):
the grid's next point, so that its first push lands in the round the others make rather than alone and
stale, as a push scheduled by its own steps did. Decided in the syncer core; carried by the simulator,
the wire (`FragmentVersion.push_in_s`, a bounded claim) and the learner core alike."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import tiny_config
from diloco.core.actions import SendState
from diloco.core.events import LearnerRejoined
from diloco.core.learner_core import LearnerCore
from diloco.core.merging import next_grid_point
from diloco.fragments import Schedule
from diloco.sim.driver import Simulation
from diloco.transport.wire_messages import MAX_PUSH_IN_S, fragment_versions, push_in_of
from diloco.v1 import diloco_pb2 as pb
from test_pacing import FRAGMENT, H, STEP, paced, publishes, push, report


def _rejoin(syncer, learner: int, after_seq: int, now: float) -> SendState:
    (state,) = [a for a in syncer.handle(LearnerRejoined(learner, after_seq=after_seq), now)
                if isinstance(a, SendState)]
    return state


def _one_round(syncer) -> float:
    """Learners 0 and 1 push fragment 0 together at 0.1 s: version 1, and the grid's next point."""
    for m in (0, 1):
        syncer.on_progress(report(m, 0.1), now=0.0)
    syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], now=0.1), now=0.1)
    assert publish.recipients == (0, 1)
    return syncer.fragments[0].target


def test_a_rejoining_learner_is_named_the_grids_next_point_and_its_push_there_joins_the_round():
    syncer = paced(members=(0, 1))
    target = _one_round(syncer)
    assert target == pytest.approx(0.1 + H * STEP)  # one period (H fastest steps) after the round
    state = _rejoin(syncer, 1, after_seq=1, now=0.5)  # learner 1 restarted
    assert state.versions == {0: 1} and state.push_in_s == {0: pytest.approx(target - 0.5)}

    # Its core pushes at the end of its step nearest that time, on its own clock (here the same one).
    core = LearnerCore(1, {"w": torch.zeros(2)}, FRAGMENT, Schedule(H, 1), tau=1, alpha=0.0,
                       wait_for_updates=False, versions=[1], first_seq=1)
    core.push_at({p: 0.5 + d for p, d in state.push_in_s.items()})
    core.resume_at(3)  # its checkpoint's step: by its steps it would push at step 10, 0.7 s later
    pushed_at = []
    for step in range(1, 8):
        now = 0.5 + step * STEP
        pushed_at += [now for _ in core.on_step(10, step_time_s=STEP, now=now)]
    assert pushed_at == [pytest.approx(target)]

    # Learner 0 comes to the same point from its answer, and learner 1's reports say it does too: the round
    # waits for it, and gathers both, neither stale.
    for m in (0, 1):
        syncer.on_progress(report(m, 0.1), now=target - 0.1)
    second = dataclasses.replace(push(0, 2, [1.0, 0.0], base=1, now=target), step=20)
    assert not publishes(syncer.on_push(second, now=target))
    back = dataclasses.replace(push(1, 2, [0.0, 1.0], base=1, now=target + 0.01), step=10)
    (publish,) = syncer.on_push(back, now=target + 0.01)
    assert publish.recipients == (0, 1) and syncer.rounds[-1].staleness == (0, 0)


def test_a_grid_spaced_out_while_the_fast_learners_were_down_is_not_waited_for():
    """The grid's period is H steps of the fastest learner alive: with the fast ones down, rounds set their
    next points a slow learner's period apart. A fast learner back is judged by its own old pace: a point
    further than that period (and the lead) is left to its steps, which push sooner."""
    syncer = paced(members=(0, 1))
    target = _one_round(syncer)  # learners 0 and 1 at STEP a step: period H·STEP = 1.0 s
    syncer.fragments[0].target = target + 3.0  # as a round closed on the slow learners' grid would set it
    assert _rejoin(syncer, 1, after_seq=1, now=0.5).push_in_s == {}
    syncer.fragments[0].target = target + 0.1  # within a period and the lead: that point is named
    assert _rejoin(syncer, 1, after_seq=1, now=0.5).push_in_s == {0: pytest.approx(target + 0.1 - 0.5)}


def test_before_any_round_there_is_no_grid_and_the_learner_pushes_by_its_steps():
    syncer = paced(members=(0, 1))
    assert _rejoin(syncer, 1, after_seq=0, now=0.5).push_in_s == {}
    core = LearnerCore(1, {"w": torch.zeros(2)}, FRAGMENT, Schedule(H, 1), tau=1, alpha=0.0, wait_for_updates=False)
    core.push_at({})
    steps = [step for step in range(1, H + 1) if core.on_step(10, step_time_s=STEP, now=step * STEP)]
    assert steps == [H]


def test_the_first_push_is_at_least_half_a_period_ahead_and_a_far_past_grid_is_caught_up_without_stepping():
    assert next_grid_point(1.0, now=0.6, period=1.0) == 2.0  # 1.0 is under half a period ahead of 0.6
    assert next_grid_point(1.2, now=0.6, period=1.0) == 1.2
    far = next_grid_point(0.0, now=1e9, period=1e-3)  # a long pause, or a tiny claimed step time
    assert 1e9 + 0.5e-3 < far <= 1e9 + 1.5e-3 + 1e-6


@pytest.mark.parametrize("claim", [math.nan, math.inf, -0.5, MAX_PUSH_IN_S * 2])
def test_a_first_push_delay_a_shard_names_is_a_claim_and_one_out_of_bounds_is_ignored(claim):
    header = pb.StateHeader(versions=fragment_versions({0: 3, 1: 4, 2: 5}, {0: 1.5, 1: claim}))
    assert push_in_of(list(header.versions)) == {0: 1.5}  # 1: refused, so by steps; 2: none named
    parsed = pb.StateHeader.FromString(header.SerializeToString())
    assert push_in_of(list(parsed.versions)) == {0: 1.5} and not parsed.versions[2].HasField("push_in_s")


RESTART = ("strategy=decoupled", "learners.speeds=[1, 1, 0.5, 0.25]", "outer.H=6", "outer.fragments=3",
           "outer.tau=2", "train.tokens=20480", "failures.crashes=[{learner = 1, at_s = 4.0}]",
           "failures.recovery_s=3", "failures.detect_s=1", "failures.checkpoint_every=4")


@pytest.mark.integration  # a whole training run in the simulator
def test_in_the_simulator_a_restarted_learners_first_pushes_land_on_the_grid_in_rounds_with_the_others():
    """By its steps, the restarted learner's first pushes landed anywhere in the period (in this run, a lone
    stale round of another learner followed); on the grid each lands in the round the others make there."""
    sim = Simulation(tiny_config(*RESTART))
    named: list[tuple[float, SendState]] = []
    handle = sim._handle

    def spy(actions, *args):
        named.extend((sim.now, a) for a in actions if isinstance(a, SendState) and a.learner == 1)
        return handle(actions, *args)

    sim._handle = spy
    sim.run()
    ((sent_at, state),) = named
    assert state.push_in_s  # rounds had set the grid by the crash
    for p, delay in state.push_in_s.items():
        first = next(r for r in sim.syncer.rounds if r.fragment == p and r.closed_at > sent_at and 1 in r.participants)
        # The round at the named point: open from the first push (the others', to about half a step of
        # theirs from it) until it gathered everyone.
        assert first.opened_at - STEP_S <= sent_at + delay <= first.closed_at + STEP_S, f"fragment {p}: off the grid"
        assert len(first.participants) > 1, f"fragment {p}: its first push after the restart merged alone"
        # At most the round that closed while its Θ was on its way (answers go to participants) is missed.
        assert first.staleness[first.participants.index(1)] <= 1


STEP_S = 0.1
"""Within about one inner step of the tiny model's fastest learner of the named time."""
