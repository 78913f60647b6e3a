"""Pacing, the end of a run and the shared budget: decisions of the syncer core, driven by hand."""

import math

import pytest
import torch

from conftest import tiny_config
from diloco.core import Push, SyncerCore, Timer
from diloco.core.learner_core import LearnerCore
from diloco.core.events import SyncerResumed
from diloco.core.messages import Progress, Update
from diloco.core.actions import Publish, Stop
from diloco.core.refusals import ProtocolError
from diloco.fragments import Fragment, Schedule
from diloco.outer import DelayedNesterov
from diloco.sim.driver import Simulation

FRAGMENT = [Fragment(0, ("w",), 2, False)]
STEP = 0.1
H = 10


def paced(members=(0, 1, 2), **kwargs):
    kwargs.setdefault("merge_rule", "weighted")
    kwargs.setdefault("grace_cap_steps", 100.0)
    return SyncerCore({"w": torch.zeros(2)}, FRAGMENT, members, optimizer=lambda: DelayedNesterov(1.0, 0.0),
                      quorum=1, grace=1.0, tau=1, pacing=True, period=H,
                      participation=True, **kwargs)


def push(learner, seq, delta, *, now, base=0, tokens=100, steps=10, trip=0.05, final=False, step=0):
    return Push(learner, 0, base, seq, {"w": torch.tensor(delta)}, tokens, steps, step_time_s=STEP,
                sent_at=now - trip, final=final, step=step)


def report(learner, due_in, *, step=10, tokens=1000):
    return Progress(learner, step, tokens, STEP, (due_in,))


def publishes(actions):
    return [a for a in actions if isinstance(a, Publish)]


# ---------------------------------------------------------------- rounds wait for who is about to push


def test_a_round_waits_for_the_learners_whose_reports_say_they_are_about_to_push():
    syncer = paced()
    for m, due in ((0, 0.1), (1, 0.2), (2, 0.3)):
        syncer.on_progress(report(m, due), now=10.0)
    actions = syncer.on_push(push(0, 1, [1.0, 0.0], now=10.1), now=10.1)
    (timer,) = actions
    # The fragment's first round waits at most a sync period (H steps of the fastest learner) after it opened.
    assert isinstance(timer, Timer) and timer.at == pytest.approx(10.1 + H * STEP)
    assert syncer.on_push(push(1, 1, [0.0, 1.0], now=10.2), now=10.2) == []
    (publish,) = syncer.on_push(push(2, 1, [1.0, 1.0], now=10.3), now=10.3)
    assert publish.recipients == (0, 1, 2)
    assert syncer.rounds[-1].held_s == pytest.approx(0.2)


def test_a_first_round_waits_a_whole_period_for_a_learner_that_began_late_and_later_rounds_half_of_one():
    # At a run's start learner 1 began training 0.8 s after learner 0: its first push of the fragment, by its
    # steps, lands 0.8 s after learner 0's. Half a period (0.5 s) would have merged learner 0 alone and
    # left learner 1's push stale in a round of its own.
    syncer = paced(members=(0, 1))
    syncer.on_progress(report(0, 0.1), now=0.0)
    syncer.on_progress(report(1, 0.9), now=0.0)
    (timer,) = syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    assert timer.at == pytest.approx(0.1 + H * STEP)
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], now=0.9), now=0.9)
    assert publish.recipients == (0, 1) and syncer.rounds[-1].staleness == (0, 0)
    # The next round has the grid: it waits half a period, and a learner predicted later is not waited for.
    syncer.on_progress(report(0, 0.1, step=20), now=1.9)
    syncer.on_progress(report(1, 0.8, step=20), now=1.9)
    (publish,) = syncer.on_push(push(0, 2, [1.0, 0.0], now=2.0, base=1, step=20), now=2.0)
    assert publish.recipients == (0,)
    # A cap set below half a period bounds a first round too: twice the cap, here 2 × 2 steps.
    capped = paced(members=(0, 1), grace_cap_steps=2.0)
    capped.on_progress(report(0, 0.1), now=0.0)
    capped.on_progress(report(1, 0.3), now=0.0)
    (timer,) = capped.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    assert timer.at == pytest.approx(0.1 + 2 * 2.0 * STEP)


def test_a_learner_predicted_after_the_bound_is_not_waited_for():
    syncer = paced(members=(0, 1))
    syncer.on_progress(report(0, 0.1), now=0.0)
    syncer.on_progress(report(1, 5.0), now=0.0)  # far beyond half a period (0.5 s)
    (publish,) = syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    assert publish.recipients == (0,)


