"""Group commit (`events.PushesArrived`): pushes taken as one group close their rounds together, and what a
group must keep: every push merged once, a refused push in a group changes nothing (the others' merge is
as if it had never come), and a group is the same state whichever core takes it (journal replay)."""

from __future__ import annotations

import pytest
import torch

from diloco.codecs import Encoded
from diloco.config import load_config
from diloco.core.actions import Publish, PushRefused
from diloco.core.events import PushArrived, PushesArrived
from diloco.core.messages import Push
from diloco.core.syncer_core import SyncerCore
from diloco.fragments import Fragment
from diloco.strategies import build_strategy
from diloco.shard.journal import Journal
from core_state import frozen, same
from shard_on_disk import SeededShard, _no_shard_left, tiny_model  # noqa: F401 (an autouse fixture)

LEARNERS = 8
NUMEL = 64


def make_core() -> SyncerCore:
    """A core built as the drivers build it: the default config (decoupled, paced), quorum 1."""
    spec = build_strategy(load_config(overrides=[f"learners.count={LEARNERS}", "learners.speeds=[]"]))
    fragments = [Fragment(p, (f"w{p}",), NUMEL, False) for p in range(spec.fragments)]
    params = {f"w{p}": torch.randn(NUMEL, generator=torch.Generator().manual_seed(p)) for p in range(spec.fragments)}
    core = spec.syncer_core(params, fragments, range(LEARNERS), embeddings=())
    for m in range(LEARNERS):
        core.declare(m, 64)
        core.rejoin_state(m, after_seq=0)
    return core


def push(learner: int, seq: int, fragment: int = 0, scale: float = 1e-3, value: float | None = None) -> Push:
    delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * learner + seq)) * scale
    if value is not None:
        delta[3] = value
    return Push(learner, fragment, 0, seq, {f"w{fragment}": delta}, 4 * 64, 4, step_time_s=0.01, sent_at=0.0,
                step=4 * seq)


def warm(core: SyncerCore) -> None:
    """Every learner's first push, one at a time: weights known, so later pushes are judged at once."""
    for m in range(LEARNERS):
        core.handle(PushArrived(push(m, 1, fragment=1)), 0.01 * (m + 1))


def test_a_group_closes_one_round_with_every_push_merged_once():
    core = make_core()
    warm(core)
    before = len(core.rounds)
    actions = core.handle(PushesArrived(tuple(push(m, 2) for m in range(LEARNERS))), 1.0)
    published = [a for a in actions if isinstance(a, Publish)]
    assert [a.fragment for a in published] == [0]
    (record,) = core.rounds[before:]
    assert sorted(record.participants) == list(range(LEARNERS))
    assert record.tokens == LEARNERS * 4 * 64
    assert all(core.ledger[m].pushes == 2 and core.ledger[m].last_seq == 2 for m in range(LEARNERS))
    again = core.handle(PushesArrived(tuple(push(m, 2) for m in range(LEARNERS))), 1.1)  # retries: counted once
    assert not [a for a in again if isinstance(a, Publish)] and len(core.rounds) == before + 1
    assert all(core.ledger[m].duplicates == 1 for m in range(LEARNERS))


def test_a_refused_push_in_a_group_changes_nothing_and_the_others_merge_as_without_it():
    core, twin = make_core(), make_core()
    warm(core)
    warm(twin)
    good = [push(m, 2) for m in range(LEARNERS) if m != 3]
    bad = push(3, 2, value=float("nan"))
    actions = core.handle(PushesArrived((*good[:3], bad, *good[3:])), 1.0)
    (refusal,) = [a for a in actions if isinstance(a, PushRefused)]
    assert (refusal.learner, refusal.fragment, refusal.seq) == (3, 0, 2)
    assert "not finite" in refusal.reason and "\n" not in refusal.reason
    twin.handle(PushesArrived(tuple(good)), 1.0)
    assert same(frozen(core), frozen(twin))
    assert torch.isfinite(core.theta["w0"]).all()
    assert 3 not in core.rounds[-1].participants


