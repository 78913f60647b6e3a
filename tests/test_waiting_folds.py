"""A round's coded pushes wait for its close (`Merging._fold`, `outer.merge.WAIT_SHARE`): their adds are made
together as it closes, each sum read and written once for the round instead of once a push. What must hold:
the same Θ bit for bit as folding each push as it comes, never more waiting than the share allows, a refused
push leaves the waiting adds as they were, and a state saved meanwhile holds the sums they make."""

from __future__ import annotations

import pytest
import torch

import diloco.codecs.compiled as compiled
import diloco.codecs.compiled_sums as compiled_sums
import diloco.core.merging as merging
from diloco.codecs import get_codec
from diloco.config import load_config
from diloco.core.events import PushArrived
from diloco.core.messages import Push
from diloco.core.sum_writes import SumWrites
from diloco.fragments import Fragment
from diloco.strategies import build_strategy
from diloco.transport.wire_messages import DecodedOnUse
from core_state import refused

pytestmark = pytest.mark.skipif(not compiled_sums.folds_like_torch(), reason="numba is not installed here")

LEARNERS = 4
NUMEL = compiled.MIN_ELEMENTS + 4_096
CODEC = get_codec("int4", 64)


def make_core():
    """The default config (decoupled, radial-directional merge), a round closing once all four are in."""
    spec = build_strategy(load_config(overrides=[f"learners.count={LEARNERS}", "learners.speeds=[]",
                                                 f"outer.quorum={LEARNERS}", "outer.pacing=false"]))
    fragments = [Fragment(p, (f"w{p}",), NUMEL, False) for p in range(spec.fragments)]
    params = {f"w{p}": torch.randn(NUMEL, generator=torch.Generator().manual_seed(50 + p))
              for p in range(spec.fragments)}
    core = spec.syncer_core(params, fragments, range(LEARNERS), embeddings=())
    for m in range(LEARNERS):
        core.declare(m, 64)
        core.rejoin_state(m, after_seq=0)
    return core


def push(core, learner: int, seq: int, scale: float = 1e-3) -> Push:
    delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * learner + seq)) * scale
    return Push(learner, 0, core.version(0), seq, DecodedOnUse({"w0": CODEC.encode(delta)}), 4 * 64, 4,
                step_time_s=0.01, sent_at=0.0, step=4 * seq)


def take(core, learner: int, seq: int, **kw) -> None:
    core.handle(PushArrived(push(core, learner, seq, **kw)), seq + 0.1 * learner)


def rounds(core, count: int, first_seq: int = 1) -> None:
    for seq in range(first_seq, first_seq + count):
        for m in range(LEARNERS):
            take(core, m, seq)


def waiting(core) -> list:
    return core.merging.fragments[0].sums.waiting


def test_a_rounds_coded_pushes_wait_and_are_folded_together_as_it_closes(monkeypatch):
    groups: list[int] = []
    real = SumWrites.add_group
    monkeypatch.setattr(SumWrites, "add_group",
                        lambda self, totals, deltas, alphas: groups.append(len(deltas)) or real(self, totals, deltas, alphas))
    core = make_core()
    rounds(core, 1)  # the first round: weights to judge the next pushes by
    groups.clear()
    for m in range(LEARNERS - 1):
        take(core, m, 2)
        assert len(waiting(core)) == m + 1 and "w0" not in core.merging.fragments[0].sums.weighted
    take(core, LEARNERS - 1, 2)
    assert core.version(0) == 2 and not waiting(core)
    assert groups == [LEARNERS]  # one pass over the round's sums for its four pushes

    monkeypatch.setattr(merging, "WAIT_SHARE", 0.0)  # each push folded as it comes, as before s62
    twin = make_core()
    rounds(twin, 2)
    assert torch.equal(core.merging.theta["w0"], twin.merging.theta["w0"])
    assert torch.equal(core.merging.fragments[0].optimizer.tensors()[0], twin.merging.fragments[0].optimizer.tensors()[0])


def test_the_adds_waiting_never_hold_more_than_their_share(monkeypatch):
    core = make_core()
    rounds(core, 1)
    one = waiting_bytes_of(push(core, 0, 2))
    share = 1.5 * one / (4 * NUMEL)  # room for one push's codes, not two
    monkeypatch.setattr(merging, "WAIT_SHARE", share)
    held = []
    for m in range(LEARNERS - 1):
        take(core, m, 2)
        sums = core.merging.fragments[0].sums
        held.append(len(sums.waiting))
        assert sums.waiting_bytes() <= share * 4 * NUMEL
    assert held == [1, 0, 1]  # the second made both adds at once, the third waits again
    take(core, LEARNERS - 1, 2)
    assert core.version(0) == 2 and not waiting(core)


def waiting_bytes_of(p: Push) -> int:
    return p.deltas.coded("w0").nbytes()


def test_a_refused_push_leaves_the_adds_waiting_as_they_were():
    core = make_core()
    rounds(core, 1)
    take(core, 0, 2)
    take(core, 1, 2)
    sums = core.merging.fragments[0].sums
    before = (list(sums.waiting), dict(sums.weighted), dict(sums.directions), dict(sums.radius), sums.weight)
    message = refused(lambda: take(core, 2, 2, scale=1e6))  # far beyond what the fragment's scale allows
    assert "refused" in message
    after = core.merging.fragments[0].sums
    assert [w[1] for w in after.waiting] == [w[1] for w in before[0]]
    assert (dict(after.weighted), dict(after.directions), dict(after.radius), after.weight) == before[1:]
    take(core, 2, 3)
    take(core, 3, 2)
    assert core.version(0) == 2


def test_a_state_saved_with_adds_waiting_holds_the_sums_they_make():
    """A state file keeps no pushes: saving makes the waiting adds (the same sums), and a core loaded from it
    goes on as the saved one does."""
    core = make_core()
    rounds(core, 1)
    take(core, 0, 2)
    take(core, 1, 2)
    assert len(waiting(core)) == 2
    saved = core.state_dict()
    assert not waiting(core)
    loaded = make_core()
    loaded.load_state_dict(saved)
    for c in (core, loaded):
        take(c, 2, 2)
        take(c, 3, 2)
        assert c.version(0) == 2
    assert torch.equal(core.merging.theta["w0"], loaded.merging.theta["w0"])