def test_a_learner_not_heard_from_since_its_push_was_due_is_still_coming_until_the_bound():
    syncer = paced(members=(0, 1))
    syncer.on_progress(report(0, 0.1), now=0.0)
    syncer.on_progress(report(1, 0.1), now=0.0)  # due at 0.1; then silence (a long step, a busy link)
    (timer,) = syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    assert syncer.on_timer(0.4) == []  # long past its prediction, but no report says it will not come
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], now=0.45), now=0.45)
    assert publish.recipients == (0, 1)


def test_the_round_closes_at_its_bound_and_when_a_report_moves_the_learner_past_it():
    syncer = paced(members=(0, 1, 2))
    for m in range(3):
        syncer.on_progress(report(m, 0.1), now=0.0)
    (timer,) = syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    assert syncer.on_push(push(1, 1, [0.0, 1.0], now=0.15), now=0.15) == []
    # Learner 2 reports that its push moved on (its schedule changed): nobody is left to wait for.
    (publish,) = publishes(syncer.on_progress(report(2, 3.0, step=11), now=0.2))
    assert publish.recipients == (0, 1)
    lone = paced(members=(0, 1))
    lone.on_progress(report(1, 0.1), now=0.0)
    lone.on_progress(report(0, 0.1), now=0.0)
    (timer,) = lone.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    (publish,) = lone.on_timer(timer.at)  # learner 1 never came: the bound ends the wait
    assert publish.recipients == (0,)


def test_a_round_held_open_when_the_syncer_went_down_waits_afresh_after_its_resume():
    # Learner 0 pushed just before the syncer died; learner 1 was due and could not reach it. Neither the
    # outage nor the timer that fires right after the resume closes the round with learner 0 alone.
    syncer = paced(members=(0, 1))
    for m in (0, 1):
        syncer.on_progress(report(m, 0.1), now=0.0)
    syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)  # its bound was 1.1 (a first round: a period)
    before = (syncer.fragments[0].version, syncer.theta["w"].clone())
    first = min(a.at for a in syncer.handle(SyncerResumed(), 10.0))  # and the learners' liveness checks
    assert first == pytest.approx(10.0 + H * STEP)  # the bound again, from the resume
    assert syncer.on_timer(10.05) == []
    assert (syncer.fragments[0].version, syncer.theta["w"].tolist()) == (before[0], before[1].tolist())
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], now=10.3), now=10.3)
    assert publish.recipients == (0, 1) and syncer.rounds[-1].staleness == (0, 0)
    alone = paced(members=(0, 1))  # learner 1 never comes: the bound from the resume ends the wait
    alone.on_progress(report(0, 0.1), now=0.0)
    alone.on_progress(report(1, 0.1), now=0.0)
    alone.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    first = min(a.at for a in alone.handle(SyncerResumed(), 10.0))
    (publish,) = alone.on_timer(first)
    assert publish.recipients == (0,)


def test_a_grace_window_open_when_the_syncer_went_down_is_measured_again_from_its_resume():
    syncer = SyncerCore({"w": torch.zeros(2)}, FRAGMENT, (0, 1), optimizer=lambda: DelayedNesterov(1.0, 0.0),
                        quorum=1, grace=1.0, grace_cap_steps=100.0, tau=5, merge_rule="weighted")
    (timer,) = syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)
    window = timer.at - 0.1
    first = min(a.at for a in syncer.handle(SyncerResumed(), 10.0))
    assert first == pytest.approx(10.0 + window)
    assert syncer.on_timer(10.0 + window / 2) == []
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], now=10.1), now=10.1)
    assert publish.recipients == (0, 1)
    resumed = SyncerCore({"w": torch.zeros(2)}, FRAGMENT, (0, 1), optimizer=lambda: DelayedNesterov(1.0, 0.0),
                         quorum=1, grace=1.0, grace_cap_steps=100.0, tau=5, merge_rule="weighted")
    actions = resumed.handle(SyncerResumed(), 10.0)  # nothing open: no round to close or wait for
    assert publishes(actions) == [] and all(a.at >= 60.0 for a in actions if isinstance(a, Timer))


# ---------------------------------------------------------------- alignment


