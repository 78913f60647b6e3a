"""Decoupled DiLoCo and the asynchronous family: quorum, grace, weights, stale pushes, failures."""

import math

import pytest
import torch

from conftest import computed, tiny_config
from diloco.core import Push, SyncerCore, Timer
from diloco.core.learner_core import LearnerCore
from diloco.core.syncer_core import ProtocolError, token_weight
from diloco.fragments import Fragment, Schedule
from diloco.outer import DelayedNesterov, Nesterov
from diloco.sim.driver import Simulation
from diloco.network.links import Direction
from diloco.strategies import build_strategy

FRAGMENT = [Fragment(0, ("w",), 2, False)]


def hub(members=(0, 1, 2), **kwargs):
    kwargs.setdefault("merge_rule", "weighted")
    return SyncerCore({"w": torch.zeros(2)}, FRAGMENT, members, optimizer=lambda: Nesterov(1.0, 0.0), **kwargs)


def push(learner, seq, delta, *, base=0, tokens=100, steps=1, step_time=1.0, sent_at=None):
    """The learner's seq-th push, ending at inner step seq × steps: its pushes cover disjoint steps."""
    return Push(learner, 0, base, seq, {"w": torch.tensor(delta)}, tokens, steps, step_time_s=step_time,
                sent_at=sent_at, step=seq * steps)


# ---------------------------------------------------------------- syncer mechanisms


def test_a_round_waits_for_the_quorum():
    syncer = hub(quorum=2, grace=0.0)
    assert syncer.on_push(push(0, 1, [1.0, 0.0]), now=0.0) == []
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0]), now=0.5)
    assert publish.recipients == (0, 1) and publish.version == 1
    torch.testing.assert_close(syncer.theta["w"], torch.tensor([-0.5, -0.5]))


def test_grace_window_is_the_measured_slack_and_ends_the_round():
    syncer = hub(quorum=1, grace=1.0, grace_cap_steps=2.0, tau=2)
    # Step time 1 s, the push took 0.2 s to arrive: slack = 2·1 − (0 + 0.2) = 1.8 s.
    (timer,) = syncer.on_push(push(0, 1, [1.0, 0.0], sent_at=9.8), now=10.0)
    assert isinstance(timer, Timer) and timer.at == pytest.approx(11.8)
    assert syncer.on_timer(11.0) == []
    assert syncer.on_push(push(1, 1, [0.0, 1.0], sent_at=10.3), now=10.5) == []  # joins the open round
    (publish,) = syncer.on_timer(11.8)
    assert publish.recipients == (0, 1)
    assert syncer.rounds[-1].held_s == pytest.approx(1.8)


def test_grace_is_clamped_between_zero_and_the_cap():
    generous = hub(quorum=1, grace=10.0, grace_cap_steps=1.5, tau=2)
    (timer,) = generous.on_push(push(0, 1, [1.0, 0.0], sent_at=0.0), now=0.0)
    assert timer.at == pytest.approx(1.5)  # cap · step time
    no_slack = hub(quorum=1, grace=1.0, tau=0)
    (publish,) = no_slack.on_push(push(0, 1, [1.0, 0.0], sent_at=0.0), now=0.1)  # τ = 0: nothing to spare
    assert publish.recipients == (0,)
    off = hub(quorum=1, grace=0.0, tau=2)
    assert len(off.on_push(push(0, 1, [1.0, 0.0]), now=0.0)) == 1


def test_round_closes_before_its_deadline_when_everyone_is_in():
    syncer = hub(members=(0, 1), quorum=1, grace=1.0, tau=4)
    (timer,) = syncer.on_push(push(0, 1, [1.0, 0.0], sent_at=0.0), now=0.0)
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], sent_at=0.0), now=0.1)
    assert publish.recipients == (0, 1)
    assert syncer.on_timer(timer.at) == []  # a stale timer does nothing


