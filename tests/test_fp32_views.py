"""fp32 pushes read where they arrived (`codecs/fp32_view.py`): the same values as decoding them, so a core fed
views merges bit for bit as one fed the decoded tensors, never copying a push; a bad one is refused alone, in
the decode's words; and a group's views are folded into the sums together (`cache_chunks.add_scaled_group`),
the same arithmetic as one after another."""

from __future__ import annotations

import pytest
import torch

from diloco.cache_chunks import add_scaled, add_scaled_group
from diloco.codecs import Encoded, get_codec
from diloco.codecs.fp32_view import Fp32View
from diloco.config import load_config
from diloco.core.actions import PushRefused
from diloco.core.events import PushArrived, PushesArrived
from diloco.core.messages import Push
from diloco.core.refusals import ProtocolError
from diloco.fragments import Fragment
from diloco.outer.merge import tensor_norm
from diloco.strategies import build_strategy
from diloco.transport.wire_messages import DecodedOnUse

LEARNERS = 4
NUMEL = 70_001


def values(seed: int, numel: int = NUMEL, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


def test_a_view_reads_the_decoded_values_and_measures_and_folds_them_bit_for_bit():
    encoded = get_codec("fp32").encode(values(1))
    view = DecodedOnUse({"w": encoded}).coded("w")
    decoded = get_codec("fp32").decode(encoded)
    assert isinstance(view, Fp32View) and view.shape == decoded.shape and view.numel() == NUMEL
    assert view.norm() == tensor_norm(decoded)
    index = torch.arange(3, NUMEL, 101)
    assert torch.equal(view.sample(index), decoded[index].double())
    total = values(2)
    assert torch.equal(view.add_scaled([torch.empty(NUMEL)], [total], [0.3])[0],
                       add_scaled([torch.empty(NUMEL)], [total], decoded, [0.3])[0])


def test_bytes_that_do_not_fit_their_shape_are_refused_as_a_push_in_one_line():
    encoded = get_codec("fp32").encode(values(1))
    cut = Encoded("fp32", encoded.shape, 0, bytes(encoded.payload)[:-4])
    with pytest.raises(ProtocolError, match="bad push") as refused:
        DecodedOnUse({"w": cut}).coded("w")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("made", ["new", "given", "in place"])
def test_a_group_folded_a_chunk_at_a_time_is_each_folded_in_turn(made, monkeypatch):
    import diloco.cache_chunks as cache_chunks

    monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", 4096)  # many chunks, a short last one
    deltas, alphas = [values(10 + k) for k in range(3)], [[0.25, 1.75], [3.5, 0.125], [1.1, 0.9]]
    base = [values(20), values(21)]
    expected = [t.clone() for t in base] if made != "new" else [None, None]
    for delta, alpha in zip(deltas, alphas):
        expected = add_scaled([torch.empty(NUMEL), torch.empty(NUMEL)], expected, delta, alpha)
    outs = [t.clone() for t in base] if made == "in place" else [torch.empty(NUMEL), torch.empty(NUMEL)]
    totals = outs if made == "in place" else (base if made == "given" else [None, None])
    add_scaled_group(outs, totals, deltas, alphas)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))


def make_core(merge: str):
    spec = build_strategy(load_config(overrides=[f"learners.count={LEARNERS}", "learners.speeds=[]",
                                                 f"outer.merge={merge}", "outer.quorum=1"]))
    fragments = [Fragment(p, (f"w{p}",), NUMEL, False) for p in range(spec.fragments)]
    core = spec.syncer_core({f"w{p}": values(50 + p) for p in range(spec.fragments)}, fragments, range(LEARNERS),
                            embeddings=())
    for m in range(LEARNERS):
        core.declare(m, 64)
        core.rejoin_state(m, after_seq=0)
    return core


def pushes(seq: int, on_the_wire: bool, nan_learner: int | None = None) -> list[Push]:
    out = []
    for m in range(LEARNERS):
        delta = values(100 * m + seq, scale=1e-3)
        if m == nan_learner:
            delta[7] = float("nan")
        encoded = Encoded("fp32", (NUMEL,), 0, delta.numpy().tobytes())
        deltas = DecodedOnUse({"w0": encoded}) if on_the_wire else {"w0": delta}
        out.append(Push(m, 0, 0 if seq == 1 else seq - 1, seq, deltas, 4 * 64, 4, step_time_s=0.01, sent_at=0.0,
                        step=4 * seq))
    return out


def run(merge: str, on_the_wire: bool, nan_learner: int | None = None):
    core, taken, actions = make_core(merge), [], []
    for seq in range(1, 4):
        group = pushes(seq, on_the_wire, nan_learner if seq == 2 else None)
        core.handle(PushArrived(group[0]), seq * 1.0)
        actions += core.handle(PushesArrived(tuple(group[1:])), seq * 1.0 + 0.5)
        taken += group
    return core, taken, actions


@pytest.mark.parametrize("merge", ["rda", "weighted"])
def test_a_core_fed_pushes_as_they_arrived_merges_as_one_fed_the_decoded_tensors(merge, monkeypatch):
    """Θ and the outer optimizer the same bit for bit, and no push read off the wire was copied (the run's
    first push of a round is kept whole and decoded); each group's pushes were folded into the sums together."""
    import diloco.core.sum_writes as sum_writes

    groups = []
    monkeypatch.setattr(sum_writes, "add_scaled_group",
                        lambda outs, totals, deltas, alphas: groups.append(len(deltas)) or
                        add_scaled_group(outs, totals, deltas, alphas))
    core, taken, _ = run(merge, on_the_wire=True)
    assert groups and max(groups) >= 2
    twin, _, _ = run(merge, on_the_wire=False)
    assert len(core.rounds) == len(twin.rounds) >= 3
    assert torch.equal(core.theta["w0"], twin.theta["w0"])
    for a, b in zip(core.fragments.values(), twin.fragments.values()):
        assert all(torch.equal(x, y) for x, y in zip(a.optimizer.tensors(), b.optimizer.tensors()))
    assert all(not push.deltas.decoded for push in taken[1:])


def test_a_push_that_is_not_finite_is_refused_alone_in_the_decodes_words():
    core, _, actions = run("rda", on_the_wire=True, nan_learner=2)
    twin, _, _ = run("rda", on_the_wire=False, nan_learner=2)
    reasons = [a.reason for a in actions if isinstance(a, PushRefused)]
    assert len(reasons) == 1 and "NaN or Inf" in reasons[0] and "\n" not in reasons[0]
    assert torch.isfinite(core.theta["w0"]).all() and torch.equal(core.theta["w0"], twin.theta["w0"])
