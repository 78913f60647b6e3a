"""The regional tier's cores by hand: a regional syncer holds its learners' answers until the global answer
is merged (bounded by a timer, released by a refusal) and loses exactly what it had not sent up; the global
syncer checks a region's counters as any learner's, with the region's declared burst."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_config
from diloco.core.claims import RATE_SLACK_STEPS
from diloco.core.events import HeartbeatArrived, ProgressArrived, PushArrived, TimerFired
from diloco.core.messages import Progress, Push, Update
from diloco.core.regional import HOLD_FALLBACK_S, RegionalSyncer, Upstream
from diloco.core.actions import Publish, Timer
from diloco.core.refusals import ProtocolError
from diloco.fragments import Fragment
from diloco.strategies import build_strategy
from core_state import frozen, same


# ---------------------------------------------------------------- the regional syncer's core, by hand

FRAGMENTS = [Fragment(0, ("a",), 3, False), Fragment(1, ("b",), 4, False)]
SHAPES = {"a": (3,), "b": (2, 2)}
TPS = 64
"""Tokens per inner step (TINY: batch 4 x sequence 16)."""


def zeros() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shape) for n, shape in SHAPES.items()}


def unit_config(*overrides: str):
    """Decoupled, plain mean merging, quorum 1 (a round of one learner closes when nobody else is predicted),
    outliers off, and learners not found dead by silence while a test's clock jumps ahead."""
    return tiny_config("strategy=decoupled", "outer.fragments=2", "outer.merge=mean", "outer.quorum=1",
                       "outer.outlier=off", "failures.detect_s=1000", *overrides)


def regional(push_every: int = 1, members=(0, 1)) -> RegionalSyncer:
    """Region 0's syncer over `members`, from Θ = 0, as the simulator starts one."""
    config = unit_config(f"regional.push_every={push_every}")
    spec = build_strategy(config)
    region = spec.regional_syncer(0, zeros(), [0, 0], FRAGMENTS, members, embeddings=(), settings=config.regional,
                                  period=spec.H)
    for m in members:
        region.down.declare(m, TPS)
        region.down.rejoin_state(m, after_seq=0)
    return region


def global_syncer(burst: int):
    """The global syncer with region 0 as its one learner, declared as the simulator declares a region."""
    config = unit_config()
    core = build_strategy(config).syncer_core(zeros(), FRAGMENTS, [0], embeddings=())
    core.declare(0, TPS, burst)
    core.rejoin_state(0, after_seq=0)
    return core


def learner_push(m: int, p: int, seq: int, value: float, *, base: int = 0, steps: int = 2, step: int | None = None
                 ) -> PushArrived:
    """Learner m's push of fragment p: Δ = `value` everywhere, `steps` full steps of tokens."""
    (name,) = FRAGMENTS[p].names
    return PushArrived(Push(m, p, base, seq, {name: torch.full(SHAPES[name], float(value))}, steps * TPS, steps,
                            step=seq * steps if step is None else step))


def answers(actions) -> dict[int, Update]:
    """The learners' answers among a core's actions, by learner."""
    return {m: u for a in actions if isinstance(a, Publish) for m, u in a.updates.items()}


def ups(actions, kind=PushArrived) -> list:
    return [a.event for a in actions if isinstance(a, Upstream) and isinstance(a.event, kind)]


def theta(region: RegionalSyncer, name: str = "a") -> torch.Tensor:
    return region.down.theta[name].clone()


