"""Pushes folded from their codes (`codecs/coded_blocks.py`): a shard with the compiled loops measures,
samples and folds a block-coded push without decoding it. What must hold: the fold is the decoded fold bit
for bit, the norm is the decoded values' norm to within their fp32 rounding, a corrupt push is refused in the decode's
words before any sum is written, and a core fed coded pushes ends where one fed decoded pushes does."""

from __future__ import annotations

import math

import pytest
import torch

import diloco.codecs.compiled as compiled
import diloco.codecs.compiled_sums as compiled_sums
from diloco.cache_chunks import add_scaled
from diloco.codecs import Encoded, get_codec
from diloco.codecs.coded_blocks import coded_blocks, fold_together
from diloco.config import load_config
from diloco.core.events import PushArrived, PushesArrived
from diloco.core.messages import Push
from diloco.core.refusals import ProtocolError
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.outer.merge import tensor_norm
from diloco.strategies import build_strategy
from diloco.transport.wire_messages import DecodedOnUse
from core_state import refused

pytestmark = pytest.mark.skipif(not compiled_sums.folds_like_torch(), reason="numba is not installed here")

NUMEL = compiled.MIN_ELEMENTS + 4_099  # large enough for the loops; odd, and not a multiple of a block
CODECS = [("int4", 64), ("int4", 6), ("int8", 64), ("int8", 7), ("fp4", 32)]