def test_answers_ask_every_participant_to_push_next_at_the_same_time_on_its_own_clock():
    syncer = paced(members=(0, 1))
    syncer.on_progress(report(0, 0.1), now=0.0)
    syncer.on_progress(Progress(1, 3, 300, 4 * STEP, (0.1,)), now=0.0)  # a quarter of the speed
    syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1, trip=0.05), now=0.1)
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], now=0.3, trip=0.25), now=0.3)  # its clock is 0.2 s behind
    target = (0.1 + 0.3) / 2 + H * STEP  # the mean arrival plus one period of the fastest learner
    assert syncer.fragments[0].target == pytest.approx(target)
    assert publish.updates[0].next_push_at == pytest.approx(target - 0.05)
    assert publish.updates[1].next_push_at == pytest.approx(target - 0.25)


def test_a_push_that_missed_its_round_is_merged_alone_and_leaves_the_grid_in_place():
    syncer = paced(members=(0, 1))
    syncer.on_progress(report(0, 0.1), now=0.0)
    syncer.on_progress(report(1, 5.0), now=0.0)
    syncer.on_push(push(0, 1, [1.0, 0.0], now=0.1), now=0.1)  # closes alone: version 1
    target = syncer.fragments[0].target
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], now=0.4), now=0.4)  # based on version 0: stale
    assert publish.recipients == (1,) and syncer.rounds[-1].staleness == (1,)
    assert syncer.fragments[0].target == target  # the next round still gathers both
    assert publish.updates[1].next_push_at == pytest.approx(target - 0.05)


def test_a_learner_pushes_at_the_end_of_the_step_nearest_the_time_it_was_asked_for():
    params = {"w": torch.zeros(2)}
    core = LearnerCore(0, params, FRAGMENT, Schedule(H, 1), tau=1, alpha=0.0, wait_for_updates=False)
    pushes = []
    for step in range(1, H + 4):
        now = step * STEP
        pushes += [(now, p) for p in core.on_step(10, step_time_s=STEP, now=now)]
        if step == H:  # the schedule's push; its answer asks for the next one at 1.33 s
            core.on_update(Update(0, 1, {"w": torch.zeros(2)}, ack_seq=pushes[0][1].seq, next_push_at=1.33))
        pushes += [(now, p) for p in core.poll(now).pushes]
        if step == H + 1:  # merged: two more steps to the end nearest 1.33 s
            assert core.progress().due_in_s == pytest.approx((2 * STEP,))
    assert [round(t, 6) for t, _ in pushes] == [1.0, 1.3]  # 1.3 is nearer to 1.33 than 1.4


# ---------------------------------------------------------------- the end of a run


def test_the_last_rounds_wait_for_every_final_push_and_set_theta_to_the_learners_mean():
    syncer = paced(members=(0, 1), budget=2000, consolidate=True)
    syncer.on_progress(report(0, 1.0, tokens=1000), now=0.0)
    (stop,) = [a for a in syncer.on_progress(report(1, 1.0, tokens=1000), now=0.0) if isinstance(a, Stop)]
    assert syncer.stopped and syncer.budget_spent
    assert syncer.on_push(push(0, 1, [2.0, 0.0], now=0.1, final=True, tokens=300, steps=3), now=0.1) == []
    assert syncer.on_timer(100.0) == []  # the final round waits for every learner's last push
    (publish,) = syncer.on_push(push(1, 1, [0.0, 4.0], now=0.2, final=True, tokens=100, steps=1), now=0.2)
    # Weights 300·100 : 100·100 = 3 : 1; Θ ← Θ − Δ̄, no learning rate, no momentum.
    torch.testing.assert_close(syncer.theta["w"], torch.tensor([-1.5, -1.0]))
    assert syncer.rounds[-1].final and publish.recipients == (0, 1)


def test_a_final_round_stops_waiting_for_a_learner_that_leaves():
    syncer = paced(members=(0, 1), budget=100, consolidate=True)
    syncer.on_progress(report(0, 1.0, tokens=100), now=0.0)
    assert syncer.on_push(push(0, 1, [2.0, 0.0], now=0.1, final=True), now=0.1) == []
    (publish,) = syncer.leave(1, now=0.5)
    assert publish.recipients == (0,) and syncer.rounds[-1].final


