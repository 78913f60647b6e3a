"""The protocol against a live syncer shard in this process: framing, exactly-once, refusals."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from conftest import tiny_config, wait_for
from diloco.codecs import Encoded, get_codec
from diloco.errors import DilocoError
from diloco.client.learner_client import Learner
from diloco.shard.server import ShardPlan, SyncerShard, serve
from diloco.transport.calls import ShardClient
from diloco.transport.frames import (FRAME_BYTES, FrameError, decode, encode_fp32, message_frames, read_message,
                                     read_values, tensor_header)
from diloco.v1 import diloco_pb2 as pb


def state_frames(values):
    encoded = encode_fp32(values)
    header = pb.Frame(state=pb.StateHeader(tensors=[tensor_header(n, e) for n, e in encoded.items()]))
    return list(message_frames(header, encoded))


def test_frames_round_trip_large_tensors_exactly():
    values = {"big": torch.randn(FRAME_BYTES // 4 * 2 + 7), "small": torch.randn(3, 5)}
    frames = state_frames(values)
    assert len(frames) == 1 + 3  # header, then data cut at FRAME_BYTES
    _, tensors = read_message(iter(frames), "state", limit=1 << 30)
    for name, value in values.items():
        decoded = get_codec("fp32").decode(tensors[name]).reshape(value.shape)
        assert torch.equal(decoded, value)


@pytest.mark.parametrize("mutate, message", [
    (lambda f: f[:-1], "truncated"),
    (lambda f: f + [pb.Frame(data=b"x")], None),  # trailing bytes belong to the next message: not read here
    (lambda f: [f[0], pb.Frame(data=bytes(f[1].data) + b"extra")], "more than"),
    (lambda f: [pb.Frame(push=pb.PushHeader())] + f[1:], "expected a state header"),
    (lambda f: [f[0], f[0]], "mid-message"),
])
@pytest.mark.parametrize("read", [read_message, read_values], ids=["encoded", "values"])
def test_malformed_streams_are_refused_whole(mutate, message, read):
    frames = mutate(state_frames({"w": torch.randn(4, 4)}))
    if message is None:
        assert read(iter(frames), "state", limit=1 << 20) is not None
        return
    with pytest.raises(FrameError, match=message):
        read(iter(frames), "state", limit=1 << 20)


@pytest.mark.parametrize("read", [read_message, read_values], ids=["encoded", "values"])
def test_headers_that_lie_about_sizes_or_exceed_the_limit_are_refused_before_any_data(read):
    bad = pb.TensorHeader(name="w", codec="fp32", shape=[4], payload_bytes=15)
    with pytest.raises(FrameError, match="declares"):
        read(iter([pb.Frame(state=pb.StateHeader(tensors=[bad]))]), "state", limit=1 << 20)
    huge = pb.TensorHeader(name="w", codec="fp32", shape=[1 << 20], payload_bytes=4 << 20)
    with pytest.raises(FrameError, match="more than the 1024 allowed"):
        read(iter([pb.Frame(state=pb.StateHeader(tensors=[huge]))]), "state", limit=1024)
    unknown = pb.TensorHeader(name="w", codec="pickle", shape=[1])
    with pytest.raises(FrameError, match="unknown codec"):
        read(iter([pb.Frame(state=pb.StateHeader(tensors=[unknown]))]), "state", limit=1024)


def test_values_read_straight_into_tensors_equal_the_decoded_message_bit_for_bit():
    """Θ as a pull reads it: frames cut across tensors (several in one frame, one over several), an empty
    tensor, a scalar; each value a tensor of its own, the same bits a decode of the buffered message gives."""
    torch.manual_seed(1)
    values = {"small": torch.randn(3, 5), "empty": torch.empty(0, 4), "big": torch.randn(FRAME_BYTES // 4 * 2 + 7),
              "scalar": torch.tensor(2.5), "odd": torch.randn(1001)}
    frames = state_frames(values)
    _, encoded = read_message(iter(frames), "state", limit=1 << 30)
    _, read = read_values(iter(frames), "state", limit=1 << 30)
    assert list(read) == list(values)
    for name, value in values.items():
        assert read[name].shape == value.shape and read[name].dtype == torch.float32
        assert torch.equal(read[name], value) and torch.equal(read[name], decode(encoded[name]).reshape(value.shape))
    read["small"].add_(1)  # each value owns its memory: writing one changes no other
    assert torch.equal(read["odd"], values["odd"])
    bf16 = {"h": torch.randn(64)}  # any other codec is decoded as before
    encoded = {n: get_codec("bf16").encode(v) for n, v in bf16.items()}
    header = pb.Frame(state=pb.StateHeader(tensors=[tensor_header(n, e) for n, e in encoded.items()]))
    _, read = read_values(iter(message_frames(header, encoded)), "state", limit=1 << 20)
    assert torch.equal(read["h"], bf16["h"].to(torch.bfloat16).to(torch.float32))


def test_values_that_are_not_finite_are_refused_in_one_line():
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = torch.randn(100)
        w[37] = bad
        encoded = {"ok": encode_fp32({"ok": torch.randn(5)})["ok"], "w": Encoded("fp32", (100,), 0, w.numpy().tobytes())}
        header = pb.Frame(state=pb.StateHeader(tensors=[tensor_header(n, e) for n, e in encoded.items()]))
        with pytest.raises(FrameError, match="tensor 'w' holds NaN or Inf"):
            read_values(iter(message_frames(header, encoded)), "state", limit=1 << 20)


def test_waiting_for_a_shard_ends_in_one_line_once_told_to_give_up():
    """A learner told to stop while it joins does not wait out its connect timeout."""
    give_up = threading.Event()
    give_up.set()
    with socket.socket() as nothing:
        nothing.bind(("127.0.0.1", 0))  # bound, never listening: nothing will answer
        client = ShardClient(f"127.0.0.1:{nothing.getsockname()[1]}")
        began = time.monotonic()
        with pytest.raises(DilocoError, match="stopped while waiting for the syncer at 127.0.0.1"):
            client.wait_ready(60, give_up)
        assert time.monotonic() - began < 2
        client.close()


# ---------------------------------------------------------------- a live shard


@pytest.fixture
def shard():
    config = tiny_config("learners.count=2", "outer.fragments=2", "outer.H=4")
    server_shard = SyncerShard(config, ShardPlan(0, 1, ("",)))
    server, port = serve(server_shard, "127.0.0.1:0")
    server_shard.plan = ShardPlan(0, 1, (f"127.0.0.1:{port}",))
    yield server_shard, f"127.0.0.1:{port}"
    server_shard.stop()
    server.stop(0)


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def push_header(learner, fragment, seq, names, encoded, base_version=0, tokens=16):
    return pb.PushHeader(learner=learner, fragment=fragment, base_version=base_version, seq=seq, tokens=tokens,
                         steps=1, tensors=[tensor_header(n, encoded[n]) for n in names])


@pytest.mark.integration  # a live shard over real gRPC
def test_a_retried_push_is_counted_once(shard):
    syncer, address = shard
    learner = Learner(tiny_model(), syncer=address, learner=0)
    client = ShardClient(address)
    fragment = learner.fragments[0]
    deltas = {n: torch.full_like(learner.params[n], 0.01) for n in fragment.names}
    encoded = encode_fp32(deltas)
    header = push_header(0, fragment.index, learner.core.seq + 1, fragment.names, encoded)
    assert not client.push(header, encoded).duplicate
    assert client.push(header, encoded).duplicate  # the same sequence number again: a retry
    entry = syncer.core.ledger[0]
    assert entry.pushes == 1 and entry.duplicates == 1
    assert syncer.core.rounds_closed == 1 and syncer.core.version(fragment.index) == 1  # merged once
    client.close()
    learner.close()


@pytest.mark.integration  # a live shard over real gRPC
@pytest.mark.parametrize("corrupt, message", [
    (lambda d: {**d, next(iter(d)): torch.full_like(next(iter(d.values())), float("nan"))}, "NaN or Inf"),
    (lambda d: {n: t.reshape(-1)[:-1] for n, t in d.items()}, "shape"),
    (lambda d: {**d, "intruder": torch.zeros(2)}, "exactly the fragment's tensors"),
])
def test_a_bad_push_is_refused_with_the_reason_and_changes_nothing(shard, corrupt, message):
    syncer, address = shard
    learner = Learner(tiny_model(), syncer=address, learner=0)
    client = ShardClient(address)
    fragment = learner.fragments[0]
    theta = {n: t.clone() for n, t in syncer.core.theta.items()}
    deltas = corrupt({n: torch.full_like(learner.params[n], 0.01) for n in fragment.names})
    # Raw bytes, as a faulty or hostile client would send them: our own codec refuses NaN already.
    encoded = {n: Encoded("fp32", tuple(t.shape), 0, t.detach().numpy().tobytes()) for n, t in deltas.items()}
    header = push_header(0, fragment.index, learner.core.seq + 1, list(deltas), encoded)
    with pytest.raises(DilocoError, match=message):
        client.push(header, encoded)
    assert syncer.core.ledger[0].pushes == 0 and not syncer.core.fragments[fragment.index].pending
    assert all(torch.equal(syncer.core.theta[n], theta[n]) for n in theta)
    client.close()
    learner.close()


@pytest.mark.integration  # a live shard over real gRPC
def test_a_learner_with_another_model_is_refused_by_name(shard):
    _, address = shard
    first = Learner(tiny_model(), syncer=address, learner=0)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    with pytest.raises(DilocoError, match="does not match the run"):
        Learner(other, syncer=address, learner=1)
    first.close()


def answers_arrived(learner: Learner) -> bool:
    """Every push the learner has in flight has its answer, merged or waiting in its inbox."""
    unanswered = sum(flight.update is None for flight in learner.core.in_flight.values())
    return len(learner.link.arrivals) >= unanswered


@pytest.mark.integration  # a live shard over real gRPC
def test_updates_reach_the_learner_and_anchors_match_what_the_syncer_holds(shard):
    """Two learners in lockstep on one thread: every merge re-anchors on exactly the values the
    syncer recorded as sent (the anchor-consistency invariant), over the real transport."""
    syncer, address = shard
    learners = [Learner(tiny_model(), syncer=address, learner=m) for m in range(2)]
    optimizers = [torch.optim.SGD(lr.model.parameters(), lr=0.1) for lr in learners]
    for step in range(12):
        for learner, opt in zip(learners, optimizers):
            loss = learner.model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            learner.step(tokens=8)
    wait_for(lambda: all(answers_arrived(learner) for learner in learners), 10, "the answers to every push")
    for learner in learners:  # merge them at one more step
        learner.step(tokens=0)
    for m, learner in enumerate(learners):
        assert learner.merges > 0
        for p, fragment in enumerate(learner.fragments):
            held = syncer.core.held_values(m, p)
            if learner.core.anchor_versions[p] == syncer.core.held_versions[m][p] and held is not None:
                for name in fragment.names:
                    assert torch.equal(learner.core.anchors[p][name], held[name])
    reports = [learner.close() for learner in learners]
    assert syncer.finished
    ledger = syncer.core.ledger
    for m, report in enumerate(reports):
        per_fragment = [ledger[m].merged[p] + ledger[m].stale[p] for p in range(2)]
        assert per_fragment == [report["tokens"]] * 2  # conservation: every token counted once per fragment


@pytest.mark.integration  # a live shard over real gRPC
def test_an_unseeded_shard_refuses_a_pull_clearly(shard):
    _, address = shard
    client = ShardClient(address)
    with pytest.raises(DilocoError, match="not seeded"):
        client.pull(0)
    client.close()


@pytest.mark.integration  # a live shard over real gRPC
def test_status_reports_membership(shard):
    _, address = shard
    client = ShardClient(address)
    assert not client.status().initialised
    learner = Learner(tiny_model(), syncer=address, learner=1)
    status = client.status()
    assert status.initialised and list(status.alive) == [0, 1]
    learner.close()
    assert list(client.status().alive) == [0]
    client.close()


@pytest.mark.integration  # a live shard over real gRPC
def test_the_status_page_of_a_live_shard_shows_its_learners_by_name(shard):
    import json
    import urllib.request

    from diloco.status.status_server import StatusServer

    syncer, address = shard
    learners = [Learner(tiny_model(), syncer=address, learner=m, host=f"island-{m}") for m in range(2)]
    with StatusServer(syncer.snapshot) as status:
        page = urllib.request.urlopen(f"http://{status.address}/", timeout=10).read().decode()
        snapshot = json.loads(urllib.request.urlopen(f"http://{status.address}/status.json", timeout=10).read())
    assert "learner 0" in page and "learner 1" in page and "island-1" in page
    assert snapshot["learners"]["0"]["state"] == "training" and snapshot["strategy"] == "decoupled"
    learners[1].close()
    assert syncer.snapshot()["learners"]["1"]["state"] == "left"
    learners[0].close()


@pytest.mark.integration  # a live shard over real gRPC
def test_a_heartbeat_in_the_middle_of_a_step_claims_no_tokens_ahead_of_its_step(shard, monkeypatch):
    """The heartbeat thread may read the learner's progress at any moment of a step: what it claims is
    never more tokens than its step allows (the syncer refuses that as tokens risen with no step)."""
    syncer, address = shard
    learner = Learner(tiny_model(), syncer=address, learner=0, tokens_per_step=16)
    beats: list[tuple[int, int]] = []
    sequence = learner._step_sequence

    def beating(tokens: int, step_time: float) -> None:
        beats.extend((b.tokens, b.step) for b in learner._beat())  # before the core has taken the step
        sequence(tokens, step_time)
        beats.extend((b.tokens, b.step) for b in learner._beat())  # after

    monkeypatch.setattr(learner, "_step_sequence", beating)
    for _ in range(6):
        learner.step(tokens=16)
    # every claim pairs tokens with the step they were trained by: a step's tokens never come before its
    # step (refused as tokens risen with no step), nor after it (the next claim at that step would be)
    assert len(beats) == 12 and all(tokens == 16 * step for tokens, step in beats), beats
    assert [(b.tokens, b.step) for b in learner._beat()] == [(96, 6)]
    learner.close()