def test_token_weights_favour_more_tokens_and_larger_batches():
    assert token_weight(100, 1) == 10_000
    assert token_weight(100, 4) == 2_500  # same tokens in smaller batches
    assert token_weight(200, 2) == 20_000
    syncer = hub(quorum=2, grace=0.0)
    syncer.on_push(push(0, 1, [4.0, 0.0], tokens=100, steps=1), now=0.0)
    syncer.on_push(push(1, 1, [0.0, 4.0], tokens=100, steps=4), now=0.0)
    # weights 10000 : 2500 = 0.8 : 0.2, η = 1 → Θ = −(0.8·4, 0.2·4)
    torch.testing.assert_close(syncer.theta["w"], torch.tensor([-3.2, -0.8]))


def test_stale_push_is_merged_next_round_and_counted_once():
    syncer = hub(quorum=1, grace=0.0)
    syncer.on_push(push(0, 1, [1.0, 0.0], tokens=50), now=0.0)  # closes version 1 alone
    (publish,) = syncer.on_push(push(1, 1, [0.0, 1.0], base=0, tokens=70), now=1.0)  # based on version 0
    assert publish.version == 2 and publish.recipients == (1,)
    assert syncer.rounds[-1].stale == 1
    assert syncer.ledger[0].merged[0] == 50 and syncer.ledger[0].stale[0] == 0
    assert syncer.ledger[1].stale[0] == 70 and syncer.ledger[1].merged[0] == 0
    syncer.on_push(push(1, 1, [0.0, 1.0], base=0, tokens=70), now=2.0)  # a retry
    assert syncer.ledger[1].stale[0] == 70 and syncer.ledger[1].duplicates == 1
    torch.testing.assert_close(syncer.theta["w"], torch.tensor([-1.0, -1.0]))


def open_round_merge(syncer, fragment=0):
    """What fragment's open round would merge if it closed now."""
    state = syncer.fragments[fragment]
    syncer.merging.judge_whole(state)
    return state.sums.merged(list(state.fragment.names), syncer.merge_rule)


def test_two_pushes_of_one_learner_in_a_round_add_up():
    syncer = hub(quorum=2, grace=0.0)
    syncer.on_push(push(0, 1, [1.0, 0.0], tokens=10), now=0.0)
    syncer.on_push(push(0, 2, [1.0, 0.0], tokens=10), now=0.1)
    assert len(syncer.fragments[0].pending) == 1
    assert syncer.fragments[0].pending[0].tokens == 20
    torch.testing.assert_close(open_round_merge(syncer)["w"], torch.tensor([2.0, 0.0]))  # one contribution


@pytest.mark.parametrize("rule", ["weighted", "rda", "mean"])
def test_in_learner_order_a_round_is_the_same_whatever_order_its_pushes_came_in(rule):
    """A reproducible run's syncer sums a round's pushes in learner order: float sums taken as pushes come
    differ in their last bits with the order (shown here first), which AdamW then grows into a different run."""
    numel = 4096
    generator = torch.Generator().manual_seed(0)
    deltas = [torch.randn(numel, generator=generator) * scale for scale in (1.0, 1e-3, 3e2)]
    pushes = [(0, 1, 100), (1, 1, 70), (2, 1, 130), (0, 2, 50)]  # learner, seq, tokens: 0's second push too

    def theta_after(order, in_learner_order):
        fragment = [Fragment(0, ("w",), numel, False)]
        syncer = SyncerCore({"w": torch.zeros(numel)}, fragment, (0, 1, 2, 3), optimizer=lambda: Nesterov(1.0, 0.0),
                            merge_rule=rule, quorum=None, in_learner_order=in_learner_order)  # 3 never comes
        for i in order:
            learner, seq, tokens = pushes[i]
            delta = deltas[learner] * seq
            syncer.on_push(Push(learner, 0, 0, seq, {"w": delta}, tokens, 1, step_time_s=1.0, step=seq), now=0.0)
        assert syncer.rounds == [] and len(syncer.fragments[0].whole) == (3 if in_learner_order else 0)
        syncer.flush(now=1.0)
        assert syncer.fragments[0].whole == {}
        return syncer.theta["w"].clone()

    orders = [(0, 3, 1, 2), (2, 1, 0, 3), (1, 0, 2, 3), (2, 0, 3, 1)]
    assert any(not torch.equal(theta_after(orders[0], False), theta_after(o, False)) for o in orders[1:])
    expected = theta_after(orders[0], True)
    for order in orders[1:]:
        assert torch.equal(theta_after(order, True), expected)
    torch.testing.assert_close(expected, theta_after(orders[0], False))


