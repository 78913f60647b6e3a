"""Liveness and the end of a run: decided once in the syncer core, from the events and their times;
both drivers only deliver the events. The real shard is driven here on a manual clock, without sleeps."""

import threading

import pytest
import torch

from conftest import tiny_config
from diloco.clock import ManualClock
from diloco.core import Push, SyncerCore, Timer
from diloco.core.events import (HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived, PushArrived,
                                StreamLost, SyncerResumed, TimerFired)
from diloco.core.liveness import Liveness
from diloco.core.messages import Progress
from diloco.core.recovery import restore_plan
from diloco.core.actions import LearnerDead, Publish, RunOver, SendState
from diloco.core.refusals import ProtocolError
from diloco.fragments import Fragment
from diloco.outer import Nesterov
from diloco.shard.journal import decode_event, encode_event
from diloco.transport.wire_messages import push_payload
from diloco.shard.server import ShardPlan, SyncerShard
from diloco.sim.driver import Simulation
from diloco.transport.frames import encode_fp32, tensor_header
from diloco.v1 import diloco_pb2 as pb

FRAGMENT = [Fragment(0, ("w",), 2, False)]


def core(members=(0, 1), detect_s=5.0, **kwargs):
    kwargs.setdefault("quorum", None)
    return SyncerCore({"w": torch.zeros(2)}, FRAGMENT, members, optimizer=lambda: Nesterov(1.0, 0.0),
                      merge_rule="mean", detect_s=detect_s, **kwargs)


def beat(learner, tokens=0):
    """A heartbeat; tokens come with the step that trained them (the core refuses tokens without steps)."""
    return HeartbeatArrived(learner, step=1 if tokens else 0, tokens=tokens)


def timers(actions):
    return [a.at for a in actions if isinstance(a, Timer)]


def dead(actions):
    return [a.learner for a in actions if isinstance(a, LearnerDead)]


# ---------------------------------------------------------------- the rule


def test_a_silent_learner_is_dead_once_its_allowance_has_passed_and_alive_again_when_it_speaks():
    syncer = core()
    assert timers(syncer.handle(beat(0), 0.0)) == [5.0]  # learner 0's silence runs out first (1: 60 s to join)
    assert timers(syncer.handle(beat(1), 1.0)) == []  # a check at 5.0 is already asked for
    assert dead(syncer.handle(TimerFired(), 4.9)) == []
    assert syncer.handle(beat(1), 4.95) == []  # a check is already asked for at 5.0
    actions = syncer.handle(TimerFired(), 5.0)
    assert dead(actions) == [0] and syncer.alive == {1} and syncer.lost == {0}
    # Learner 1's turn next: its heartbeats came 3.95 s apart, so it may be silent for 5 of those.
    assert timers(actions) == [pytest.approx(4.95 + 5 * 3.95)]
    syncer.handle(beat(0), 7.0)  # a partition healed: it counts again, with its anchors as they were
    assert syncer.alive == {0, 1} and syncer.lost == set()


def test_a_learner_whose_connection_ended_is_dead_at_once_and_counts_again_when_it_speaks():
    syncer = core(quorum=1)
    for m in (0, 1):
        syncer.handle(beat(m), 0.0)
    actions = syncer.handle(StreamLost(1), 0.5)  # killed: its connection ends long before 5 s of silence
    (found,) = [a for a in actions if isinstance(a, LearnerDead)]
    assert found.learner == 1 and found.connection_lost and syncer.alive == {0} and syncer.lost == {1}
    syncer.handle(PushArrived(Push(0, 0, 0, 1, {"w": torch.ones(2)}, 10, 1)), 1.0)
    assert syncer.fragments[0].version == 1  # nobody else is waited for, and the round is all of the fleet
    syncer.handle(beat(1), 2.0)  # restarted (or its link came back): it counts again
    assert syncer.alive == {0, 1} and syncer.lost == set()


