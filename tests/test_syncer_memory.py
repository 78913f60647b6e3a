"""The syncer's memory does not grow with its learners, and what learners hold stays exact meanwhile.

Memory is measured by walking everything the core references (tensors by storage, byte strings), not
by the core's own accounting, which is checked against it. Of its recycled buffers (`core/scratch.py`), those
that something else holds are that holder's: an answer's, or the core's through its own reference.
"""

import dataclasses
import gc
import time
import weakref

import numpy as np
import pytest
import torch

from conftest import tiny_config
from diloco.codecs import get_codec
from diloco.core import Push, SyncerCore
from diloco.core import downlink as downlink_module
from diloco.core.downlink import CHAIN_SHARE
from diloco.core.scratch import Scratch
from diloco.fragments import Fragment
from diloco.outer import Nesterov
from diloco.client.learner_client import Learner
from diloco.shard.serving import serve
from diloco.shard.ownership import ShardPlan
from diloco.shard.server import SyncerShard

SIZE = 1 << 16
NAMES = ("a", "b", "c", "d")


def reachable_bytes(root) -> int:
    """Bytes of every tensor storage, array and byte string reachable from `root`, each counted once."""
    seen, storages, arrays, total = set(), set(), set(), 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (int, float, str, bool, type(None), type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, Scratch):  # tensors it keeps that others hold are theirs
            stack.extend(obj.free())
        elif isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, (bytes, bytearray)):
            total += len(obj)
        elif isinstance(obj, memoryview):  # an encoded payload's read-only view of the array it was coded into
            stack.append(obj.obj)
        elif isinstance(obj, np.ndarray):
            base = obj if obj.base is None else obj.base
            if id(base) not in arrays:
                arrays.add(id(base))
                total += base.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total


def core_with(learners: int, down: str, rule: str) -> SyncerCore:
    torch.manual_seed(0)
    theta = {n: torch.randn(SIZE) for n in NAMES}
    fragments = [Fragment(0, ("a", "b"), 2 * SIZE, False), Fragment(1, ("c", "d"), 2 * SIZE, False)]
    return SyncerCore(theta, fragments, range(learners), optimizer=lambda: Nesterov(0.7, 0.9), merge_rule=rule,
                      quorum=1, down_codec=get_codec(down), outlier="clip")


def run_rounds(core: SyncerCore, learners: int, rounds: int, keep: bool = True) -> list:
    """Every learner pushes every fragment `rounds` times, each based on the version it was answered. Its
    answers are returned, all held until then (`keep`), or dropped as they come, as sent ones are."""
    updates, now, seq = [], 0.0, dict.fromkeys(range(learners), 0)
    for _ in range(rounds):
        for m in range(learners):
            for fragment in core.fragments.values():
                now += 0.01
                seq[m] += 1
                deltas = {n: torch.randn(SIZE) * 1e-3 for n in fragment.fragment.names}
                push = Push(m, fragment.fragment.index, core.held_versions[m][fragment.fragment.index], seq[m],
                            deltas, tokens=64, steps=1, step=seq[m])
                for action in core.on_push(push, now):
                    updates.extend(getattr(action, "updates", {}).values() if keep else ())
    return updates


@pytest.mark.parametrize("down", ["fp32", "int4"])
@pytest.mark.parametrize("rule", ["weighted", "rda"])
def test_syncer_memory_with_sixteen_learners_is_within_a_fifth_of_one(down, rule):
    memory = {}
    for learners in (1, 16):
        core = core_with(learners, down, rule)
        answers = run_rounds(core, learners, rounds=4)  # in flight: what they hold is theirs, not the core's
        assert all(s.version >= 4 for s in core.fragments.values())
        memory[learners] = reachable_bytes(core)
        accounted = core.memory()
        assert accounted["total_bytes"] <= memory[learners]  # its own accounting misses nothing large
        assert memory[learners] - accounted["total_bytes"] < 0.05 * accounted["theta_bytes"]
        fp32 = accounted["theta_bytes"]
        if down == "fp32":
            assert accounted["downlink_bytes"] == 0
        else:  # published once, plus at most CHAIN_SHARE of the fragments' size in differences
            assert accounted["downlink_bytes"] <= fp32 * (1 + CHAIN_SHARE) * 1.01
        del answers
    assert memory[16] <= 1.2 * memory[1], memory