def test_leaving_lowers_what_a_round_waits_for():
    syncer = hub(members=(0, 1), quorum=None)
    assert syncer.on_push(push(0, 1, [1.0, 0.0]), now=0.0) == []
    (publish,) = syncer.leave(1, now=3.0)
    assert publish.recipients == (0,)


def test_flush_closes_whatever_is_open():
    syncer = hub(quorum=3, grace=0.0)
    syncer.on_push(push(0, 1, [1.0, 0.0]), now=0.0)
    (publish,) = syncer.flush(now=1.0)
    assert publish.recipients == (0,)
    assert syncer.flush(now=2.0) == []


# ---------------------------------------------------------------- delayed Nesterov


def test_delayed_nesterov_against_the_paper_pseudocode():
    lr, mu, n = 0.7, 0.9, 3
    arrivals = [0.5, -0.2, 0.3, 0.1, 0.4, -0.6, 0.2]
    theta, b, s = 1.0, 0.0, 0.0
    expected = []
    for t, g in enumerate(arrivals, start=1):
        s += g
        if t % n:
            theta -= lr * g / n
        else:
            b = mu * b + s / n
            theta -= lr * (mu * b + g / n)
            s = 0.0
        expected.append(theta)
    ours = {"w": torch.tensor([1.0])}
    dn = DelayedNesterov(lr, mu, n)
    for g, want in zip(arrivals, expected):
        dn.step(ours, {"w": torch.tensor([g])})
        assert ours["w"].item() == pytest.approx(want, rel=1e-6)


def test_delayed_nesterov_with_a_buffer_of_one_is_nesterov():
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 2.0])}
    dn, nesterov = DelayedNesterov(0.7, 0.9, 1), Nesterov(0.7, 0.9)
    for g in ([0.5, 0.1], [-0.3, 0.2], [0.4, 0.4]):
        dn.step(a, {"w": torch.tensor(g)})
        nesterov.step(b, {"w": torch.tensor(g)})
    torch.testing.assert_close(a["w"], b["w"])


def test_partial_rounds_move_the_momentum_once_their_shares_make_a_full_round():
    lr, mu = 0.5, 0.9
    theta = {"w": torch.tensor([0.0])}
    dn = DelayedNesterov(lr, mu)
    dn.step(theta, {"w": torch.tensor([2.0])}, share=0.25)  # plain: −0.5·0.25·2
    assert theta["w"].item() == pytest.approx(-0.25)
    dn.step(theta, {"w": torch.tensor([4.0])}, share=0.75)  # full: b = 0.25·2 + 0.75·4 = 3.5
    assert theta["w"].item() == pytest.approx(-0.25 - lr * (mu * 3.5 + 0.75 * 4))
    assert dn.buffers["w"].item() == pytest.approx(3.5)
    with pytest.raises(ValueError, match="share"):
        dn.step(theta, {"w": torch.tensor([1.0])}, share=0.0)


def test_full_rounds_through_delayed_nesterov_are_nesterov():
    a, b = {"w": torch.tensor([1.0, -1.0])}, {"w": torch.tensor([1.0, -1.0])}
    dn, nesterov = DelayedNesterov(0.7, 0.9), Nesterov(0.7, 0.9)
    for g in ([0.5, 0.1], [-0.3, 0.2], [0.4, 0.4]):
        dn.step(a, {"w": torch.tensor(g)}, share=1.0)
        nesterov.step(b, {"w": torch.tensor(g)})
    torch.testing.assert_close(a["w"], b["w"])


