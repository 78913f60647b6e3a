"""The sans-I/O cores driven by hand: no simulator, no clock, just events in and actions out."""

import dataclasses

import pytest
import torch

from diloco.core import LearnerCore, ProtocolError, Push, SyncerCore
from diloco.fragments import Fragment, Schedule
from diloco.outer import Nesterov


def make_params():
    return {"a": torch.zeros(3), "b": torch.zeros(2, 2)}


FRAGMENTS = [Fragment(0, ("a",), 3, False), Fragment(1, ("b",), 4, False)]


def learner(index, params, *, H=4, tau=0, alpha=0.0, wait=True):
    return LearnerCore(index, params, FRAGMENTS, Schedule(H, 2), tau=tau, alpha=alpha, wait_for_updates=wait)


def syncer(members=(0, 1), lr=1.0, momentum=0.0, **kwargs):
    kwargs.setdefault("merge_rule", "mean")
    return SyncerCore(make_params(), FRAGMENTS, members, optimizer=lambda: Nesterov(lr, momentum), **kwargs)


def train(params, amount):
    with torch.no_grad():
        for p in params.values():
            p.add_(amount)


def test_push_carries_anchor_minus_theta_and_counters():
    params = make_params()
    core = learner(0, params)
    train(params, 0.5)
    assert core.on_step(tokens=10) == []  # fragment 1 is due at step 2 (offset 2), fragment 0 at 4
    train(params, 0.5)
    (push,) = core.on_step(tokens=10)
    assert push.fragment == 1 and push.base_version == 0
    torch.testing.assert_close(push.deltas["b"], torch.full((2, 2), -1.0))  # anchor 0 − θ 1
    assert (push.tokens, push.steps) == (20, 2)
    assert core.tokens_since[1] == 0 and core.tokens_since[0] == 20


def test_outer_step_with_eta_one_lands_on_the_learner_mean():
    params = [make_params(), make_params()]
    cores = [learner(m, params[m]) for m in range(2)]
    hub = syncer()
    train(params[0], 1.0)
    train(params[1], 3.0)
    publishes = []
    for core in cores:
        core.on_step(5)
        for push in core.on_step(5):
            publishes += hub.on_push(push, 0.0)
    (publish,) = publishes
    assert publish.recipients == (0, 1) and publish.version == 1
    torch.testing.assert_close(hub.theta["b"], torch.full((2, 2), 2.0))
    torch.testing.assert_close(hub.theta["a"], torch.zeros(3))  # fragment 0 not synced yet


def test_synchronous_learner_waits_and_anchor_is_what_was_sent_bit_for_bit():
    params = [make_params(), make_params()]
    cores = [learner(m, params[m]) for m in range(2)]
    hub = syncer(lr=0.7, momentum=0.9)
    for step in range(1, 9):
        publishes = []
        for m, core in enumerate(cores):
            train(params[m], 0.1 * (m + 1) * step)
            for push in core.on_step(7):
                publishes += hub.on_push(push, 0.0)
        for core in cores:
            due = core.schedule.due(step)
            assert core.poll().waiting_for == tuple(due)
        sent = {}
        for publish in publishes:
            sent[publish.fragment] = {n: v.clone() for n, v in publish.updates[0].values.items()}
            for m in publish.recipients:
                assert cores[m].on_update(publish.updates[m])
        for core in cores:
            assert core.poll().waiting_for == ()
            for p, values in sent.items():
                assert core.anchor_versions[p] == hub.version(p)
                for name, value in values.items():
                    assert torch.equal(core.anchors[p][name], value)
                    assert torch.equal(core.params[name], value)  # α = 0 overwrites
    # Later outer steps must not reach into what a learner holds.
    anchor_before = cores[0].anchors[1]["b"].clone()
    hub.theta["b"].add_(1.0)
    assert torch.equal(cores[0].anchors[1]["b"], anchor_before)


def test_overlap_merges_tau_steps_after_sending_with_alpha():
    params = make_params()
    core = learner(0, params, H=4, tau=2, alpha=0.5)
    hub = syncer(members=(0,))
    core.on_step(1)
    (push,) = core.on_step(1)  # fragment 1 due at step 2
    (publish,) = hub.on_push(push, 0.0)
    assert core.on_update(publish.updates[0])
    assert core.poll().waiting_for == ()
    assert core.anchor_versions[1] == 0  # received, but not merged before step 2 + τ
    train(params, 1.0)
    core.on_step(1)
    core.poll()
    assert core.anchor_versions[1] == 0
    before = params["b"].clone()
    core.on_step(1)
    core.poll()
    assert core.anchor_versions[1] == 1
    torch.testing.assert_close(params["b"], 0.5 * before + 0.5 * publish.updates[0].values["b"])
    assert torch.equal(core.anchors[1]["b"], publish.updates[0].values["b"])


def test_late_answer_blocks_a_synchronous_learner_but_not_a_decoupled_one():
    for wait in (True, False):
        core = learner(0, make_params(), H=4, tau=1, wait=wait)
        core.on_step(1)
        core.on_step(1)  # push fragment 1
        core.on_step(1)  # step 3 = 2 + τ: the answer is due now
        assert core.poll().waiting_for == ((1,) if wait else ())