def test_an_open_round_holds_one_sum_whatever_the_number_of_pushes_in_it():
    core = core_with(17, "fp32", "rda")
    core.quorum = 17  # 16 of 17 push: nothing closes, every push stays in the open round
    run_rounds(core, 16, rounds=1)
    sums = core.fragments[0].sums
    assert len(core.fragments[0].pending) == 16
    assert sums.nbytes() == 2 * 2 * SIZE * 4  # Σ w·Δ and Σ w·Δ/‖Δ‖ of one fragment, fp32


def test_answers_of_one_round_share_one_encoding():
    core = core_with(4, "fp32", "weighted")
    core.quorum = 4
    updates = run_rounds(core, 4, rounds=1)
    by_fragment = {}
    for update in updates:
        by_fragment.setdefault(update.fragment, set()).add(id(update.wire[0]))
    assert by_fragment and all(len(ids) == 1 for ids in by_fragment.values())


def test_a_learner_behind_gets_the_differences_it_lacks_or_the_values_whole():
    core = core_with(2, "int4", "weighted")
    seq = {0: 0, 1: 0}

    def push_from(m, now):
        seq[m] += 1
        push = Push(m, 0, core.held_versions[m][0], seq[m], {n: torch.full((SIZE,), 1e-3) for n in ("a", "b")},
                    tokens=64, steps=1, step=seq[m])
        return [u for a in core.on_push(push, now) for u in getattr(a, "updates", {}).values()]

    for k in range(2):  # learner 0 alone moves fragment 0 two versions ahead of learner 1
        (update,) = push_from(0, 1.0 + k)
        assert update.relative and len(update.wire) == 1
    (behind,) = push_from(1, 5.0)
    assert behind.relative and len(behind.wire) == 3  # versions 1..3, each a difference, in order
    assert torch.equal(behind.values["a"], core.held_values(1, 0)["a"])
    for k in range(40):  # far ahead: the differences would weigh more than the values
        push_from(0, 6.0 + k)
    (whole,) = push_from(1, 50.0)
    assert not whole.relative and len(whole.wire) == 1
    assert whole.payload_bytes > behind.payload_bytes


# ---------------------------------------------------------------- over the real transport, across a crash


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))


def train(learners, optimizers, steps):
    for _ in range(steps):
        for learner, opt in zip(learners, optimizers):
            loss = learner.model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            learner.step(tokens=8)