def test_a_round_pushed_up_holds_its_answers_until_the_global_answer_then_sends_global_theta_plus_progress():
    """A round that goes up holds its learners' answers: they get the global Θ̃ at once (as without the tier)
    rather than a round later. Meanwhile the region may merge more (a learner that missed the round); that
    progress since sending is kept on top of Θ̃: the held answers carry Θ̃ + (Θ_r − Θ_r,sent), the region's
    Θ becomes that, and the progress merged meanwhile goes up next, with its tokens."""
    region = regional()
    top = global_syncer(burst=RegionalSyncer.burst_steps(2, 5, 1))
    first = region.handle(learner_push(0, 0, seq=1, value=-1.0), now=1.0)  # learner 1 not predicted: closes alone
    assert answers(first) == {} and region.down.fragments[0].deferred.keys() == {0}
    assert Timer(1.0 + HOLD_FALLBACK_S) in first and region.hold_s() == HOLD_FALLBACK_S
    (sent,) = ups(first)
    theta_sent = theta(region)
    assert not torch.equal(theta_sent, torch.zeros(3))
    torch.testing.assert_close(sent.push.deltas["a"], -theta_sent)  # anchor (Θ = 0) − Θ_r
    assert (sent.push.learner, sent.push.fragment, sent.push.tokens, sent.push.steps) == (0, 0, 2 * TPS, 2)

    late = region.handle(learner_push(1, 0, seq=1, value=-3.0), now=1.5)  # stale: a round of its own, held too
    assert answers(late) == {} and ups(late) == []  # fragment 0's push up is still in flight: no second one yet
    assert region.down.fragments[0].deferred.keys() == {0, 1}
    progress_since = theta(region) - theta_sent
    assert progress_since.abs().sum() > 0

    (publish,) = [a for a in top.handle(sent, now=1.6) if isinstance(a, Publish)]
    global_theta = publish.updates[0].values["a"]
    released = region.on_upstream(publish.updates[0], now=1.7)
    held = answers(released)
    assert held.keys() == {0, 1} and held[0].ack_seq == 1 and held[1].ack_seq == 1
    for update in held.values():
        torch.testing.assert_close(update.values["a"], global_theta + progress_since)
    torch.testing.assert_close(region.down.theta["a"], global_theta + progress_since)
    torch.testing.assert_close(region.up.params["a"], region.down.theta["a"])  # the upstream mirror is Θ_r
    assert region.down.fragments[0].deferred == {} and 0 not in region.held_since
    (second,) = ups(released)  # what was merged meanwhile, with learner 1's tokens
    assert (second.push.tokens, second.push.steps, second.push.base_version) == (2 * TPS, 2, publish.version)
    torch.testing.assert_close(second.push.deltas["a"], -progress_since)
    assert region.pending[0] == {} and region.lose() == {}


def test_the_hold_timer_releases_answers_when_no_global_answer_comes():
    """The global answer may be lost or late (the global syncer down, a slow WAN): after `hold_s` the held
    answers go with the region's Θ alone, so learners never wait on the WAN for long. A global answer that
    comes later still reaches Θ_r, as a correction that the fragment's next round carries to the learners."""
    region = regional()
    region.handle(learner_push(0, 0, seq=1, value=-1.0), now=1.0)
    region.handle(learner_push(1, 0, seq=1, value=-3.0), now=1.0)  # a stale push: a round of its own, held too
    assert region.down.fragments[0].deferred.keys() == {0, 1} and region.held_since == {0: 1.0}
    assert answers(region.handle(TimerFired(), now=1.0 + HOLD_FALLBACK_S - 0.1)) == {}
    released = answers(region.handle(TimerFired(), now=1.0 + HOLD_FALLBACK_S))
    assert released.keys() == {0, 1}
    for update in released.values():
        torch.testing.assert_close(update.values["a"], region.down.theta["a"])
    assert region.down.fragments[0].deferred == {} and region.held_since == {}
    # The global answer, late: nobody waits for it any more; it becomes a correction of the next round.
    sent = region.up.in_flight[0].push
    top = global_syncer(burst=RegionalSyncer.burst_steps(2, 5, 1))
    (publish,) = [a for a in top.handle(PushArrived(sent), now=40.0) if isinstance(a, Publish)]
    before = theta(region)
    assert answers(region.on_upstream(publish.updates[0], now=41.0)) == {}
    correction = region.down.fragments[0].correction["a"]
    # Θ̃ − Θ_r,sent, where Θ_r,sent = anchor (Θ's first version, 0) − the Δ sent
    torch.testing.assert_close(correction, publish.updates[0].values["a"] + sent.deltas["a"])
    torch.testing.assert_close(region.down.theta["a"], before)  # Θ_r moves with the next round, not now
    # The next round (a push that moves nothing) applies it; its answer is held in turn, then timed out.
    assert answers(region.handle(learner_push(0, 0, seq=2, value=0.0, base=region.down.version(0)), now=42.0)) == {}
    (update,) = answers(region.handle(TimerFired(), now=42.0 + HOLD_FALLBACK_S)).values()
    torch.testing.assert_close(update.values["a"], before + correction)