def test_a_push_that_arrives_after_its_learners_connection_ended_is_merged_but_does_not_revive_it():
    """A killed learner's last push can land after its connection's end was seen: it carries work done
    before the kill, not a sign of life, so rounds do not wait for that learner again until it beats."""
    syncer = core(quorum=None)
    for m in (0, 1):
        syncer.handle(beat(m), 0.0)
    syncer.handle(StreamLost(1), 0.5)
    syncer.handle(PushArrived(Push(1, 0, 0, 1, {"w": torch.ones(2)}, 10, 1, step=1)), 0.6)  # sent before the kill
    assert syncer.alive == {0} and syncer.lost == {1}
    syncer.handle(PushArrived(Push(0, 0, 0, 1, {"w": torch.ones(2)}, 10, 1, step=1)), 1.0)
    assert syncer.fragments[0].version == 1 and syncer.ledger[1].last_seq == 1  # its work is merged
    syncer.handle(PushArrived(Push(0, 0, 1, 2, {"w": torch.ones(2)}, 10, 1, step=2)), 1.5)
    assert syncer.fragments[0].version == 2  # the next round: nobody waits for the dead learner
    syncer.handle(beat(1), 2.0)  # restarted, or its link came back: it counts again
    assert syncer.alive == {0, 1} and syncer.lost == set()


@pytest.mark.parametrize("gone", ["left", "lost", "never joined"])
def test_a_connection_ending_for_a_learner_not_alive_changes_nothing(gone):
    syncer = core()
    syncer.handle(beat(0), 0.0)
    if gone == "left":
        syncer.handle(LearnerLeft(1, finished=True), 0.5)
    elif gone == "lost":
        syncer.handle(StreamLost(1), 0.5)
    before = (set(syncer.alive), set(syncer.lost), dict(syncer.liveness.heard))
    learner = 7 if gone == "never joined" else 1
    assert not dead(syncer.handle(StreamLost(learner), 1.0))
    assert (set(syncer.alive), set(syncer.lost), dict(syncer.liveness.heard)) == before


def test_the_allowance_follows_a_learner_that_beats_slowly():
    liveness = Liveness(detect_s=5.0, heartbeats=5)
    for at in (0.0, 3.0, 6.0, 9.0):
        liveness.hear(0, at, heartbeat=True)
    assert liveness.allowance(0) == pytest.approx(15.0)
    assert liveness.silent({0}, 9.0 + 14.9) == [] and liveness.silent({0}, 9.0 + 15.0) == [0]


def test_a_refused_heartbeat_changes_nothing():
    syncer = core()
    syncer.handle(beat(0, tokens=10), 0.0)
    before = (dict(syncer.liveness.heard), dict(syncer.tokens))
    with pytest.raises(ProtocolError, match="counters out of range"):
        syncer.handle(HeartbeatArrived(0, step=-1, tokens=5), 3.0)
    with pytest.raises(ProtocolError, match="never joined"):
        syncer.handle(beat(7), 3.0)
    assert (dict(syncer.liveness.heard), dict(syncer.tokens)) == before


def test_a_synchronous_round_goes_on_without_a_learner_found_dead():
    syncer = core()
    syncer.handle(beat(1), 0.0)
    syncer.handle(PushArrived(Push(0, 0, 0, 1, {"w": torch.ones(2)}, 10, 1)), 1.0)
    assert syncer.fragments[0].pending  # waits for learner 1
    actions = syncer.handle(TimerFired(), 5.0)
    assert dead(actions) == [1] and [p.version for p in actions if isinstance(p, Publish)] == [1]


def test_the_run_is_over_when_the_last_learner_leaves_and_what_is_open_is_merged():
    syncer = core(quorum=2)
    syncer.handle(PushArrived(Push(0, 0, 0, 1, {"w": torch.ones(2)}, 10, 1)), 1.0)
    assert not any(isinstance(a, RunOver) for a in syncer.handle(LearnerLeft(1, finished=True), 2.0))
    assert not syncer.over  # learner 0 is still there
    actions = syncer.handle(LearnerLeft(0, finished=True), 3.0)
    assert isinstance(actions[-1], RunOver) and syncer.over
    assert syncer.fragments[0].version == 1 and not syncer.fragments[0].pending
    assert timers(syncer.handle(TimerFired(), 100.0)) == []  # nobody to watch any more


