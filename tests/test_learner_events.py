"""The learner core's one entry (`handle`): the step sequence both drivers follow, the same pushes and
merges as its building blocks, waiting only where the strategy is synchronous."""

from __future__ import annotations

import torch

from diloco.core.learner_events import (Advance, Finished, NextStep, PushRefused, SendProgress, SendPush, StepDone,
                                        UpdateArrived, WaitFor)
from diloco.core.messages import Update
from test_cores import learner, make_params, train


def answer(push, value: float) -> Update:
    return Update(push.fragment, push.base_version + 1, {n: torch.full_like(d, value) for n, d in push.deltas.items()},
                  ack_seq=push.seq)


def pushes_of(actions):
    return [a.push for a in actions if isinstance(a, SendPush)]


def test_a_synchronous_learner_waits_after_a_push_and_goes_on_once_the_answer_is_merged():
    params = make_params()
    core = learner(0, params, H=2)
    sent = []
    for step in range(1, 4):
        train(params, 0.1)
        sent += pushes_of(core.handle(StepDone(8, 0.1), now=float(step)))
        actions = core.handle(Advance(), now=float(step))
        assert isinstance(actions[-1], SendProgress) and actions[-1].progress.step == step
        if sent:
            break
        assert isinstance(actions[-2], NextStep)
    assert isinstance(actions[-2], WaitFor) and actions[-2].fragments == tuple(p.fragment for p in sent)
    assert core.waiting
    (push,) = sent
    after = core.handle(UpdateArrived(answer(push, 5.0)), now=4.0)
    assert isinstance(after[-1], NextStep) and not core.waiting
    name = core.fragments[push.fragment].names[0]
    assert torch.equal(params[name], torch.full_like(params[name], 5.0))  # α = 0: the answer, exactly


def test_an_answer_that_comes_while_the_learner_trains_on_changes_nothing_until_the_next_advance():
    params = make_params()
    core = learner(0, params, H=2, tau=1, wait=False)
    push = None
    while push is None:
        train(params, 0.1)
        pushes = pushes_of(core.handle(StepDone(8)))
        core.handle(Advance())
        push = pushes[0] if pushes else None
    assert core.handle(UpdateArrived(answer(push, 3.0))) == []  # kept, merged τ steps after sending
    name = core.fragments[push.fragment].names[0]
    assert not torch.equal(params[name], torch.full_like(params[name], 3.0))
    core.handle(StepDone(8))
    core.handle(Advance())
    assert torch.equal(params[name], torch.full_like(params[name], 3.0))


def test_the_last_step_only_reports_and_finished_pushes_the_rest_once():
    params = make_params()
    core = learner(0, params, H=2, wait=False)
    train(params, 0.1)
    core.handle(StepDone(8))
    actions = core.handle(Advance(last=True))
    assert [type(a) for a in actions] == [SendProgress]
    final = pushes_of(core.handle(Finished()))
    assert final and all(p.final for p in final)
    assert sum(p.tokens for p in final) == 8 * len(final)


def _finishing_with_a_push_in_flight(tau: int):
    """A waiting learner that trained a step since it pushed a fragment whose answer has not come."""
    params = make_params()
    core = learner(0, params, H=4, tau=tau)
    sent = []
    while not sent:
        train(params, 0.1)
        sent = pushes_of(core.handle(StepDone(8)))
        core.handle(Advance())
    train(params, 0.1)
    assert not pushes_of(core.handle(StepDone(8)))
    core.handle(Advance(last=True))
    return core, sent


def test_a_waiting_learner_takes_its_last_answers_before_its_last_pushes():
    """Its last pushes are then the same whenever those answers land: timing decides nothing."""
    core, (push,) = _finishing_with_a_push_in_flight(tau=2)
    assert core.handle(Finished()) == [WaitFor((push.fragment,))] and core.waiting
    final = pushes_of(core.handle(UpdateArrived(answer(push, 2.0))))
    assert final and all(p.final for p in final) and not core.waiting and core.finished
    assert core.anchor_versions[push.fragment] == push.base_version + 1  # merged, then pushed from there
    assert [p.base_version for p in final if p.fragment == push.fragment] == [push.base_version + 1]


def test_a_learner_told_to_stop_while_it_waits_to_finish_pushes_at_once():
    core, (push,) = _finishing_with_a_push_in_flight(tau=2)
    assert core.handle(Finished()) == [WaitFor((push.fragment,))]
    final = pushes_of(core.handle(Finished(wait=False)))
    assert final and all(p.final for p in final) and not core.waiting and core.finished


def test_a_refused_push_is_carried_by_the_next_one():
    params = make_params()
    core = learner(0, params, H=1, wait=False)
    train(params, 0.1)
    (first, *others) = pushes_of(core.handle(StepDone(8)))
    assert core.handle(PushRefused(first)) == []
    train(params, 0.1)
    again = [p for p in pushes_of(core.handle(StepDone(8))) if p.fragment == first.fragment]
    assert again and again[0].tokens == 16


def test_handle_gives_the_pushes_and_merges_of_the_building_blocks_bit_for_bit():
    by_events, by_calls = make_params(), make_params()
    a, b = learner(0, by_events, H=3, tau=1, alpha=0.5), learner(0, by_calls, H=3, tau=1, alpha=0.5)
    for step in range(1, 12):
        train(by_events, 0.01 * step)
        train(by_calls, 0.01 * step)
        got = pushes_of(a.handle(StepDone(8, 0.1), now=float(step)))
        want = b.on_step(8, step_time_s=0.1, now=float(step))
        got += pushes_of(a.handle(Advance(), now=float(step)))
        want += b.poll(float(step)).pushes
        assert [(p.fragment, p.seq, p.tokens) for p in got] == [(p.fragment, p.seq, p.tokens) for p in want]
        for p, q in zip(got, want):
            a.handle(UpdateArrived(answer(p, 0.2 * step)))
            b.on_update(answer(q, 0.2 * step))
    assert all(torch.equal(by_events[n], by_calls[n]) for n in by_events)
