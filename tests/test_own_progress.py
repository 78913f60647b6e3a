"""A restarted learner resumes the progress no push carried (`core/own_progress.py`): exactly that
progress on top of Θ, with its tokens, never the push in flight again, and Θ alone where the saved
progress is unusable."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from diloco.client.joining import fragment_seqs
from diloco.core.own_progress import export_progress, resume_progress, usable
from diloco.core.rounds import LedgerEntry
from diloco.errors import DilocoError
from diloco.sim.driver import Simulation
from diloco.v1 import diloco_pb2 as pb
from test_cores import learner, make_params, train


def _trained(steps: int, tau: int = 1):
    """A learner after `steps` steps of +0.5 each, pushing fragment 1 at step 2 (in flight, τ = 1)."""
    params = make_params()
    core = learner(0, params, tau=tau, wait=False)
    pushes = []
    for _ in range(steps):
        train(params, 0.5)
        pushes += core.on_step(tokens=10)
    return core, params, pushes


def _theta(value: float):
    return {n: torch.full_like(t, value) for n, t in make_params().items()}


def test_resumed_progress_is_theta_minus_what_no_push_carried_with_its_tokens():
    core, _, pushes = _trained(3)
    assert [p.fragment for p in pushes] == [1]  # fragment 1 pushed at step 2, its answer not yet merged
    saved = export_progress(core)
    params = _theta(7.0)
    fresh = learner(0, params, tau=1, wait=False)
    outcome = resume_progress(fresh, saved, {0: saved["seq"], 1: saved["seq"]}, "own")
    assert outcome == {0: None, 1: None}
    torch.testing.assert_close(params["a"], torch.full((3,), 7.0 + 1.5))  # three steps, never pushed
    torch.testing.assert_close(params["b"], torch.full((2, 2), 7.0 + 0.5))  # the step after the push only
    assert fresh.tokens_since == [30, 10] and fresh.steps_since == [3, 1]
    fresh.resume_at(3)
    train(params, 0.5)
    (push,) = fresh.on_step(tokens=10)  # fragment 0 is due at step 4: the saved progress and this step
    assert push.fragment == 0 and push.base_version == 0 and push.tokens == 40 and push.steps == 4
    torch.testing.assert_close(push.deltas["a"], torch.full((3,), -2.0))


def test_a_fragment_whose_shard_took_a_later_push_takes_theta_and_its_tokens_are_not_carried():
    core, _, _ = _trained(3)
    saved = export_progress(core)
    params = _theta(7.0)
    fresh = learner(0, params, tau=1, wait=False)
    outcome = resume_progress(fresh, saved, {0: saved["seq"], 1: saved["seq"] + 1}, "own")
    assert outcome[0] is None and "after the checkpoint" in outcome[1]
    torch.testing.assert_close(params["b"], torch.full((2, 2), 7.0))
    assert fresh.tokens_since == [30, 0]


def test_the_theta_policy_and_unusable_checkpoints_leave_theta_untouched():
    core, _, _ = _trained(3)
    saved = export_progress(core)
    shapes = {"a": torch.Size([3])}
    assert usable(saved, 0, 0, 0, shapes, "theta") == "the policy takes Θ"
    assert "moved on" in usable(saved, 0, 20, 0, shapes, "own", max_age=8)
    assert "does not fit" in usable(saved, 0, 0, 0, {"a": torch.Size([4])}, "own")
    broken = {**saved, "fragments": [{**saved["fragments"][0], "unpushed": {"a": torch.full((3,), float("nan"))}}]}
    assert "not finite" in usable(broken, 0, 0, 0, shapes, "own")
    assert usable({"seq": 0}, 0, 0, 0, shapes, "own") == "the checkpoint holds no progress for it"
    params = _theta(7.0)
    fresh = learner(0, params, tau=1, wait=False)
    assert all(why is not None for why in resume_progress(fresh, saved, {}, "theta").values())
    assert all(bool((t == 7.0).all()) for t in params.values()) and fresh.tokens_since == [0, 0]


def test_no_checkpoint_resumes_nothing():
    params = _theta(7.0)
    fresh = learner(0, params)
    assert resume_progress(fresh, None, {}, "own") == {0: "no checkpoint", 1: "no checkpoint"}


def test_the_push_in_flight_is_resumed_too_when_its_shard_never_took_it():
    core, _, pushes = _trained(3)
    saved = export_progress(core)
    params = _theta(7.0)
    fresh = learner(0, params, tau=1, wait=False)
    assert resume_progress(fresh, saved, {0: 0, 1: pushes[0].seq - 1}, "own") == {0: None, 1: None}
    torch.testing.assert_close(params["b"], torch.full((2, 2), 7.0 + 1.5))  # the lost push's two steps and one
    assert fresh.tokens_since == [30, 30] and fresh.steps_since == [3, 3]


SIM_CRASH = ("strategy=decoupled", "learners.speeds=[1, 1, 0.5, 0.25]", "outer.H=6", "outer.fragments=3",
             "outer.tau=2", "train.tokens=20480", "failures.crashes=[{learner = 1, at_s = 4.0}]",
             "failures.recovery_s=3", "failures.detect_s=1", "failures.checkpoint_every=4")
TOKENS_PER_STEP = 4 * 16  # the tiny config's batch × sequence


def _simulated_crash(resume: str):
    """A simulated run in which learner 1 crashes at 4 s; with the tokens it trained since its last
    checkpoint, at the crash."""
    sim = Simulation(tiny_config(*SIM_CRASH, f"failures.resume={resume}"))
    since = []
    crash = sim._on_crash

    def spy(event):
        learner = sim.learners[event.learner]
        since.append((learner.replica.steps - learner.checkpoint.steps) * TOKENS_PER_STEP)
        crash(event)

    sim._on_crash = spy
    result = sim.run()
    return sim, result, since[0]


@pytest.mark.integration  # whole training runs in the simulator
def test_a_simulated_crash_resumes_own_progress_as_the_real_learner_does():
    """The simulator's restart takes the same decision (`usable`): with `own`, a crash loses only what was
    trained since the checkpoint; with `theta`, every token no push had carried. Each token is merged once
    or counted lost either way."""
    lost = {}
    for resume in ("own", "theta"):
        sim, result, since = _simulated_crash(resume)
        assert result.per_learner[1].crashes == 1
        for m, report in enumerate(result.per_learner):
            ledger = sim.token_ledger(m)
            for p in range(len(sim.fragments)):
                assert ledger["merged"][p] + ledger["stale"][p] + ledger["lost"][p] == report.tokens, (resume, m, p)
            assert sim.syncer.ledger[m].duplicates == 0
        lost[resume] = sim.token_ledger(1)["lost"]
        if resume == "own":
            assert all(0 <= lost_p <= since for lost_p in lost["own"]), (lost["own"], since)
    assert sum(lost["own"]) < sum(lost["theta"])


def test_one_shard_reports_each_fragment_and_only_the_fragment_pushed_after_the_checkpoint_takes_theta():
    """Both fragments on one shard; fragment 0 is pushed after the checkpoint and the shard counts that
    push. The shard-wide last push would make both take Θ; per fragment, only fragment 0 does, and
    fragment 1 resumes what it trained since its own push (counted: not carried again)."""
    core, params, pushes = _trained(3)  # fragment 1 pushed at step 2, counted by the shard
    saved = export_progress(core)
    train(params, 0.5)
    (later,) = core.on_step(tokens=10)  # after the checkpoint: fragment 0 due at step 4
    assert later.fragment == 0 and later.seq > saved["seq"]
    reply = pb.JoinReply(last_seq=later.seq, fragment_last_seq={0: later.seq, 1: pushes[0].seq})
    last_seqs = fragment_seqs(reply, [0, 1], "shard-0")
    assert last_seqs == {0: later.seq, 1: pushes[0].seq}
    fresh_params = _theta(7.0)
    fresh = learner(0, fresh_params, tau=1, wait=False)
    outcome = resume_progress(fresh, saved, last_seqs, "own")
    assert "after the checkpoint" in outcome[0] and outcome[1] is None
    torch.testing.assert_close(fresh_params["a"], torch.full((3,), 7.0))  # in the syncer through the later push
    torch.testing.assert_close(fresh_params["b"], torch.full((2, 2), 7.0 + 0.5))  # the step after its push
    assert fresh.tokens_since == [0, 10]
    shard_wide = resume_progress(learner(0, _theta(7.0), tau=1, wait=False), saved,
                                 fragment_seqs(pb.JoinReply(last_seq=reply.last_seq), [0, 1], "shard-0"), "own")
    assert all(why is not None for why in shard_wide.values())  # an older shard: as before, both take Θ


def test_a_shard_claim_for_a_fragment_it_does_not_own_or_above_its_last_push_is_refused():
    with pytest.raises(DilocoError, match="does not own"):
        fragment_seqs(pb.JoinReply(last_seq=5, fragment_last_seq={0: 3, 2: 4}), [0, 1], "shard-0")
    with pytest.raises(DilocoError, match="above the last push"):
        fragment_seqs(pb.JoinReply(last_seq=5, fragment_last_seq={0: 3, 1: 6}), [0, 1], "shard-0")
    # a fragment it does not name: its last push of any fragment stands for it
    assert fragment_seqs(pb.JoinReply(last_seq=5, fragment_last_seq={0: 3}), [0, 1], "shard-0") == {0: 3, 1: 5}


def test_the_ledger_keeps_each_fragments_newest_push_across_a_restart_and_an_older_state_is_bounded():
    entry = LedgerEntry()
    entry.last_seq = entry.fragment_seqs[1] = 4
    again = LedgerEntry.of(entry.plain())
    assert (again.pushed(0), again.pushed(1)) == (0, 4)
    older = {k: v for k, v in entry.plain().items() if k not in ("fragment_seqs", "fragment_floor")}
    restored = LedgerEntry.of(older)  # a state written before the ledger kept fragments apart
    assert (restored.pushed(0), restored.pushed(1)) == (4, 4)