def test_consolidation_never_raises_theta_loss_on_a_convex_problem():
    # Learners at points around a quadratic's minimum: the mean of their models is no worse than the
    # mean of their losses (Jensen); a Nesterov step past the mean can be.
    torch.manual_seed(0)
    target = torch.randn(8)

    def loss(x):
        return float(((x - target) ** 2).sum())

    fragment = [Fragment(0, ("w",), 8, False)]
    for trial in range(20):
        anchor = torch.randn(8)
        learners = [target + 0.5 * torch.randn(8) for _ in range(4)]
        syncer = SyncerCore({"w": anchor}, fragment, range(4), optimizer=lambda: DelayedNesterov(0.7, 0.9),
                            merge_rule="rda", quorum=1, consolidate=True, participation=True, budget=1)
        syncer.on_progress(Progress(0, 1, 1, STEP, ()), now=0.0)
        for m, theta in enumerate(learners):
            syncer.on_push(Push(m, 0, 0, 1, {"w": anchor - theta}, 100 * (m + 1), m + 1, final=True), now=0.1)
        assert loss(syncer.theta["w"]) <= sum(loss(x) for x in learners) / 4 + 1e-6, trial


# ---------------------------------------------------------------- the shared budget and bad reports


def test_the_budget_counts_every_life_of_every_learner_and_says_stop_once():
    syncer = paced(members=(0, 1), budget=1000)
    assert syncer.on_progress(report(0, 1.0, tokens=600), now=0.0) == []
    syncer.rejoin_state(0, after_seq=0)  # learner 0 restarts: its 600 tokens still count
    syncer.join(0, now=0.1)
    assert syncer.tokens_reported() == 600
    assert syncer.on_progress(report(1, 1.0, tokens=300), now=0.2) == []
    actions = syncer.on_progress(report(0, 1.0, tokens=100, step=1), now=0.3)
    assert actions.count(Stop()) == 1 and syncer.tokens_reported() == 1000
    assert Stop() not in syncer.on_progress(report(1, 1.0, tokens=400, step=11), now=0.4)


@pytest.mark.parametrize("bad, reason", [
    (Progress(7, 1, 1, STEP, (0.1,)), "never joined"),
    (Progress(0, -1, 1, STEP, (0.1,)), "out of range"),
    (Progress(0, 1, 2**64, STEP, (0.1,)), "out of range"),
    (Progress(0, 1, 1, math.nan, (0.1,)), "impossible step time"),
    (Progress(0, 1, 1, STEP, (math.inf,)), "impossible schedule"),
    (Progress(0, 1, 1, STEP, (-1.0,)), "impossible schedule"),
    (Progress(0, 1, 1, STEP, (0.1,) * 70_000), "impossible schedule"),
])
def test_a_bad_progress_report_is_refused_and_changes_nothing(bad, reason):
    syncer = paced(members=(0, 1), budget=10)
    syncer.on_progress(report(0, 0.5, tokens=5), now=0.0)
    before = (dict(syncer.tokens), {m: vars(p).copy() for m, p in syncer.pacer.paces.items()}, syncer.stopped)
    with pytest.raises(ProtocolError, match=reason):
        syncer.on_progress(bad, now=1.0)
    assert (dict(syncer.tokens), {m: vars(p).copy() for m, p in syncer.pacer.paces.items()}, syncer.stopped) == before


# ---------------------------------------------------------------- in the simulator

NOISY = ["learners.speeds=[1, 1, 1, 1]", "learners.jitter=0.23", "learners.drift=0.16", "learners.step_time_s=0.05",
         "outer.H=10", "outer.fragments=2", "train.tokens=40960"]


@pytest.mark.integration  # a whole training run in the simulator
def test_equal_learners_with_noisy_steps_meet_in_rounds_only_with_pacing():
    paced_run = Simulation(tiny_config("strategy=decoupled", *NOISY)).run()
    assert paced_run.round_stats["participants_mean"] >= 3.5
    unpaced = Simulation(tiny_config("strategy=decoupled", *NOISY, "outer.pacing=false", "outer.grace_cap_steps=2")).run()
    assert unpaced.round_stats["participants_mean"] < 2.5  # the paper's grace window alone: mostly alone
    assert paced_run.round_stats["stale_fraction"] < unpaced.round_stats["stale_fraction"]
    for report_ in paced_run.per_learner:
        assert report_.waiting_s == 0.0  # held rounds never hold a learner up


@pytest.mark.integration  # a whole training run in the simulator
def test_the_final_theta_is_no_worse_than_the_learners_it_came_from():
    result = Simulation(tiny_config("strategy=decoupled", *NOISY, "learners.speeds=[1, 1, 0.5, 0.25]")).run()
    assert result.final_eval_loss <= result.learners_eval_loss_mean