def values(seed: int, numel: int = NUMEL, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


def coded_and_decoded(name: str, block: int, seed: int = 0, numel: int = NUMEL):
    codec = get_codec(name, block)
    encoded = codec.encode(values(seed, numel))
    coded = coded_blocks(codec, encoded)
    assert coded is not None
    return coded, codec.decode(encoded).reshape(-1), encoded


@pytest.mark.parametrize("name,block", CODECS)
def test_folding_from_codes_is_decoding_then_adding_bit_for_bit(name, block):
    coded, decoded, _ = coded_and_decoded(name, block)
    alphas = [0.7310585786, 1.0, 3.3e-3]
    totals = [None, values(1), values(2)]
    expected = add_scaled([torch.empty(NUMEL) for _ in totals], totals, decoded, alphas)
    got = coded.add_scaled([torch.empty(NUMEL) for _ in totals], totals, alphas)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    in_place = values(1)  # into the sum itself, as a round's later pushes are folded
    coded.add_scaled([in_place], [in_place], [alphas[0]])
    assert torch.equal(in_place, add_scaled([torch.empty(NUMEL)], [values(1)], decoded, [alphas[0]])[0])


@pytest.mark.parametrize("name,block", CODECS)
def test_the_norm_from_codes_is_the_decoded_values_norm_and_the_sample_is_exact(name, block):
    """Summed in float64 from the codes, the norm is within the values' fp32 rounding of their own norm;
    `tensor_norm` sums in fp32 and is within its summation error of it (about 1e-6 relative here)."""
    coded, decoded, _ = coded_and_decoded(name, block, seed=3)
    exact = math.sqrt(float((decoded.double() ** 2).sum()))
    assert math.isclose(coded.norm(), exact, rel_tol=2e-7)
    assert math.isclose(coded.norm(), tensor_norm(decoded), rel_tol=1e-5)
    index = torch.arange(5, NUMEL, 997)
    assert torch.equal(coded.sample(index), decoded[index].double())


def test_a_norm_beyond_fp32_is_taken_in_float64_as_the_decoded_norm_is():
    codec = get_codec("int8", 64)
    encoded = codec.encode(values(4, scale=1e36))
    coded = coded_blocks(codec, encoded)
    assert math.isinf(float(torch.linalg.vector_norm(codec.decode(encoded)))) and math.isfinite(coded.norm())
    assert math.isclose(coded.norm(), tensor_norm(codec.decode(encoded)), rel_tol=2e-7)


def test_a_code_no_encoder_writes_is_refused_in_the_decodes_words_and_no_sum_is_written():
    codec = get_codec("int4", 64)
    encoded = codec.encode(values(5))
    payload = bytearray(encoded.payload)
    payload[1000] = 0x88  # -8 in both nibbles: a code int4 never writes
    bad = Encoded(encoded.codec, encoded.shape, encoded.block, bytes(payload), encoded.scales)
    with pytest.raises(DilocoError) as decoding:
        codec.decode(bad)
    coded = coded_blocks(codec, bad)
    total = values(6)
    before = total.clone()
    with pytest.raises(DilocoError) as folding:
        coded.add_scaled([total], [total], [0.5])
    assert str(folding.value) == str(decoding.value) and torch.equal(total, before)


@pytest.mark.parametrize("damage,words", [
    (lambda e: Encoded(e.codec, e.shape, e.block, e.payload[:-1], e.scales), "payload has"),
    (lambda e: Encoded(e.codec, e.shape, e.block, e.payload, torch.full((len(e.scales) // 4,), -1.0).numpy().tobytes()),
     "negative"),
    (lambda e: Encoded(e.codec, e.shape, e.block, e.payload,
                       torch.full((len(e.scales) // 4,), float("nan")).numpy().tobytes()), "NaN or Inf"),
    (lambda e: Encoded(e.codec, e.shape, e.block, e.payload,
                       e.scales[:-4] + torch.tensor([math.inf]).numpy().tobytes()),
     "NaN or Inf"),
    (lambda e: Encoded(e.codec, e.shape, e.block, e.payload, torch.tensor([-0.0, -1e-30]).numpy().tobytes()
                       + e.scales[8:]), "negative"),
])
def test_bytes_that_do_not_fit_are_refused_as_a_push_in_one_line(damage, words):
    encoded = damage(get_codec("int4", 64).encode(values(7)))
    deltas = DecodedOnUse({"w": encoded})
    message = refused(lambda: deltas.coded("w"))
    assert message.startswith("bad push: ") and words in message


def test_small_tensors_other_codecs_and_hosts_without_the_loops_decode_as_before():
    assert coded_blocks(get_codec("int4", 64), get_codec("int4", 64).encode(values(8, 1000))) is None
    assert DecodedOnUse({"w": get_codec("bf16").encode(values(8))}).coded("w") is None
    assert coded_blocks(get_codec("int4", 7), get_codec("int4", 7).encode(values(8))) is None  # odd block
    compiled.set_enabled(False)
    try:
        assert DecodedOnUse({"w": get_codec("int4", 64).encode(values(8))}).coded("w") is None
    finally:
        compiled.set_enabled(True)


# ------------------------------------------------------------ a core fed coded pushes

LEARNERS = 4


def make_core(merge: str):
    spec = build_strategy(load_config(overrides=[f"learners.count={LEARNERS}", "learners.speeds=[]",
                                                 f"outer.merge={merge}", "outer.quorum=1"]))
    fragments = [Fragment(p, (f"w{p}",), NUMEL, False) for p in range(spec.fragments)]
    params = {f"w{p}": values(50 + p) for p in range(spec.fragments)}
    core = spec.syncer_core(params, fragments, range(LEARNERS), embeddings=())
    for m in range(LEARNERS):
        core.declare(m, 64)
        core.rejoin_state(m, after_seq=0)
    return core


def pushes(seq: int, coded: bool, decoded_learner: int | None = None) -> list[Push]:
    codec = get_codec("int4", 64)
    out = []
    for m in range(LEARNERS):
        encoded = codec.encode(values(100 * m + seq, scale=1e-3))
        deltas = DecodedOnUse({"w0": encoded}) if coded and m != decoded_learner else {"w0": codec.decode(encoded)}
        out.append(Push(m, 0, 0 if seq == 1 else seq - 1, seq, deltas, 4 * 64, 4, step_time_s=0.01, sent_at=0.0,
                        step=4 * seq))
    return out


def run(merge: str, coded: bool, decoded_learner: int | None = None):
    core = make_core(merge)
    taken = []
    for seq in range(1, 4):
        group = pushes(seq, coded, decoded_learner)
        core.handle(PushArrived(group[0]), seq * 1.0)
        core.handle(PushesArrived(tuple(group[1:])), seq * 1.0 + 0.5)
        taken += group
    return core, taken


def test_a_core_fed_coded_pushes_merges_as_one_fed_decoded_pushes():
    """The weighted merge reads no norm: Θ the same bit for bit, and no push was ever decoded. The radial
    one scales each direction by its norm, taken from the codes in float64: Θ the same to fp32 rounding."""
    core, taken = run("weighted", coded=True)
    twin, _ = run("weighted", coded=False)
    assert len(core.rounds) == len(twin.rounds) >= 3
    assert torch.equal(core.theta["w0"], twin.theta["w0"])
    assert all(not push.deltas.decoded for push in taken[1:])  # the run's first, unjudged push is kept whole
    radial, _ = run("rda", coded=True)
    radial_twin, _ = run("rda", coded=False)
    assert float((radial.theta["w0"] - radial_twin.theta["w0"]).abs().max()) <= 1e-6  # a few ulps of |Θ| ~ 1


@pytest.mark.parametrize("decoded_learner", [None, 3])
def test_a_group_of_coded_pushes_folded_together_merges_as_folded_as_each_is_taken(monkeypatch, decoded_learner):
    """A group's coded pushes wait and are folded together as it ends, each sum read and written once for
    the group (`coded_blocks.fold_together`): every round's Θ and outer optimizer the same bit for bit as
    folding each push as it is taken; also where a decoded push at the group's end must be folded after
    those waiting before it (`decoded_learner`)."""
    import diloco.core.merging as merging
    import diloco.core.sum_writes as sum_writes

    taken_together = []

    def spy(pushes, *args):
        done = fold_together(pushes, *args)
        taken_together.append((len(pushes), done))
        return done

    monkeypatch.setattr(sum_writes, "fold_together", spy)
    together, _ = run("rda", coded=True, decoded_learner=decoded_learner)
    assert taken_together and all(done for _, done in taken_together) and max(n for n, _ in taken_together) >= 2
    monkeypatch.setattr(sum_writes, "fold_together", lambda *args: False)
    monkeypatch.setattr(merging, "coded_of", lambda *args: None)  # nothing waits: each folded as it is taken
    as_taken, _ = run("rda", coded=True, decoded_learner=decoded_learner)
    assert len(together.rounds) == len(as_taken.rounds) >= 3
    assert torch.equal(together.theta["w0"], as_taken.theta["w0"])
    for a, b in zip(together.fragments.values(), as_taken.fragments.values()):
        assert all(torch.equal(x, y) for x, y in zip(a.optimizer.tensors(), b.optimizer.tensors()))


@pytest.mark.parametrize("merge", ["rda", "weighted"])
def test_a_core_refuses_a_corrupt_coded_push_in_one_line_and_keeps_the_others(merge):
    """Whether its adds are made as it is taken or wait for its group's end, a push with a bad code is
    refused alone, in one line, before anything of it is folded."""
    core = make_core(merge)
    good = pushes(1, coded=True)
    encoded = good[2].deltas.tensors["w0"]
    payload = bytearray(encoded.payload)
    payload[10] = 0x88
    bad = Encoded(encoded.codec, encoded.shape, encoded.block, bytes(payload), encoded.scales)
    good[2] = Push(2, 0, 0, 1, DecodedOnUse({"w0": bad}), 4 * 64, 4, step_time_s=0.01, sent_at=0.0, step=4)
    actions = core.handle(PushesArrived(tuple(good)), 1.0)
    reasons = [a.reason for a in actions if type(a).__name__ == "PushRefused"]
    assert len(reasons) == 1 and "code no encoder writes" in reasons[0] and "\n" not in reasons[0]
    assert torch.isfinite(core.theta["w0"]).all() and 2 not in core.rounds[-1].participants
    with pytest.raises(ProtocolError):
        DecodedOnUse({"w0": bad})["w0"]


@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 129, 4097])
@pytest.mark.parametrize("name,block", [("int4", 64), ("int4", 2), ("int8", 1), ("fp4", 64)])
def test_any_size_folds_samples_and_measures_as_decoded(numel, name, block, monkeypatch):
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)
    coded, decoded, _ = coded_and_decoded(name, block, seed=numel, numel=numel)
    total = values(9, numel)
    assert torch.equal(coded.add_scaled([torch.empty(numel)], [total], [0.25])[0],
                       add_scaled([torch.empty(numel)], [total], decoded, [0.25])[0])
    assert math.isclose(coded.norm(), math.sqrt(float((decoded.double() ** 2).sum())), rel_tol=2e-7, abs_tol=1e-30)
    assert torch.equal(coded.sample(torch.arange(numel)), decoded.double())


@pytest.mark.integration
def test_a_shard_resumed_from_its_journal_replays_coded_pushes_as_it_took_them(tmp_path, monkeypatch):
    """The live shard took int4 pushes from their codes (radial merge: norms from the codes); its journal's
    replay must take them the same way, or the resumed Θ would differ from the one learners were sent."""
    from diloco.shard.group_commit import QueuedPush, take_group
    from diloco.transport.frames import tensor_header
    from diloco.transport.wire_messages import push_of, push_payload
    from diloco.v1 import diloco_pb2 as pb
    from core_state import frozen
    from shard_on_disk import SeededShard, _no_shard_left  # noqa: F401 (an autouse fixture)

    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)  # the tiny model's tensors take the coded path too
    seeded = SeededShard(tmp_path)
    shard = seeded.shard
    codec = get_codec("int4", 64)

    def message(seq: int):
        encoded = {n: codec.encode(torch.randn(t.shape, generator=torch.Generator().manual_seed(seq)) * 1e-2)
                   for n, t in shard.core.theta.items()}
        header = pb.PushHeader(learner=0, fragment=0, base_version=shard.core.version(0), seq=seq, tokens=8, steps=1,
                               step=seq, step_time_s=0.1, tensors=[tensor_header(n, e) for n, e in encoded.items()])
        return header, encoded

    def corrupt(header, tensors):  # a code no encoder writes: refused in the group, journaled with it
        name = next(iter(tensors))
        e = tensors[name]
        bad = Encoded(e.codec, e.shape, e.block, b"\x88" + bytes(e.payload)[1:], e.scales)
        return header, {**tensors, name: bad}

    with shard.lock:
        for seq in (1, 2, 3):
            header, tensors = message(seq)
            push = push_of(header, tensors)
            assert any(push.deltas.coded(n) is not None for n in tensors)
            item = QueuedPush(push, push_payload(header, tensors))
            take_group(shard, [item], shard.clock.now())
            assert item.outcome == "taken"
        group = [message(4), corrupt(*message(5)), message(6)]
        group[1][0].seq, group[2][0].seq = 5, 6
        items = [QueuedPush(push_of(h, t), push_payload(h, t)) for h, t in group]
        take_group(shard, items, shard.clock.now())
        assert [q.outcome for q in items] == ["taken", "refused", "taken"]
        assert "code no encoder writes" in items[1].why
        live = frozen(shard.core)
    seeded.assert_resumes_as(tmp_path, live)