# ---------------------------------------------------------------- strategies in the simulator

HETERO = ["learners.speeds=[1, 1, 0.5, 0.25]", "learners.jitter=0.1", "outer.H=6", "outer.fragments=3",
          "outer.tau=2", "outer.alpha=0.5", "train.tokens=20480"]


def test_dynamic_local_updates_scale_the_period_with_speed():
    spec = build_strategy(tiny_config("strategy=async-dn", "learners.speeds=[1, 1, 0.5, 0.25]", "outer.H=8"))
    assert spec.learner_H == (8, 8, 4, 2)
    assert spec.optimizer == "delayed-nesterov" and spec.dn_buffer == 4


@pytest.mark.integration  # a whole training run in the simulator
def test_decoupled_learners_never_wait_and_faster_ones_train_more():
    config = tiny_config("strategy=decoupled", *HETERO)
    sim = Simulation(config)
    result = sim.run()
    # The syncer says stop once the budget is spent; learners train on while the word travels to them:
    # a report up and the stop down, then the step in progress.
    travel_steps = math.ceil(2 * config.link.latency_ms / 1000 / config.learners.step_time_s) + 2
    tokens_per_step = config.train.batch_size * config.train.seq_len
    assert sim.budget <= result.tokens <= sim.budget + len(result.per_learner) * travel_steps * tokens_per_step
    for report in result.per_learner:
        assert report.waiting_s == 0.0
        assert report.busy_fraction > 0.97
    tokens = [r.tokens for r in result.per_learner]
    assert tokens[0] > tokens[2] > tokens[3]
    assert result.goodput > 0.97


@pytest.mark.integration  # a whole training run in the simulator
def test_a_reproducible_decoupled_run_leaves_nothing_to_timing():
    """Every round holds every learner and none is stale, faster learners wait for their answers rather
    than train more, and the learners' speeds change nothing that is computed."""
    result = Simulation(tiny_config("strategy=decoupled", "outer.reproducible=true", *HETERO)).run()
    equal = Simulation(tiny_config("strategy=decoupled", "outer.reproducible=true", *HETERO,
                                   "learners.speeds=[1, 1, 1, 1]")).run()
    assert result.tokens_stale == 0 and result.round_stats["participants_mean"] == len(result.per_learner)
    assert len({r.tokens for r in result.per_learner}) == 1
    assert result.per_learner[0].waiting_s > 0
    assert result.final_eval_loss == equal.final_eval_loss  # to the last bit: sums in learner order


@pytest.mark.integration  # a whole training run in the simulator
@pytest.mark.parametrize("strategy", ["async", "async-dn", "decoupled"])
def test_every_trained_token_is_merged_late_or_lost(strategy):
    crash = "failures.crashes=[{learner = 1, at_s = 4.0}]"
    sim = Simulation(tiny_config(f"strategy={strategy}", *HETERO, crash, "failures.recovery_s=3",
                                 "failures.detect_s=1", "failures.checkpoint_every=4"))
    result = sim.run()
    assert result.per_learner[1].crashes == 1
    fragments = len(sim.fragments)
    for m, report in enumerate(result.per_learner):
        ledger = sim.token_ledger(m)
        for p in range(fragments):
            assert ledger["merged"][p] + ledger["stale"][p] + ledger["lost"][p] == report.tokens, (m, p)
        assert sim.syncer.ledger[m].duplicates == 0
    assert result.tokens_lost > 0
    assert result.tokens_merged + result.tokens_stale + result.tokens_lost == pytest.approx(result.tokens)