def test_a_rejoin_sends_the_state_and_counts_the_learner_again():
    syncer = core()
    syncer.handle(beat(0), 0.0)  # the core's time starts with its first event
    syncer.handle(beat(0), 58.0)
    syncer.handle(TimerFired(), 60.0)  # learner 1 never came in the 60 s a learner has to join
    assert syncer.lost == {1}
    actions = syncer.handle(LearnerRejoined(1, after_seq=0), 61.0)  # it comes at last
    sent = [a for a in actions if isinstance(a, SendState)]
    assert len(sent) == 1 and torch.equal(sent[0].values["w"], syncer.theta["w"]) and sent[0].versions == {0: 0}
    assert 1 in syncer.alive and syncer.lost == set()


def test_a_resumed_syncer_gives_everyone_a_fresh_allowance():
    syncer = core()
    syncer.handle(beat(0), 0.0)
    syncer.handle(beat(1), 0.0)
    syncer.handle(SyncerResumed(), 100.0)  # it was down for 100 s: nobody could reach it
    assert dead(syncer.handle(TimerFired(), 104.0)) == []
    assert dead(syncer.handle(TimerFired(), 105.0)) == [0, 1]


def test_the_restore_policy_is_one_rule():
    assert restore_plan("checkpoint", True).optimizer and not restore_plan("fresh", True).optimizer
    assert restore_plan("fresh", True).data and restore_plan("fresh", True).steps
    assert not any(vars(restore_plan("checkpoint", False)).values())


# ---------------------------------------------------------------- the journal holds the same events


def test_every_event_survives_the_journal_as_it_was():
    push = Push(3, 0, 2, 9, {"w": torch.tensor([1.5, -2.0])}, 640, 10, step_time_s=0.05, sent_at=123.5,
                payload_bytes=0, step=40, final=True)
    encoded = encode_fp32(push.deltas)
    header = pb.PushHeader(learner=3, fragment=0, base_version=2, seq=9, tokens=640, steps=10, step_time_s=0.05,
                           sent_at=123.5, step=40, final=True,
                           tensors=[tensor_header(n, e) for n, e in encoded.items()])
    events = [ProgressArrived(Progress(1, 5, 320, 0.05, (0.2, 1.5))), beat(2, tokens=64), TimerFired(),
              LearnerLeft(1, finished=True), LearnerRejoined(2, 7, (0,)), LearnerRejoined(2, 7, None),
              SyncerResumed(), StreamLost(3)]
    for event in events:
        assert decode_event(*encode_event(event, 42.25)) == (event, 42.25)
    got, now = decode_event(*encode_event(PushArrived(push), 42.25, push_payload(header, encoded)))
    assert now == 42.25 and got.push.learner == 3 and got.push.final and got.push.sent_at == 123.5
    assert torch.equal(got.push.deltas["w"], push.deltas["w"])


# ---------------------------------------------------------------- the drivers follow the core


def test_the_real_shard_finds_a_silent_learner_dead_on_its_clock_without_waiting():
    clock = ManualClock()
    shard = SyncerShard(tiny_config("learners.count=2", "strategy=diloco"), ShardPlan(0, 1, ("",)), clock=clock)
    with shard.lock:
        shard.core = shard._make_core({"w": torch.zeros(2)}, FRAGMENT, set())
        shard.joined |= {0, 1}
        for m in (0, 1):
            shard.apply(beat(m), clock.now())
    clock.advance(4.0)
    with shard.lock:
        shard.apply(beat(0), clock.now())
        shard.waker.tick(clock.now())
    assert shard.lost == set()
    clock.advance(1.0)  # learner 1 has been silent for 5 s
    with shard.lock:
        shard.waker.tick(clock.now())
    assert shard.lost == {1} and shard.core.alive == {0}
    assert shard.snapshot()["learners"]["1"]["state"] == "lost"