def test_finish_pushes_all_unpushed_progress_without_waiting():
    params = make_params()
    core = learner(0, params, H=4, tau=1)
    (sent,) = core.on_step(3) + core.on_step(3)  # fragment 1 goes out at step 2
    train(params, 1.0)
    core.on_step(3)
    pushes = {p.fragment: p for p in core.finish()}
    assert sorted(pushes) == [0, 1]
    assert pushes[0].tokens == 9 and pushes[0].steps == 3
    # Fragment 1 is still in flight: only what was trained since sending it, relative to the same anchor.
    assert sent.tokens + pushes[1].tokens == 9
    assert pushes[1].base_version == sent.base_version
    torch.testing.assert_close(sent.deltas["b"] + pushes[1].deltas["b"], core.anchors[1]["b"] - params["b"])
    torch.testing.assert_close(pushes[1].deltas["b"], torch.full((2, 2), -1.0))
    with pytest.raises(RuntimeError):
        core.on_step(3)


def test_a_fragment_due_again_while_in_flight_is_pushed_once_its_answer_is_merged():
    core = learner(0, make_params(), H=2, tau=0, wait=False)
    hub = syncer(members=(0,))
    assert [p.fragment for p in core.on_step(1)] == [1]  # offsets: fragment 0 at 0, fragment 1 at 1
    (first,) = core.on_step(1)
    assert first.fragment == 0
    assert core.on_step(1) == []  # step 3: fragment 1 due again, still in flight
    assert core.on_step(1) == []  # step 4: fragment 0 too
    assert core.overdue == {0, 1}
    for publish in hub.on_push(first, 0.0):
        assert core.on_update(publish.updates[0])
    poll = core.poll()
    assert [p.fragment for p in poll.pushes] == [0]
    assert core.overdue == {1}
    assert poll.pushes[0].steps == 2 and poll.waiting_for == ()


def test_syncer_rejects_bad_pushes_and_changes_nothing():
    hub = syncer()
    good = Push(0, 1, 0, 1, {"b": torch.ones(2, 2)}, 10, 2)
    before = {n: t.clone() for n, t in hub.theta.items()}
    bad_pushes = [
        Push(5, 1, 0, 1, {"b": torch.ones(2, 2)}, 10, 2),             # not a member
        Push(0, 7, 0, 1, {"b": torch.ones(2, 2)}, 10, 2),             # no such fragment
        Push(0, 1, 3, 1, {"b": torch.ones(2, 2)}, 10, 2),             # wrong version
        Push(0, 1, 0, 1, {"b": torch.ones(4)}, 10, 2),                # wrong shape
        Push(0, 1, 0, 1, {"b": torch.ones(2, 2), "a": torch.ones(3)}, 10, 2),  # outside the fragment
    ]
    for push in bad_pushes:
        with pytest.raises(ProtocolError):
            hub.on_push(push, 0.0)
    assert hub.ledger[0].pushes == 0 and not hub.fragments[1].pending
    assert hub.on_push(good, 0.0) == []
    assert hub.on_push(good, 0.0) == []  # a retry of the same push is counted once
    assert hub.ledger[0].pushes == 1 and hub.ledger[0].duplicates == 1
    for name, value in before.items():
        assert torch.equal(hub.theta[name], value)


def test_an_answer_to_an_older_push_is_dropped():
    core = learner(0, make_params(), H=4)
    hub = syncer(members=(0,))
    core.on_step(1)
    (push,) = core.on_step(1)
    (publish,) = hub.on_push(push, 0.0)
    stale = dataclasses.replace(publish.updates[0], ack_seq=push.seq - 1)
    assert not core.on_update(stale)
    assert core.stale_updates == 1 and core.in_flight[1].update is None
    assert core.on_update(publish.updates[0])
    assert not core.on_update(publish.updates[0])  # a second copy


def test_a_leaving_learners_last_pushes_are_merged_but_not_answered():
    """A learner merges nothing after its last pushes, so the syncer sends it no answer (at a 12B model that
    answer is a whole fragment per push); the others in the same round still get theirs."""
    params = [make_params(), make_params()]
    cores = [learner(m, params[m], H=4, tau=0, wait=False) for m in range(2)]
    hub = syncer()
    train(params[0], 1.0)
    train(params[1], 3.0)
    cores[0].on_step(5)
    (staying,) = cores[0].on_step(5)  # fragment 1, a push like any other
    cores[1].on_step(5)
    leaving = cores[1].finish()
    assert sorted(p.fragment for p in leaving) == [0, 1]
    assert staying.answered and not any(p.answered for p in leaving)
    assert hub.on_push(staying, 0.0) == []  # learner 1's push of fragment 1 is not in yet: the round waits
    publishes = [a for push in leaving for a in hub.on_push(push, 0.0)]
    by_fragment = {p.fragment: p for p in publishes}
    assert by_fragment[1].version == 1 and by_fragment[1].recipients == (0,)
    torch.testing.assert_close(hub.theta["b"], torch.full((2, 2), 2.0))  # both merged
    assert all(1 not in p.recipients for p in publishes)


def test_a_regional_tier_s_last_push_of_one_fragment_is_still_answered():
    """`finish_fragment` alone is a regional syncer's last round of one fragment: it merges the global answer."""
    params = make_params()
    core = learner(0, params, H=4)
    train(params, 1.0)
    core.on_step(5)
    (push,) = core.finish_fragment(0)
    assert push.final and push.answered