def test_a_group_gives_the_same_state_in_every_core_that_takes_it():
    """What journal replay relies on: the group is the unit, so a core fed the same groups ends the same."""
    cores = [make_core(), make_core()]
    for core in cores:
        warm(core)
        core.handle(PushesArrived(tuple(push(m, 2, fragment=m % 2) for m in range(LEARNERS))), 1.0)
        core.handle(PushesArrived((push(0, 3), push(1, 3, value=float("inf")), push(2, 3))), 2.0)
    assert same(frozen(cores[0]), frozen(cores[1]))


def test_a_group_of_one_is_the_push_alone():
    one, alone = make_core(), make_core()
    warm(one)
    warm(alone)
    one.handle(PushesArrived((push(5, 2),)), 1.0)
    alone.handle(PushArrived(push(5, 2)), 1.0)
    assert same(frozen(one), frozen(alone))


@pytest.mark.integration
def test_journal_replay_of_a_grouped_round_gives_the_identical_state(tmp_path):
    """A group journaled as one record, one of its pushes refused: a shard resumed from the journal holds
    exactly what the live shard held (Θ, rounds, optimizer, ledger), the refused push taken by neither."""
    from diloco.shard.group_commit import QueuedPush, take_group
    from diloco.transport.wire_messages import DecodedOnUse, push_of, push_payload

    seeded = SeededShard(tmp_path)
    shard = seeded.shard
    messages = [seeded.push_message(1), seeded.push_message(2, base_version=99), seeded.push_message(3)]
    group = [QueuedPush(push_of(h, t, DecodedOnUse(t)), push_payload(h, t)) for h, t in messages]
    with shard.lock:
        rounds = len(shard.core.rounds)
        take_group(shard, group, shard.clock.now())
        assert [q.outcome for q in group] == ["taken", "refused", "taken"]
        assert len(shard.core.rounds) == rounds + 1 and shard.core.ledger[0].pushes == 2
        live = frozen(shard.core)
    kinds = [r.kind for r in Journal.scan(tmp_path / "shard-0.journal").records]
    assert "PushesArrived" in kinds
    seeded.assert_resumes_as(tmp_path, live)


@pytest.mark.integration
def test_a_group_with_a_push_that_does_not_decode_is_replayed_from_the_journal(tmp_path):
    """A push whose values are not finite is refused when the core reads it, inside its group, and the group
    is journaled whole: replay must read it the same way (refused again), not fail to read the journal."""
    from diloco.shard.group_commit import QueuedPush, take_group
    from diloco.transport.wire_messages import DecodedOnUse, push_of, push_payload

    seeded = SeededShard(tmp_path)
    shard = seeded.shard
    messages = [seeded.push_message(1), seeded.push_message(2), seeded.push_message(3)]
    header, tensors = messages[1]
    name = next(iter(tensors))
    nan = Encoded("fp32", tensors[name].shape, 0, torch.full(tensors[name].shape, float("nan")).numpy().tobytes())
    messages[1] = header, {**tensors, name: nan}  # as a learner that does not check would send it
    group = [QueuedPush(push_of(h, t, DecodedOnUse(t)), push_payload(h, t)) for h, t in messages]
    with shard.lock:
        take_group(shard, group, shard.clock.now())
        assert [q.outcome for q in group] == ["taken", "refused", "taken"]
        live = frozen(shard.core)
    seeded.assert_resumes_as(tmp_path, live)