def test_the_real_shard_finds_a_learner_dead_when_its_newest_update_stream_ends_without_a_goodbye():
    clock = ManualClock()
    shard = SyncerShard(tiny_config("learners.count=2"), ShardPlan(0, 1, ("",)), clock=clock)
    with shard.lock:
        shard.core = shard._make_core({"w": torch.zeros(2)}, FRAGMENT, set())
        shard.joined |= {0, 1}
        for m in (0, 1):
            shard.apply(beat(m), clock.now())
        shard.streams.update({0: 2, 1: 1})
    shard._stream_ended(0, 1)  # a stream its newer one retired: the learner reconnected, nothing is said
    assert shard.lost == set()
    with shard.lock:
        shard.apply(LearnerLeft(1, finished=True), clock.now())
    shard._stream_ended(1, 1)  # it said goodbye first
    assert shard.lost == set() and shard.core.alive == {0}
    shard._stream_ended(0, 2)  # killed: its newest stream ended
    assert shard.lost == {0} and shard.core.alive == set()


def test_the_shard_waker_thread_fires_the_cores_timers_on_an_injected_clock():
    clock = ManualClock()
    fired = []
    condition = threading.Condition(threading.RLock())
    from diloco.shard.waker import Waker

    waker = Waker(condition, fired.append, clock=clock)
    waker.start()
    try:
        with condition:
            waker.wake_at(clock.now() + 3.0)
        clock.advance(3.0)
        for _ in range(500):
            with condition:
                if fired:
                    break
                condition.wait(0.01)
        assert fired == [clock.now()]
    finally:
        waker.stop()


def deaths_in(sim: Simulation) -> list[tuple[float, int]]:
    """(when, learner) of every LearnerDead the simulation's syncer decides, as it runs."""
    deaths: list[tuple[float, int]] = []
    original = sim._handle

    def spy(actions, region=None):
        deaths.extend((sim.now, a.learner) for a in actions if isinstance(a, LearnerDead))
        original(actions, region)

    sim._handle = spy
    return deaths


@pytest.mark.integration  # whole training runs in the simulator
@pytest.mark.parametrize("fault", ["crash", "outage"])
def test_the_simulator_finds_a_crashed_learner_dead_at_once_and_a_silent_one_a_detect_s_after_its_last_word(fault):
    plan = ("failures.crashes=[{learner = 1, at_s = 2.0}]" if fault == "crash"
            else "failures.outages=[{learner = 1, at_s = 2.0, duration_s = 1000}]")
    sim = Simulation(tiny_config("strategy=diloco", "outer.H=4", plan, "failures.detect_s=1.5",
                                 "failures.recovery_s=1000", "train.tokens=10240"))
    deaths = deaths_in(sim)
    sim.run()
    (at, learner), = deaths
    assert learner == 1
    if fault == "crash":  # its connection ends with it: one trip later
        assert 2.0 <= at <= 2.0 + 0.5
    else:  # its link is cut: nothing ends, silence tells (its last heartbeat came at most 1 s before)
        assert 2.0 + 1.5 - 1.0 <= at <= 2.0 + 1.5 + 1e-9


@pytest.mark.integration  # whole training runs in the simulator
def test_in_the_simulator_a_restart_quicker_than_one_trip_is_not_found_dead_by_its_old_connection():
    """The old life's connection ends one trip (50 ms) after the crash; the new life rejoined 10 ms after it.
    The real shard heeds only the end of a learner's newest stream, and so does the simulator's."""
    sim = Simulation(tiny_config("strategy=decoupled", "outer.H=4", "failures.crashes=[{learner = 1, at_s = 2.0}]",
                                 "failures.recovery_s=0.01", "link.latency_ms=50", "train.tokens=10240"))
    deaths = deaths_in(sim)
    result = sim.run()
    assert deaths == []
    assert result.final_eval_loss is not None