def settle(learners, timeout_s=20.0):
    """Wait for the answers to every push in flight, then merge them at one more step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(len(lr.link.arrivals) >= sum(f.update is None for f in lr.core.in_flight.values()) for lr in learners):
            break
        time.sleep(0.05)
    for learner in learners:
        learner.step(tokens=0)


def anchors_checked(shard, learners) -> int:
    checked = 0
    for m, learner in enumerate(learners):
        for p, fragment in enumerate(learner.fragments):
            held = shard.core.held_values(m, p)
            if learner.core.anchor_versions[p] == shard.core.held_versions[m][p] and held is not None:
                for name in fragment.names:
                    assert torch.equal(learner.core.anchors[p][name], held[name]), (m, p, name)
                checked += 1
    return checked


@pytest.mark.integration  # a live shard over real gRPC, killed and resumed
@pytest.mark.parametrize("down", ["fp32", "int4"])
def test_anchors_match_bit_for_bit_over_the_wire_and_across_a_shard_crash(tmp_path, down):
    config = tiny_config("learners.count=2", "outer.fragments=2", "outer.H=2", "outer.tau=1", f"codec.down={down}",
                         "strategy=async")
    first = SyncerShard(config, ShardPlan(0, 1, ("",)), state_dir=tmp_path)
    server, port = serve(first, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    first.plan = ShardPlan(0, 1, (address,))
    learners = [Learner(tiny_model(), syncer=address, learner=m) for m in range(2)]
    optimizers = [torch.optim.SGD(lr.model.parameters(), lr=0.05) for lr in learners]
    second = None
    try:
        train(learners, optimizers, 8)
        settle(learners)
        before = anchors_checked(first, learners)
        rounds = first.core.rounds_closed
        first.stop()
        server.stop(0)  # the shard dies; what it took is in its state and journal
        second = SyncerShard(config, ShardPlan(0, 1, (address,)), state_dir=tmp_path, resume=True)
        server, _ = serve(second, address)
        assert second.core.rounds_closed == rounds
        train(learners, optimizers, 8)
        settle(learners)
        assert second.core.rounds_closed > rounds
        after = anchors_checked(second, learners)
        assert before >= 1 and after >= 1  # the learner answered last holds the current version
        if down != "fp32":  # the answers were differences, as the downlink intends
            assert any(s.downlink.steps for s in second.core.fragments.values())
    finally:
        for learner in learners:
            learner.close()
        (second or first).stop()
        server.stop(0)


@pytest.mark.integration  # a live shard over real gRPC
def test_an_update_stream_waiting_for_its_next_answer_keeps_nothing_of_the_last_alive(monkeypatch):
    """A whole answer is a fragment in fp32: an idle stream that kept its last one would hold a copy per
    learner, the growth with learners that the shard's memory must not have."""
    made: list[weakref.ref] = []  # every whole answer encoded (a dict: referenced weakly, not hashed)

    class TrackedMessage(downlink_module.Message):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    def alive() -> int:
        gc.collect()
        return sum(ref() is not None for ref in made)

    monkeypatch.setattr(downlink_module, "Message", TrackedMessage)
    config = tiny_config("learners.count=2", "outer.fragments=2", "outer.H=2", "outer.tau=1", "codec.down=fp32",
                         "strategy=async")
    shard = SyncerShard(config, ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0")
    learners = [Learner(tiny_model(), syncer=f"127.0.0.1:{port}", learner=m) for m in range(2)]
    optimizers = [torch.optim.SGD(lr.model.parameters(), lr=0.05) for lr in learners]
    try:
        train(learners, optimizers, 6)
        settle(learners)
        assert len(made) >= 2  # answers were made and sent
        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:  # the last frames may still be on their way
            time.sleep(0.05)
        assert alive() == 0, f"{alive()} of {len(made)} whole answers still held after they were sent"
    finally:
        for learner in learners:
            learner.close()
        shard.stop()
        server.stop(0)


@pytest.mark.parametrize("down", ["fp32", "int4"])
def test_what_an_answer_holds_stays_as_it_was_sent_while_later_rounds_recycle_their_buffers(down):
    """Rounds take their fragment-sized tensors again once nobody holds them (`core/scratch.py`), the lossy
    downlink's published copy included: the values and the wire of an answer still held are never written,
    and a round once warm makes no new tensor, though all four of the core's tensors share one shape (as a
    model's layers do)."""
    core = core_with(2, down, "rda")
    assert len({t.shape for t in core.merging.theta.values()}) == 1
    held = run_rounds(core, 2, rounds=2)[-1]
    values = {n: v.clone() for n, v in held.values.items()}
    wire = {n: bytes(e.payload) for n, e in held.wire[0].items()}
    run_rounds(core, 2, rounds=2, keep=False)
    kept, made = sum(len(k) for k in core.merging.scratch.kept.values()), core.merging.scratch.made
    run_rounds(core, 2, rounds=6, keep=False)
    assert all(torch.equal(held.values[n], v) for n, v in values.items())
    assert all(bytes(held.wire[0][n].payload) == w for n, w in wire.items())
    assert sum(len(k) for k in core.merging.scratch.kept.values()) <= kept
    assert core.merging.scratch.made == made
