"""The probes of `adversarial.py` against a live shard: an outsider without the secret, an insider with
learner 0's own credential lying, and the resources a caller can make the shard spend. Each is a
callable that raises Refused(one line) when the shard turns it away."""

from __future__ import annotations

import resource
import socket
import threading
import time
from typing import Callable, Iterator

import grpc
import torch

from _adversarial_shard import METHODS, SERVICE, Refused, Shard, call, push_message
from diloco.transport.calls import ShardClient
from diloco.transport.frames import message_frames
from diloco.transport.security import (LEARNER_KEY, METADATA_KEY, ClientIdentity, TransportSecurity,
                                       learner_security, make_channel)
from diloco.transport.stream_calls import syncer_stub
from diloco.v1 import diloco_pb2 as pb


def outsider_probes(shard: Shard) -> Iterator[tuple[str, Callable[[], object]]]:
    """Every RPC without the secret and with a wrong one."""
    requests = {"Join": pb.JoinRequest(learner=-1), "Pull": pb.PullRequest(learner=0, observer=True),
                "Updates": pb.UpdatesRequest(learner=0), "Heartbeat": pb.HeartbeatRequest(learner=0, tokens=10**9),
                "Leave": pb.LeaveRequest(learner=0), "Status": pb.StatusRequest()}
    streams = {"Init": lambda: iter([pb.Frame(state=pb.StateHeader())]),
               "Push": lambda: message_frames(pb.Frame(push=push_message(0, 0, 99, {"w0": torch.ones(64)}, tokens=1,
                                                                         steps=1, step=1)[0]), {})}
    for who, security in (("no secret", None), ("a wrong secret", TransportSecurity(secret=b"guess"))):
        stub = shard.stub(security)
        for method in METHODS:
            rpc = getattr(stub, method)
            if method in requests:
                request = requests[method]
                if method in ("Pull", "Updates"):
                    yield f"{method} with {who}", lambda rpc=rpc, request=request: list(rpc(request, timeout=5))
                else:
                    yield f"{method} with {who}", lambda rpc=rpc, request=request: rpc(request, timeout=5)
            else:
                yield f"{method} with {who}", lambda rpc=rpc, make=streams[method]: rpc(make(), timeout=5)


def half_open_calls(shard: Shard, count: int, security: TransportSecurity | None) -> Callable[[], object]:
    """`count` calls to every method that send headers and never a body; then the shard must answer."""

    def probe() -> object:
        channel = make_channel(shard.address, security)
        release = threading.Event()

        def never() -> Iterator[bytes]:
            release.wait()
            return
            yield b""  # noqa: unreachable — makes this a generator

        futures = []
        for i in range(count):
            method = METHODS[i % len(METHODS)]
            stream_unary = channel.stream_unary(SERVICE + method, request_serializer=None,
                                                response_deserializer=None)
            futures.append(stream_unary.future(never(), timeout=30))
        time.sleep(1.0)
        try:
            problem = shard.healthy()
        finally:
            release.set()
            for future in futures:
                future.cancel()
            channel.close()
        if problem:
            raise RuntimeError(problem)
        refused = sum(1 for f in futures if f.done() and not f.cancelled())
        raise Refused(f"{count} half-open calls held no thread ({refused} answered before their body)")

    return probe


