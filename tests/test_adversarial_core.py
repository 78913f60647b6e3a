"""An insider (a learner that knows the run secret) against the syncer core: every claim bounded."""


import pytest
import torch

from diloco.core import Push, SyncerCore
from diloco.core.claims import MAX_SEQ_JUMP
from diloco.core.events import HeartbeatArrived, ProgressArrived, PushArrived
from diloco.core.messages import Progress
from diloco.core.actions import Publish, Stop
from diloco.core.refusals import ProtocolError, RoundRefused
from diloco.fragments import Fragment
from diloco.outer import Nesterov
from core_state import frozen, refused, same

FRAGMENT = [Fragment(0, ("w",), 4, False)]
THETA = torch.tensor([1.0, -1.0, 0.5, 2.0])
HONEST = [0.01, -0.02, 0.01, 0.0]


def hub(members=(0, 1), **kwargs) -> SyncerCore:
    kwargs.setdefault("merge_rule", "weighted")
    kwargs.setdefault("outlier", "reject")
    return SyncerCore({"w": THETA.clone()}, FRAGMENT, members, optimizer=lambda: Nesterov(0.7, 0.9), **kwargs)


def push(learner, seq, delta, *, base=0, tokens=100, steps=1, step=None):
    """The learner's seq-th push, by default ending at inner step seq × steps (disjoint steps)."""
    return Push(learner, 0, base, seq, {"w": torch.tensor(delta, dtype=torch.float32)}, tokens, steps,
                step=seq * steps if step is None else step)


def test_huge_finite_pushes_cannot_break_theta_even_with_the_outlier_rule_off():
    core = hub(outlier="off", quorum=2)
    core.on_push(push(0, 1, [3.4e38] * 4), now=1.0)
    before = frozen(core)
    refused(lambda: core.handle(PushArrived(push(1, 1, [3.4e38] * 4)), now=2.0))
    assert same(frozen(core), before)
    assert torch.isfinite(core.theta["w"]).all() and core.version(0) == 0


def test_non_finite_and_huge_pushes_are_refused_from_the_first_push():
    core = hub(quorum=2)
    before = frozen(core)
    assert "not finite" in refused(lambda: core.on_push(push(0, 1, [float("nan"), 0, 0, 0]), now=1.0))
    assert "fragment's own scale" in refused(lambda: core.on_push(push(0, 1, [1e30, 0, 0, 0]), now=1.0))
    assert same(frozen(core), before)


def test_walking_the_bound_up_is_refused_and_the_damage_bounded():
    core = hub(quorum=1)
    for seq in range(1, 9):  # the honest learner 1 sets the scale
        core.on_push(push(1, seq, HONEST, base=core.version(0)), now=float(seq))
    honest = float(torch.linalg.vector_norm(torch.tensor(HONEST)))
    size, accepted, largest = honest, 0, 0.0
    for seq in range(1, 101):
        attempt = [size * 4.99, 0.0, 0.0, 0.0]
        try:
            core.on_push(push(0, seq, attempt, base=core.version(0)), now=10.0 + seq)
            accepted += 1
            largest = max(largest, size * 4.99)
            size *= 4.99
        except ProtocolError as error:
            assert "\n" not in str(error)
    assert accepted <= 2 and largest <= 5 * 5 * honest


def test_one_insider_cannot_raise_the_bound_among_honest_learners():
    core = hub(quorum=1)
    for seq in range(1, 9):
        core.on_push(push(1, seq, HONEST, base=core.version(0)), now=float(seq))
    reference = core.norms.current_reference(0)
    for seq in range(1, 40):  # always just under the bound: accepted, but the bound does not move
        norm, _, bound = core.admission.outlier_bounds(push(0, seq, HONEST))
        core.on_push(push(0, seq, [bound * 0.999, 0, 0, 0], base=core.version(0)), now=10.0 + seq)
    assert core.norms.current_reference(0) == pytest.approx(reference)


def test_clip_does_not_drift_and_counts_what_it_clipped():
    core = hub(members=(0,), quorum=1, outlier="clip")
    for seq in range(1, 9):
        core.on_push(push(0, seq, HONEST, base=core.version(0)), now=float(seq))
    reference = core.norms.current_reference(0)
    for seq in range(9, 60):  # above the history's bound, under the fragment's own scale: clipped
        core.on_push(push(0, seq, [5.0, 0, 0, 0], base=core.version(0)), now=float(seq))
    assert core.norms.current_reference(0) == pytest.approx(reference)
    assert core.ledger[0].clipped == 51
    moved = float(torch.linalg.vector_norm(core.theta["w"] - THETA))
    # Nesterov (lr 0.7, momentum 0.9) moves Θ by at most lr·g/(1 − μ) per round for |g| ≤ the bound:
    # 51 rounds of clipped pushes stay within that, where unclipped ones would go 40× farther.
    assert moved <= 51 * 0.7 * (5 * reference) / (1 - 0.9)


def test_a_push_above_the_fragments_own_scale_is_refused_even_when_clipping():
    core = hub(outlier="clip", quorum=1)
    before = frozen(core)
    assert "fragment's own scale" in refused(lambda: core.on_push(push(0, 1, [1e6, 0, 0, 0]), now=1.0))
    assert same(frozen(core), before)