def test_a_refused_push_up_releases_its_answers_and_its_tokens_go_with_the_next_push():
    """The global syncer may refuse a region's push (an outlier, a claim it doubts): the held answers go at
    once with Θ_r, and the push's progress and tokens are not dropped: they are pending again (what a death
    now would lose) and travel with the fragment's next push up."""
    region = regional()
    (sent,) = ups(region.handle(learner_push(0, 0, seq=1, value=-1.0), now=1.0))
    late = region.handle(learner_push(1, 0, seq=1, value=-3.0), now=1.0)  # stale: round 2, held, overdue up
    assert ups(late) == [] and region.pending[0] == {1: [0, 2 * TPS]}  # learner 0's tokens went up
    assert region.lose() == {1: {0: (0, 2 * TPS)}}
    released = answers(region.on_refused(sent.push))
    assert released.keys() == {0, 1}
    for update in released.values():
        torch.testing.assert_close(update.values["a"], region.down.theta["a"])
    assert region.down.fragments[0].deferred == {}
    assert region.pending[0] == {0: [2 * TPS, 0], 1: [0, 2 * TPS]} and sent.push.seq not in region.sent
    assert region.lose() == {0: {0: (2 * TPS, 0)}, 1: {0: (0, 2 * TPS)}}
    assert region.up.tokens_since[0] == 4 * TPS and 0 not in region.up.in_flight
    # The next round of fragment 0 goes up with everything since the anchor: both earlier rounds and its own.
    (nxt,) = ups(region.handle(learner_push(0, 0, seq=2, value=-1.0, base=region.down.version(0)), now=2.0))
    assert nxt.push.seq > sent.push.seq and nxt.push.base_version == sent.push.base_version
    assert (nxt.push.tokens, nxt.push.steps) == (6 * TPS, 6)
    torch.testing.assert_close(nxt.push.deltas["a"], -region.down.theta["a"])  # anchor (0) − Θ_r: all of it
    assert region.sent[nxt.push.seq] == (0, {0: [4 * TPS, 0], 1: [0, 2 * TPS]}) and region.lose() == {}


def test_lose_reports_exactly_the_tokens_merged_here_and_not_yet_sent_up():
    """A regional syncer's death loses what it merged and had not sent up, per learner and fragment, on time
    and stale apart; never what went up (a push on its way is merged by the global syncer regardless)."""
    region = regional(push_every=3)
    assert region.lose() == {}
    first = region.handle(learner_push(0, 0, seq=1, value=-1.0), now=1.0)
    assert answers(first).keys() == {0} and ups(first) == []  # not pushed up: answered at once
    assert region.lose() == {0: {0: (2 * TPS, 0)}}
    second = region.handle(learner_push(1, 0, seq=1, value=-2.0, steps=3), now=1.0)  # based on version 0: stale
    assert answers(second).keys() == {1} and ups(second) == []
    region.handle(learner_push(0, 1, seq=2, value=0.5, steps=1), now=1.0)  # fragment 1: its own count
    assert region.lose() == {0: {0: (2 * TPS, 0), 1: (TPS, 0)}, 1: {0: (0, 3 * TPS)}}
    version = region.down.version(0)
    (up,) = ups(region.handle(learner_push(0, 0, seq=3, value=-1.0, base=version), now=2.0))  # the 3rd round: up
    assert up.push.tokens == 4 * TPS + 3 * TPS and up.push.steps == 4 + 3
    assert region.lose() == {0: {1: (TPS, 0)}}
    assert region.sent[up.push.seq] == (0, {0: [4 * TPS, 0], 1: [0, 3 * TPS]})


# ---------------------------------------------------------------- the global syncer checks a region's claims