def streams_and_half_open(shard: Shard, streams: int, half_open: int) -> Callable[[], object]:
    """`streams` learners' update streams held open (each a configured learner, with its own credential)
    and `half_open` calls without the secret: an honest heartbeat must still be answered within 1 s."""

    def probe() -> object:
        release = threading.Event()
        channels = [make_channel(shard.address, learner_security(shard.run_secret, m)) for m in range(streams)]
        calls = [syncer_stub(c).Updates(pb.UpdatesRequest(learner=m), timeout=60)
                 for m, c in enumerate(channels)]
        outsider = make_channel(shard.address, None)

        def never() -> Iterator[bytes]:
            release.wait()
            return
            yield b""  # noqa: unreachable — makes this a generator

        refusals = [outsider.stream_unary(SERVICE + "Heartbeat", request_serializer=None,
                                          response_deserializer=None).future(never(), timeout=30)
                    for _ in range(half_open)]
        try:
            time.sleep(1.0)
            started = time.monotonic()
            problem = shard.healthy()
            took = time.monotonic() - started
            open_streams = sum(1 for c in calls if c.running())
        finally:
            release.set()
            for c in [*calls, *refusals]:
                c.cancel()
            for c in [*channels, outsider]:
                c.close()
        if problem:
            raise RuntimeError(problem)
        raise Refused(f"{open_streams} update streams and {half_open} half-open calls open: an honest heartbeat "
                      f"and a pull answered in {took * 1000:.0f} ms")

    return probe


def idle_connections(shard: Shard, count: int) -> Callable[[], object]:
    """`count` TCP connections that never speak; the shard must keep answering, and keep saving."""

    def probe() -> object:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count + 256)), hard))
        host, port = shard.address.rsplit(":", 1)
        sockets = []
        try:
            for _ in range(count):
                sockets.append(socket.create_connection((host, int(port)), timeout=5))
            time.sleep(1.0)
            problem = shard.healthy()
        finally:
            for s in sockets:
                s.close()
        time.sleep(0.5)
        problem = problem or shard.healthy()
        if problem:
            raise RuntimeError(problem)
        raise Refused(f"{len(sockets)} idle connections: heartbeats still answered")

    return probe


def insider_probes(shard: Shard) -> Iterator[tuple[str, Callable[[], object]]]:
    """Learner 0's own credentials, used to lie."""
    me = learner_security(shard.run_secret, 0)
    stub = shard.stub(me)
    client = ShardClient(shard.address, me)

    def push(deltas: torch.Tensor, *, learner: int = 0, seq: int | None = None, tokens: int = 256,
             steps: int = 4, fragment: int = 0) -> object:
        shard.seq[0] += 1
        header, tensors = push_message(learner, fragment, shard.seq[0] if seq is None else seq,
                                       {f"w{fragment}": deltas}, tokens=tokens, steps=steps,
                                       step=shard.step[0] + steps)
        return client.push(header, tensors)

    honest = torch.randn(64) * 1e-3
    yield "push as learner 1", lambda: push(honest, learner=1)
    yield "heartbeat as learner 1", lambda: stub.Heartbeat(pb.HeartbeatRequest(learner=1, tokens=1), timeout=5)
    yield "Updates stream of learner 1", lambda: next(iter(stub.Updates(pb.UpdatesRequest(learner=1), timeout=2)))
    yield "Leave as learner 1", lambda: stub.Leave(pb.LeaveRequest(learner=1), timeout=5)
    yield "Pull as learner 1", lambda: list(stub.Pull(pb.PullRequest(learner=1), timeout=5))
    yield "push with seq 2^64-1", lambda: push(honest, seq=2**64 - 1)
    yield "push of 1e30", lambda: push(torch.full((64,), 1e30))
    yield "push of 3.4e38 (twice)", lambda: (push(torch.full((64,), 3.4e38)), push(torch.full((64,), 3.4e38)))
    yield "push of NaN", lambda: push(torch.full((64,), float("nan")))
    yield "push of +Inf", lambda: push(torch.full((64,), float("inf")))
    yield "push claiming 2^30 tokens in 1 step", lambda: push(honest, tokens=2**30, steps=1)
    yield "push claiming 2^40 tokens", lambda: push(honest, tokens=2**40, steps=4)
    yield "heartbeat claiming 2^64-1 tokens", lambda: stub.Heartbeat(
        pb.HeartbeatRequest(learner=0, tokens=2**64 - 1, steps=shard.step[0] + 1), timeout=5)
    yield "heartbeat claiming 10^12 steps", lambda: stub.Heartbeat(
        pb.HeartbeatRequest(learner=0, tokens=shard.step[0] * 64, steps=10**12), timeout=5)
    yield "progress with a step time of 1e300 s", lambda: stub.Heartbeat(
        pb.HeartbeatRequest(learner=0, tokens=shard.step[0] * 64, steps=shard.step[0], step_time_s=1e300,
                            due_in_s=[1.0, 1.0]), timeout=5)
    yield "push based on a future version", lambda: client.push(*push_message(
        0, 0, shard.seq[0] + 1, {"w0": honest}, tokens=256, steps=4, step=shard.step[0] + 4, base_version=10**6))
    yield "push of the wrong shape", lambda: push(torch.zeros(65))
    yield "push of a fragment that does not exist", lambda: push(honest, fragment=7)
    yield "Join as learner 2^40", lambda: stub.Join(pb.JoinRequest(learner=2**40), timeout=5)
    run = shard.stub(shard.run_secret)
    yield "push as learner 1 with the run secret", lambda: ShardClient(shard.address, shard.run_secret).push(
        *push_message(1, 0, shard.seq[1] + 1, {"w0": honest}, tokens=256, steps=4, step=shard.step[1] + 4))
    yield "Leave for every learner with the run secret", lambda: [
        run.Leave(pb.LeaveRequest(learner=m), timeout=5) for m in range(4)]