@pytest.mark.integration  # a whole training run in the simulator
def test_a_crashed_learner_rejoins_from_the_current_global_model():
    """With `failures.resume = "theta"`: Θ alone (its own progress on top: `test_own_progress.py`)."""
    crash = "failures.crashes=[{learner = 2, at_s = 3.0}]"
    sim = Simulation(tiny_config("strategy=decoupled", *HETERO, crash, "failures.recovery_s=2",
                                 "link.bandwidth_mbit=1e6", "link.latency_ms=0", "failures.resume=theta"))
    rejoined = {}
    original = sim._on_state

    def spy(event):
        original(event)
        theta, versions, _ = event.state  # and its first pushes on the grid (test_join_schedule.py)
        rejoined[event.learner] = {n: p.detach().clone()
                                   for n, p in sim.learners[event.learner].replica.named_params().items()}
        rejoined["theta"] = theta
        rejoined["versions"] = versions

    sim._on_state = spy
    result = sim.run()
    for name, value in rejoined[2].items():
        assert torch.equal(value, rejoined["theta"][name])
    assert sim.learners[2].crashes == 1
    assert result.per_learner[2].down_s == pytest.approx(2.0, abs=0.01)
    for m in (0, 1, 3):
        assert result.per_learner[m].waiting_s == 0.0 and result.per_learner[m].busy_fraction > 0.97


@pytest.mark.integration  # a whole training run in the simulator
def test_synchronous_diloco_goes_on_without_a_dead_learner_once_it_is_noticed():
    crash = "failures.crashes=[{learner = 3, at_s = 2.0}]"
    sim = Simulation(tiny_config("strategy=diloco", "outer.H=4", crash, "failures.detect_s=1",
                                 "failures.recovery_s=1000", "train.tokens=10240"))
    result = sim.run()
    # The others wait for it only until it is noticed, not for its 1000 s recovery, and finish their
    # share; it trains the rest of its own share when it is back.
    for m in (0, 1, 2):
        report = result.per_learner[m]
        assert report.busy_s + report.waiting_s < 20
    assert result.per_learner[3].crashes == 1
    assert result.per_learner[3].down_s == pytest.approx(1000.0, abs=1.0)
    assert result.training_time_s > 1000


@pytest.mark.integration  # a whole training run in the simulator
def test_random_crashes_repeat_for_a_seed():
    overrides = ["strategy=decoupled", *HETERO, "failures.mtbf_s=6", "failures.recovery_s=1"]
    first = Simulation(tiny_config(*overrides)).run().summary()
    assert sum(r["crashes"] for r in first["per_learner"]) > 0
    assert computed(Simulation(tiny_config(*overrides)).run().summary()) == computed(first)


def test_a_link_outage_holds_messages_until_it_ends():
    direction = Direction(bandwidth_bps=8e6, latency_s=0.1, outages=[(1.0, 3.0)])
    assert direction.send(0.0, 1_000_000) == pytest.approx(1.1)  # 1 s on the wire, done as it goes down
    assert direction.send(1.5, 1_000_000) == pytest.approx(3.0 + 1.0 + 0.1)  # waits for the link
    mid = Direction(bandwidth_bps=8e6, latency_s=0.0, outages=[(0.5, 2.5)])
    assert mid.send(0.0, 1_000_000) == pytest.approx(3.0)  # half before, the other half after


@pytest.mark.integration  # a whole training run in the simulator
def test_decoupled_runs_through_an_outage():
    def heard_from_learner_0_between(sim, start, end):
        return any(0 in r.participants for r in sim.syncer.rounds if start <= r.closed_at <= end)

    healthy = Simulation(tiny_config("strategy=decoupled", *HETERO))
    healthy.run()
    assert heard_from_learner_0_between(healthy, 2.0, 5.0)
    outage = "failures.outages=[{learner = 0, at_s = 1.0, duration_s = 4.0}]"
    sim = Simulation(tiny_config("strategy=decoupled", *HETERO, outage))
    result = sim.run()
    assert not heard_from_learner_0_between(sim, 2.0, 5.0)  # its pushes wait for the link
    assert heard_from_learner_0_between(sim, 5.0, 5.5)  # and land once it is back
    assert result.per_learner[0].waiting_s == 0.0  # while it trains on
    assert result.goodput > 0.97