@pytest.mark.parametrize("tokens", [2**30, 2**40])
def test_a_huge_token_claim_cannot_own_the_merge(tokens):
    core = hub(quorum=2, outlier="off")
    refused(lambda: core.on_push(push(0, 1, [1.0, 0, 0, 0], tokens=tokens, steps=1), now=1.0))
    core.declare(0, 2**40)  # even declaring the largest batch, its weight is capped
    core.on_push(push(0, 1, [1e-3, 0, 0, 0], tokens=tokens, steps=1), now=1.0)
    core.on_push(push(1, 1, [0, 1e-3, 0, 0], tokens=100, steps=1), now=1.0)
    moved = THETA - core.theta["w"]
    assert moved[1] > 0 and moved[1] >= moved[0] / 17  # the honest update survives, weighing 1/17 at least
    (record,) = core.rounds
    assert torch.isfinite(core.theta["w"]).all() and record.update_norm < 1e-2


@pytest.mark.parametrize("kind", ["progress", "heartbeat"])
def test_an_absurd_token_count_is_refused_and_the_run_goes_on(kind):
    core = hub(budget=1_000_000)
    core.handle(ProgressArrived(Progress(0, 1, 100, 0.1)), now=1.0)
    before = frozen(core)
    for tokens in (2**64 - 1, 2**40):
        event = ProgressArrived(Progress(0, 2, tokens, 0.1)) if kind == "progress" else \
            HeartbeatArrived(0, step=2, tokens=tokens)
        refused(lambda: core.handle(event, now=1.1))
    assert same(frozen(core), before) and not core.stopped and not core.budget_spent
    refused(lambda: core.handle(HeartbeatArrived(0, step=2**40, tokens=200), now=1.2))  # steps too fast
    actions = core.handle(HeartbeatArrived(0, step=2, tokens=200), now=1.3)
    assert not any(isinstance(a, Stop) for a in actions)


def test_a_sequence_number_jump_is_refused():
    core = hub()
    core.on_push(push(0, 1, HONEST), now=1.0)
    before = frozen(core)
    assert "above the learner's last" in refused(lambda: core.on_push(push(0, 2**64 - 1, HONEST, step=2), now=2.0))
    assert "above the learner's last" in refused(lambda: core.on_push(push(0, 2 + MAX_SEQ_JUMP, HONEST, step=2),
                                                                      now=2.0))
    assert same(frozen(core), before)


def test_a_push_replayed_under_a_new_number_is_refused_and_a_new_life_starts_afresh():
    core = hub()
    core.on_push(push(0, 1, HONEST, steps=4, step=4), now=1.0)
    before = frozen(core)
    assert "already covered" in refused(lambda: core.on_push(push(0, 2, HONEST, steps=4, step=4), now=2.0))
    assert "already covered" in refused(lambda: core.on_push(push(0, 2, HONEST, steps=4, step=6), now=2.0))
    assert same(frozen(core), before)
    core.on_push(push(0, 2, HONEST, steps=4, step=8), now=2.0)  # the next steps: taken
    core.rejoin_state(0, after_seq=2)  # restarted from a checkpoint at step 4: it trains steps 5..8 again
    core.on_push(push(0, 3, HONEST, steps=4, step=8), now=3.0)
    assert core.ledger[0].pushes == 3


def test_declare_refuses_absurd_rates():
    core = hub()
    for value in (0, -1, 2**41):
        refused(lambda: core.declare(0, value))
    core.declare(0, 1024)
    refused(lambda: core.on_push(push(0, 1, HONEST, tokens=1025, steps=1), now=1.0))


def test_a_non_finite_round_changes_nothing(monkeypatch):
    core = hub(quorum=2)
    core.on_push(push(0, 1, HONEST), now=1.0)
    before = frozen(core)

    def poisoned(self, params, deltas, share=1.0, out=None, **kwargs):
        for theta in (params if out is None else out).values():
            theta.fill_(float("inf"))
        return []
    monkeypatch.setattr(Nesterov, "step", poisoned)
    with pytest.raises(RoundRefused) as caught:
        core.handle(PushArrived(push(1, 1, HONEST)), now=2.0)
    assert "\n" not in str(caught.value)
    assert same(frozen(core), before) and core.version(0) == 0 and not core.rounds
    assert core.ledger[1].last_seq == 0 and set(core.fragments[0].pending) == {0}
    monkeypatch.undo()
    actions = core.handle(PushArrived(push(1, 1, HONEST)), now=3.0)  # the same push, retried, goes in
    assert any(isinstance(a, Publish) for a in actions) and core.version(0) == 1


def test_a_thousand_members_cost_no_tensor_memory():
    core = SyncerCore({"w": THETA.clone()}, FRAGMENT, range(1000), optimizer=lambda: Nesterov(0.7, 0.9),
                      merge_rule="weighted", quorum=1)
    before = core.memory()
    core.on_push(push(3, 1, HONEST), now=1.0)
    after = core.memory()
    assert before["theta_bytes"] == after["theta_bytes"] == THETA.numel() * 4
    assert after["downlink_bytes"] == 0  # a lossless downlink keeps nothing per learner, nor per version


def test_a_resumed_syncer_decides_identically():
    core = hub(quorum=1)
    core.declare(0, 1000)
    for seq in range(1, 6):
        core.on_push(push(seq % 2, seq, HONEST, base=core.version(0)), now=float(seq))
    twin = hub(quorum=1)
    twin.load_state_dict(core.state_dict())
    attempt = push(0, 6, [1.0, 0, 0, 0], base=core.version(0))
    assert refused(lambda: core.on_push(attempt, now=7.0)) == refused(lambda: twin.on_push(attempt, now=7.0))
    assert twin.claims.tokens_per_step(0) == 1000