def replay(shard: Shard) -> Callable[[], object]:
    """An honest push, then the same sent again as new (seq + 1, the same inner steps): counted twice?"""

    def probe() -> object:
        client = ShardClient(shard.address, learner_security(shard.run_secret, 0))
        shard.seq[0] += 1
        shard.step[0] += 4
        client.heartbeat(0, tokens=shard.step[0] * 64, steps=shard.step[0])
        header, tensors = push_message(0, 1, shard.seq[0], {"w1": torch.randn(64) * 1e-3}, tokens=256, steps=4,
                                       step=shard.step[0])
        client.push(header, tensors)
        before = shard.state()
        header.seq += 1
        try:
            call(lambda: client.push(header, tensors))
        except Refused:
            shard.seq[0] += 1
            if shard.state() != before:
                return "refused, but the shard's state changed"
            problem = shard.healthy()
            if problem:
                raise RuntimeError(problem) from None
            raise
        shard.seq[0] += 1
        return "taken"

    return probe


def init_too_large(shard: Shard) -> Callable[[], object]:
    """Before Θ is seeded: an Init whose header declares 256 GiB; then the honest Init must still work."""

    def probe() -> object:
        stub = shard.stub(shard.run_secret)
        header = pb.StateHeader(tensors=[pb.TensorHeader(name="w0", codec="fp32", shape=[1 << 36],
                                                          payload_bytes=1 << 38)])
        try:
            stub.Init(iter([pb.Frame(state=header)]), timeout=10)
        except grpc.RpcError as exc:
            shard.seed()
            raise Refused(f"{exc.code().name}: {exc.details()}") from None
        return "taken"

    return probe


def walking_up(shard: Shard) -> Callable[[], object]:
    """40 pushes, each 4.99x the largest one taken as it was: the bound must not follow them up. With
    the default rule a push over the bound is merged clipped to it (and the reply says so)."""

    def probe() -> object:
        client = ShardClient(shard.address, learner_security(shard.run_secret, 0))
        norm = 64 ** 0.5 * 1e-3  # an honest push's norm
        taken, clipped, refused, largest = 0, 0, 0, norm
        for _ in range(40):
            shard.seq[0] += 1
            shard.step[0] += 4
            client.heartbeat(0, tokens=shard.step[0] * 64, steps=shard.step[0])
            header, tensors = push_message(0, 1, shard.seq[0], {"w1": torch.full((64,), largest * 4.99 / 8)},
                                           tokens=256, steps=4, step=shard.step[0])
            try:
                reply = client.push(header, tensors)
            except Exception:  # noqa: BLE001 — refused (rule `reject`)
                refused += 1
                continue
            if reply.clipped:
                clipped += 1
            else:
                taken += 1
                largest *= 4.99
        summary = f"{taken} taken as they were, {clipped} clipped, {refused} refused of 40"
        if largest > norm * 5 ** 2:
            return f"{summary}; the bound walked up to {largest / norm:.3g}x an honest norm"
        raise Refused(f"{summary}; largest taken as it was {largest / norm:.3g}x an honest norm")

    return probe