def test_the_global_syncer_refuses_a_regions_implausible_claims_and_changes_nothing():
    """A regional syncer is one learner of the global syncer, and its counters are claims like any learner's:
    a push claiming more tokens than its steps at the declared tokens per step, or a report whose tokens rose
    faster than its steps, is refused whole, whatever burst the region declared."""
    top = global_syncer(burst=RegionalSyncer.burst_steps(2, 5, 1))
    top.handle(ProgressArrived(Progress(0, 10, 10 * TPS, 0.05, (0.1, 0.1))), now=1.0)
    before = frozen(top)
    greedy = Push(0, 0, 0, 1, {"a": torch.full((3,), -1.0)}, tokens=20 * TPS + 1, steps=20, step=30)
    with pytest.raises(ProtocolError, match=r"claims 1281 tokens in 20 steps, above 64 per step"):
        top.handle(PushArrived(greedy), now=1.1)
    assert same(frozen(top), before)
    with pytest.raises(ProtocolError, match="rose by more than 64 per step"):
        top.handle(HeartbeatArrived(0, step=12, tokens=12 * TPS + 1), now=1.1)
    assert same(frozen(top), before)
    honest = dataclasses.replace(greedy, tokens=20 * TPS)
    assert answers(top.handle(PushArrived(honest), now=1.1)).keys() == {0}


H_BURST = 40


def drive_region(burst: int, rounds: int = 3) -> tuple[list[tuple[object, str]], int]:
    """Two learners (lockstep, 0.05 s steps, one fragment each H = 40 steps) under a real regional syncer,
    whose messages up go to a global syncer that declared the region with `burst`. Returns the refused
    upstream events with their reasons, and the largest rise of the region's step count that one accepted
    claim made."""
    config = unit_config(f"outer.H={H_BURST}", "outer.fragments=1", "learners.count=2")
    spec = build_strategy(config)
    one = [Fragment(0, ("a", "b"), 7, False)]
    region = spec.regional_syncer(0, zeros(), [0], one, [0, 1], embeddings=(), settings=config.regional, period=H_BURST)
    top = spec.syncer_core(zeros(), one, [0], embeddings=())
    top.declare(0, TPS, burst)
    top.rejoin_state(0, after_seq=0)
    params = [zeros(), zeros()]
    learners = []
    for m in (0, 1):
        region.down.declare(m, TPS)
        region.down.rejoin_state(m, after_seq=0)
        learners.append(spec.learner_core(m, params[m], one))
    refused: list[tuple[object, str]] = []
    rise = 0

    def to_learners(actions) -> None:
        for m, update in answers(actions).items():
            learners[m].on_update(update)
        for action in actions:
            if isinstance(action, Upstream):
                up(action.event)

    def up(event) -> None:
        nonlocal rise
        before = top.claims.of(0, now).step
        try:
            actions = top.handle(event, now)
        except ProtocolError as e:
            refused.append((event, str(e)))
            if isinstance(event, PushArrived):
                to_learners(region.on_refused(event.push))
            return
        rise = max(rise, top.claims.of(0, now).step - before)
        for update in answers(actions).values():
            to_learners(region.on_upstream(update, now))

    for step in range(1, rounds * H_BURST + 1):
        now = 0.05 * step
        for m, core in enumerate(learners):
            with torch.no_grad():
                for t in params[m].values():
                    t.add_(0.01 * (m + 1))
            events = [PushArrived(p) for p in core.on_step(TPS, step_time_s=0.05, now=now)]
            events.append(ProgressArrived(core.progress()))
            events += [PushArrived(p) for p in core.poll(now).pushes]
            for event in events:
                to_learners(region.handle(event, now))
    assert len(region.down.rounds) >= rounds - 1  # the regional rounds did happen
    return refused, rise


def test_a_regions_honest_burst_is_accepted_with_its_declared_burst_and_refused_without():
    """A regional round merges many steps at once (every learner's H steps), so the region's step count jumps
    by more than the slack any learner's claim gets (RATE_SLACK_STEPS). The region declares that burst
    (`RegionalSyncer.burst_steps`) and its honest claims all pass; without the declaration the same run's
    jump is refused as faster than its rate allows."""
    burst = RegionalSyncer.burst_steps(2, H_BURST, 1)
    refused, rise = drive_region(burst)
    print(f"\nlargest accepted rise of the region's steps in one claim: {rise} (declared burst {burst}, "
          f"slack {RATE_SLACK_STEPS})")
    assert refused == [] and rise > RATE_SLACK_STEPS, (refused[:1], rise)
    refused, _ = drive_region(0)
    assert refused, "a jump beyond RATE_SLACK_STEPS was accepted without a declared burst"
    event, reason = refused[0]
    print(f"without the burst: {len(refused)} claims refused, the first: {reason}")
    assert isinstance(event, PushArrived) and "its rate allows" in reason