def test_a_round_speaks_for_the_share_of_learners_it_heard_from():
    four = (0, 1, 2, 3)
    partial = hub(members=four, quorum=1, grace=0.0, participation=True)
    partial.on_push(push(0, 1, [4.0, 0.0]), now=0.0)
    torch.testing.assert_close(partial.theta["w"], torch.tensor([-1.0, 0.0]))  # one of four equal learners
    full = hub(members=four, quorum=None, participation=True)
    for m in four:
        full.on_push(push(m, 1, [4.0, 0.0]), now=0.0)
    torch.testing.assert_close(full.theta["w"], torch.tensor([-4.0, 0.0]))  # everyone: the plain mean
    # A learner that pushed before with three times the weight counts for it while absent.
    heavy = hub(members=(0, 1), quorum=1, grace=0.0, participation=True)
    heavy.on_push(push(1, 1, [0.0, 0.0], tokens=300, steps=3), now=0.0)  # weight 30000
    heavy.on_push(push(0, 1, [4.0, 0.0], tokens=100, steps=1, base=1), now=1.0)  # weight 10000
    torch.testing.assert_close(heavy.theta["w"], torch.tensor([-1.0, 0.0]))  # 10000 / 40000 of 4


@pytest.mark.integration  # a whole training run in the simulator
def test_data_parallel_stalls_through_crashes_and_its_replicas_stay_identical():
    healthy = Simulation(tiny_config("strategy=ddp")).run()
    sim = Simulation(tiny_config("strategy=ddp", "failures.mtbf_s=4", "failures.recovery_s=1"))
    result = sim.run()
    assert sum(r.crashes for r in result.per_learner) > 0
    assert result.training_time_s > healthy.training_time_s
    assert len({r.steps for r in result.per_learner}) == 1
    reference = dict(sim.learners[0].replica.model.named_parameters())
    for learner in sim.learners[1:]:
        for name, p in learner.replica.model.named_parameters():
            assert torch.equal(p, reference[name]), name


# ---------------------------------------------------------------- outlier pushes


def warm_up(syncer):
    """Three ordinary pushes (norm 1): the outlier rule has its median."""
    for seq in range(1, 4):
        syncer.on_push(push(seq % 3, seq, [1.0, 0.0], base=syncer.version(0)), now=float(seq))


def test_an_outlier_push_is_refused_with_the_reason_and_changes_nothing():
    syncer = hub(quorum=3, outlier="reject", outlier_factor=5.0)
    warm_up(syncer)
    before = (syncer.theta["w"].clone(), dict(syncer.fragments[0].pending), syncer.ledger[0].pushes)
    with pytest.raises(ProtocolError, match="refused as an outlier"):
        syncer.on_push(push(0, 10, [10.0, 0.0], base=syncer.version(0)), now=5.0)  # under Θ's own scale
    assert torch.equal(syncer.theta["w"], before[0]) and syncer.fragments[0].pending == before[1]
    assert syncer.ledger[0].pushes == before[2]
    syncer.on_push(push(0, 11, [2.0, 0.0], base=syncer.version(0)), now=6.0)  # an ordinary one still goes in


def test_an_outlier_push_is_clipped_to_the_bound():
    syncer = hub(quorum=3, outlier="clip", outlier_factor=5.0)
    warm_up(syncer)
    syncer.on_push(push(0, 10, [0.0, 10.0], base=syncer.version(0)), now=5.0)
    assert syncer.ledger[0].clipped == 1
    torch.testing.assert_close(open_round_merge(syncer)["w"], torch.tensor([0.0, 5.0]))


def test_a_refused_push_frees_the_fragment_and_its_tokens_go_with_the_next_push():
    params = {"w": torch.zeros(2)}
    core = LearnerCore(0, params, FRAGMENT, Schedule(2, 1), tau=0, alpha=0.0, wait_for_updates=False)
    core.on_step(10)
    (sent,) = core.on_step(10)
    core.on_refused(sent)
    assert not core.in_flight and core.unpushed_tokens() == [20]
    core.on_step(10)
    (again,) = core.on_step(10)
    assert again.tokens == 40 and again.seq > sent.seq