# ---------------------------------------------------------------- the command line


# ---------------------------------------------------------------- claims issue 32 found unbounded


def bound_metadata(shard: Shard, learner: int) -> list[tuple[str, str]]:
    """What learner `learner`'s calls (but Join and Status) to `shard` carry: its credential bound to the run."""
    identity = ClientIdentity(learner_security(shard.run_secret, learner))
    run = shard.stub(shard.run_secret).Status(pb.StatusRequest(), timeout=5).run
    return list(identity.metadata(run or None))


def claim_probes(shard: Shard) -> Iterator[tuple[str, Callable[[], object]]]:
    """Learner 0's own credential, declaring a rate no learner has; credentials in forms not canonical."""
    stub = shard.stub(learner_security(shard.run_secret, 0))

    def end_the_run() -> object:
        stub.Join(pb.JoinRequest(learner=0, tokens_per_step=10**12), timeout=5)
        reply = stub.Heartbeat(pb.HeartbeatRequest(learner=0, tokens=10**12, steps=shard.step[0] + 1), timeout=5)
        return "the shared budget reads spent: every learner is told to stop" if reply.stop else "taken"

    yield "Join declaring 10^12 tokens per step, then a heartbeat of 10^12 tokens", end_the_run
    raw = syncer_stub(make_channel(shard.address, None))
    right = bound_metadata(shard, 1)
    honest = pb.HeartbeatRequest(learner=1, tokens=shard.step[1] * 64, steps=shard.step[1])
    forms = {"learner id header '01'": [right[0], (LEARNER_KEY, "01")],
             "a wrong credential next to the right one": [(METADATA_KEY, "0" * 64), *right]}
    for name, metadata in forms.items():
        yield name, lambda metadata=metadata: raw.Heartbeat(honest, metadata=metadata, timeout=5)


def seeded_huge(shard: Shard) -> Callable[[], object]:
    """Before Θ is seeded: an Init of values 3e38 (finite); Θ must stay unseeded."""

    def probe() -> object:
        client = shard.clients[0]
        client.join(0, host="honest-0")
        layout = [pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=f"w{p}", shape=[64])]) for p in (0, 1)]
        call(lambda: client.init(layout, {"w0": torch.full((64,), 3e38), "w1": torch.full((64,), 3e38)}))
        return "taken"

    return probe


def seeded_by_a_learner(shard: Shard) -> Callable[[], object]:
    """A shard started with --operator-seeds: learner 0's own credential tries to seed Θ."""

    def probe() -> object:
        client = shard.clients[0]
        client.join(0, host="honest-0")
        layout = [pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=f"w{p}", shape=[64])]) for p in (0, 1)]
        call(lambda: client.init(layout, {"w0": torch.zeros(64), "w1": torch.zeros(64)}))
        return "taken"

    return probe


def replayed_into(fresh: Shard, recorded: list[tuple[str, str]]) -> Callable[[], object]:
    """A push carrying learner 0's call credential of another run (same secret), sent to a fresh run."""

    def probe() -> object:
        header, tensors = push_message(0, 0, fresh.seq[0] + 1, {"w0": torch.randn(64) * 1e-3}, tokens=256,
                                       steps=4, step=fresh.step[0] + 4)
        raw = syncer_stub(make_channel(fresh.address, None))
        return call(lambda: raw.Push(message_frames(pb.Frame(push=header), tensors), metadata=recorded, timeout=5))

    return probe