@pytest.mark.integration
def test_a_join_pulls_every_fragment_and_hands_each_to_take_on_the_calling_thread(tmp_path):
    """Parallel pulls: with `take`, each fragment's Θ goes to take(fragment, values) on the joining thread,
    exactly the shard's values, and Joined.theta stays empty; the pull's time is reported."""
    import threading

    from diloco.client.joining import join_run
    from diloco.fragments import partition

    seeded = SeededShard(tmp_path)
    model = tiny_model()
    params = dict(model.named_parameters())
    got, threads = {}, set()

    def take(fragment: int, values: dict[str, torch.Tensor]) -> None:
        threads.add(threading.get_ident())
        got[fragment] = values

    joined = join_run(seeded.address, 0, 30.0, "test", params, lambda count: partition(model, count, set()),
                      None, take=take)
    try:
        assert threads == {threading.get_ident()} and joined.theta == {}
        assert sorted(got) == sorted(seeded.shard.core.fragments) and joined.pull_s > 0
        for values in got.values():
            for name, value in values.items():
                assert torch.equal(value, seeded.shard.core.theta[name])
    finally:
        for shard in joined.shards:
            shard.client.leave(joined.learner)
            shard.client.close()



def test_a_group_that_ends_in_an_error_leaves_the_rounds_free_to_close():
    """Rounds wait while a group is taken in, and only then: a group cut short by an exception (nothing a
    push can cause: pushes are refused one by one) does not leave every later round waiting."""
    core = make_core()
    warm(core)
    with pytest.raises(RuntimeError):
        with core.merging.grouped():
            raise RuntimeError("cut short")
    actions = core.handle(PushArrived(push(0, 2)), 1.1)
    assert [a.fragment for a in actions if isinstance(a, Publish)] == [0]


DEFECTS = ("none", "none", "not finite", "code no encoder writes", "base version ahead", "a retry", "huge")


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_mix_of_groups_replays_from_the_journal_to_the_live_state(tmp_path, monkeypatch, seed):
    """Groups of one to four pushes in fp32, int4 and int8 (taken from their codes too), some of them bad
    in a way only the core sees: whatever the live shard took, refused or clipped, a shard resumed from its
    journal holds the same state bit for bit."""
    import random

    import diloco.codecs.compiled as compiled
    from diloco.codecs import get_codec
    from diloco.shard.group_commit import QueuedPush, take_group
    from diloco.transport.frames import tensor_header
    from diloco.transport.wire_messages import push_of, push_payload
    from diloco.v1 import diloco_pb2 as pb

    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)
    rng = random.Random(seed)
    seeded = SeededShard(tmp_path)
    shard = seeded.shard
    outcomes, seq = [], 0

    def message(defect: str):
        nonlocal seq
        seq += defect != "a retry" or seq == 0
        codec = get_codec(rng.choice(["fp32", "int4", "int8"]))
        scale = 1e4 if defect == "huge" else 1e-2
        tensors = {n: codec.encode(torch.randn(t.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
                                   * scale) for n, t in shard.core.theta.items()}
        name = next(iter(tensors))
        e = tensors[name]
        if defect == "not finite":
            nan = torch.full(e.shape, float("nan")).numpy().tobytes()
            tensors[name] = Encoded("fp32", e.shape, 0, nan) if e.codec == "fp32" else \
                Encoded(e.codec, e.shape, e.block, e.payload, nan[:len(e.scales)])
        elif defect == "code no encoder writes" and e.codec != "fp32":
            tensors[name] = Encoded(e.codec, e.shape, e.block, b"\x88" + bytes(e.payload)[1:], e.scales)
        version = shard.core.version(0) + (5 if defect == "base version ahead" else 0)
        header = pb.PushHeader(learner=0, fragment=0, base_version=version, seq=seq, tokens=8, steps=1, step=seq,
                               step_time_s=0.1, tensors=[tensor_header(n, x) for n, x in tensors.items()])
        return QueuedPush(push_of(header, tensors), push_payload(header, tensors))

    with shard.lock:
        for _ in range(10):
            group = [message(rng.choice(DEFECTS)) for _ in range(rng.randint(1, 4))]
            take_group(shard, group, shard.clock.now())
            outcomes += [q.outcome for q in group]
        live = frozen(shard.core)
    assert "taken" in outcomes and "refused" in outcomes
    seeded.assert_resumes_as(tmp_path, live)
