"""Adversarial probes against a live `diloco syncer` and the command line: what is refused, what crashes.

    python benchmarks/adversarial.py [--json PATH] [--idle-connections N]

About 2 minutes on 2 cores. A `diloco syncer` subprocess is started with a shared secret and state on
disk; two honest learners (0 and 1) join it, seed Θ and push once each. Then every probe runs, as
  outsider  a caller without the secret (or with a wrong one): every RPC, and half-open calls that send
            their headers and never their body;
  insider   learner 0's own credentials, used to lie: to act as learner 1, to send pushes that would
            ruin Θ (huge, non-finite, walked up a little at a time), to claim impossible counters;
  resource  connections and calls held open, a declared 256 GiB Init;
  cli       bad command lines and files: one line of error, never a traceback, never a silent start.
After each probe the shard must still be healthy: learner 1's heartbeat answered within 1 s, Θ finite,
and, for a refused probe, the shard's state (versions, rounds, tokens, ledger, Θ) as before the probe.

Each probe ends as one of
  refused   the bad input was turned away with a one-line reason and nothing changed;
  accepted  the bad input was taken (silently, or it changed state);
  crashed   the shard stalled (no answer within 1 s), died, or the CLI printed a traceback.
Prints a table per kind and writes JSON (default benchmarks/results/adversarial.json). Targets: 0
crashed, 0 accepted.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
import torch
from rich.console import Console
from rich.table import Table

from diloco.transport.calls import ShardClient
from diloco.transport.frames import encode_fp32, message_frames, tensor_header
from diloco.transport.security import TransportSecurity, learner_security, make_channel
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

SECRET = b"adversarial-benchmark-secret"
HEALTHY_WITHIN_S = 1.0
TINY = ["model.layers=1", "model.width=32", "model.heads=2", "train.seq_len=16", "train.batch_size=4",
        "learners.count=64", "learners.speeds=[]", "outer.fragments=2", "outer.H=4", "train.tokens=100000000",
        "train.eval_batches=2", "train.eval_points=2"]
SERVICE = "/diloco.v1.Syncer/"
TINY_SETS = [a for s in TINY for a in ("--set", s)]
METHODS = ("Join", "Init", "Pull", "Push", "Updates", "Heartbeat", "Leave", "Status")


@dataclass
class Outcome:
    kind: str
    probe: str
    result: str  # refused | accepted | crashed
    detail: str


class Refused(Exception):
    """The shard (or the CLI) said no, with this reason."""


# ---------------------------------------------------------------- the shard under test


class Shard:
    """A `diloco syncer` subprocess with a secret, and the honest learners' clients."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        secret_file = workdir / "secret"
        secret_file.write_bytes(SECRET)
        port_file = workdir / "port"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco", "syncer", *TINY_SETS, "--bind",
             "127.0.0.1:0", "--port-file", str(port_file), "--secret-file", str(secret_file), "--out",
             str(workdir / "syncer"), "-q"], stdout=subprocess.DEVNULL, stderr=open(workdir / "syncer.log", "w"),
            start_new_session=True)
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the syncer did not start: {(workdir / 'syncer.log').read_text()[-2000:]}")
            time.sleep(0.1)
        self.address = f"127.0.0.1:{int(port_file.read_text())}"
        self.run_secret = TransportSecurity(secret=SECRET)
        self.clients = {m: ShardClient(self.address, learner_security(self.run_secret, m)) for m in (0, 1)}
        self.seq = {0: 0, 1: 0}
        self.step = {0: 0, 1: 0}

    def stub(self, security: TransportSecurity | None) -> pb_grpc.SyncerStub:
        return pb_grpc.SyncerStub(make_channel(self.address, security))

    def seed(self) -> None:
        """Learners 0 and 1 join; 0 seeds Θ with two small fragments; both take it and push once."""
        torch.manual_seed(0)
        values = {"w0": torch.randn(64) * 0.02, "w1": torch.randn(64) * 0.02}
        layout = [pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=f"w{p}", shape=[64])]) for p in (0, 1)]
        for m, client in self.clients.items():
            client.join(m, host=f"honest-{m}")
        if not self.clients[0].init(layout, values):
            raise SystemExit("the syncer did not take the honest Init")
        for m, client in self.clients.items():
            client.pull(m, after_seq=0)
        for m in self.clients:
            self.honest_push(m, 0)

    def honest_push(self, m: int, fragment: int, scale: float = 1e-3) -> None:
        self.seq[m] += 1
        self.step[m] += 4
        self.clients[m].heartbeat(m, tokens=self.step[m] * 64, steps=self.step[m])
        header, tensors = push_message(m, fragment, self.seq[m], {f"w{fragment}": torch.randn(64) * scale},
                                       tokens=4 * 64, steps=4, step=self.step[m])
        self.clients[m].push(header, tensors)

    def state(self) -> str:
        """A digest of what the shard decides from: versions, rounds, tokens, ledger, Θ."""
        reply = self.stub(self.run_secret).Status(pb.StatusRequest(), timeout=5)
        report = json.loads(reply.report_json)
        theta, _, _ = ShardClient(self.address, self.run_secret).pull(0, observer=True)
        digest = hashlib.sha256(json.dumps([list(map(str, reply.versions)), reply.rounds, reply.tokens_reported,
                                            report.get("ledger")], sort_keys=True, default=str).encode())
        for name in sorted(theta):
            digest.update(theta[name].numpy().tobytes())
        return digest.hexdigest()

    def healthy(self) -> str | None:
        """None when the shard answers an honest heartbeat within the bound and Θ is finite; else why not."""
        if self.proc.poll() is not None:
            return f"the syncer exited with code {self.proc.returncode}"
        started = time.monotonic()
        try:
            self.stub(learner_security(self.run_secret, 1)).Heartbeat(
                pb.HeartbeatRequest(learner=1, tokens=self.step[1] * 64, steps=self.step[1]),
                timeout=HEALTHY_WITHIN_S)
            theta, _, _ = ShardClient(self.address, self.run_secret).pull(0, observer=True)
        except grpc.RpcError as exc:
            return f"no heartbeat answer within {HEALTHY_WITHIN_S:g} s ({exc.code().name})"
        if not all(torch.isfinite(t).all() for t in theta.values()):
            return "Θ is not finite"
        if time.monotonic() - started > 3 * HEALTHY_WITHIN_S:
            return f"the shard took {time.monotonic() - started:.1f} s to answer"
        return None

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def push_message(learner: int, fragment: int, seq: int, deltas: dict[str, torch.Tensor], *, tokens: int,
                 steps: int, step: int, base_version: int = 0) -> tuple[pb.PushHeader, dict]:
    encoded = encode_fp32(deltas)
    header = pb.PushHeader(learner=learner, fragment=fragment, base_version=base_version, seq=seq, tokens=tokens,
                           steps=steps, step_time_s=0.01, step=step,
                           tensors=[tensor_header(n, e) for n, e in encoded.items()])
    return header, encoded


def call(fn: Callable[[], object]) -> object:
    """Run a gRPC call; a refusal becomes Refused(one-line reason)."""
    try:
        return fn()
    except grpc.RpcError as exc:
        raise Refused(f"{exc.code().name}: {exc.details()}") from None
    except Exception as exc:  # the learner-side client turns refusals into DilocoError
        if type(exc).__name__ in ("DilocoError", "SyncerUnavailable"):
            raise Refused(str(exc)) from None
        raise


# ---------------------------------------------------------------- probes


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
        calls = [pb_grpc.SyncerStub(c).Updates(pb.UpdatesRequest(learner=m), timeout=60)
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


def cli_probes(workdir: Path) -> Iterator[tuple[str, list[str]]]:
    """(probe, arguments to `diloco`)."""
    bad_config = workdir / "latin1.toml"
    bad_config.write_bytes(b"[train]\ntokens = 1000 # caf\xe9\n")
    a_file = workdir / "a-file"
    a_file.write_text("not a directory")
    empty = workdir / "no-state"
    empty.mkdir()
    torn = workdir / "torn"
    (torn / "syncer").mkdir(parents=True)
    (torn / "syncer" / "shard-0.state.pt").write_bytes(b"PK\x03\x04 torn")
    pickled = workdir / "pickled"
    (pickled / "checkpoints").mkdir(parents=True)
    (pickled / "checkpoints" / "learner-0.pt").write_bytes(
        b"\x80\x04cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.")
    sim = ["sim", "-q", "--out", str(workdir / "sim-out")]
    yield "a config file that is not UTF-8", ["sim", str(bad_config), "-q"]
    yield "train.tokens=1e30", [*sim, "--set", "train.tokens=1e30"]
    yield "codec.block=2^40", [*sim, "--set", f"codec.block={2**40}"]
    yield "outer.lr=inf", [*sim, "--set", "outer.lr=inf"]
    yield "outer.outlier_factor=inf", [*sim, "--set", "outer.outlier_factor=inf"]
    yield "learners.count=10^6", [*sim, "--set", "learners.count=1000000"]
    yield "--metrics-port 70000", ["syncer", "--metrics-port", "70000"]
    yield "--out a file", ["sim", "-q", "--out", str(a_file)]
    yield "--out in a read-only place", ["sim", "-q", "--out", "/proc/diloco-out"]
    yield "--resume with no saved state", ["syncer", "--out", str(empty), "--resume", "--bind", "127.0.0.1:0"]
    yield "--resume from a torn state file", ["syncer", "--out", str(torn), "--resume", "--bind",
                                              "127.0.0.1:0"]
    yield "a pickle as a learner checkpoint", ["learner", *TINY_SETS, "--no-sync", "--id", "0", "--out",
                                              str(pickled)]


def run_cli(arguments: list[str], timeout_s: float = 60) -> object:
    done = subprocess.run([sys.executable, "-m", "diloco", *arguments], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if "Traceback" in done.stderr:
        raise RuntimeError(f"a traceback: {lines[-1] if lines else ''}")
    if done.returncode == 0:
        return f"exit code 0: {(lines or ['no output'])[-1]}"
    if len(lines) != 1:
        raise RuntimeError(f"{len(lines)} lines of error: {' | '.join(lines)[:200]}")
    raise Refused(lines[0])


# ---------------------------------------------------------------- running and reporting


def judge(kind: str, name: str, probe: Callable[[], object], shard: Shard | None) -> Outcome:
    before = shard.state() if shard is not None else None
    try:
        returned = probe()
    except Refused as refusal:
        reason = str(refusal)
        if "\n" in reason.strip():
            return Outcome(kind, name, "crashed", f"a refusal of several lines: {reason[:200]!r}")
        if shard is not None:
            problem = shard.healthy()
            if problem:
                return Outcome(kind, name, "crashed", problem)
            if shard.state() != before:
                return Outcome(kind, name, "accepted", f"refused ({reason}) but the shard's state changed")
        return Outcome(kind, name, "refused", reason)
    except Exception as exc:  # noqa: BLE001 — any other failure of the probe is the service failing it
        return Outcome(kind, name, "crashed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    problem = shard.healthy() if shard is not None else None
    if problem:
        return Outcome(kind, name, "crashed", problem)
    return Outcome(kind, name, "accepted", str(returned)[:200] if isinstance(returned, str) else "taken")


def probe_shard(workdir: Path, half_open: int = 32, idle: int = 1100) -> list[Outcome]:
    """Every probe against one live shard (outsider, insider, resource), in order; the shard is stopped."""
    outcomes = []
    shard = Shard(workdir)
    try:
        outcomes.append(judge("resource", "Init declaring 256 GiB", init_too_large(shard), None))
        for name, probe in outsider_probes(shard):
            outcomes.append(judge("outsider", name, lambda probe=probe: call(probe), shard))
        for who, security in (("no secret", None), ("a wrong secret", TransportSecurity(secret=b"guess"))):
            outcomes.append(judge("outsider", f"{half_open} half-open calls with {who}",
                                  half_open_calls(shard, half_open, security), shard))
        for name, probe in insider_probes(shard):
            outcomes.append(judge("insider", name, lambda probe=probe: call(probe), shard))
        outcomes.append(judge("insider", "the same push again, numbered one higher", replay(shard), None))
        outcomes.append(judge("insider", "pushes walking the outlier bound up", walking_up(shard), None))
        outcomes.append(judge("resource", f"{half_open} half-open calls as learner 0",
                              half_open_calls(shard, half_open, learner_security(shard.run_secret, 0)), shard))
        outcomes.append(judge("resource", f"64 update streams and {half_open} half-open calls",
                              streams_and_half_open(shard, 64, half_open), shard))
        outcomes.append(judge("resource", f"{idle} idle connections", idle_connections(shard, idle), shard))
    finally:
        shard.stop()
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "adversarial.json")
    parser.add_argument("--idle-connections", type=int, default=1100)
    parser.add_argument("--half-open", type=int, default=32)
    args = parser.parse_args()
    console = Console()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="diloco-adversarial-") as tmp:
        workdir = Path(tmp)
        outcomes += probe_shard(workdir, args.half_open, args.idle_connections)
        for name, arguments in cli_probes(workdir):
            outcomes.append(judge("cli", name, lambda arguments=arguments: run_cli(arguments), None))
    report(console, outcomes)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")
    console.print(f"wrote {args.json}")


def report(console: Console, outcomes: list[Outcome]) -> None:
    detail = Table(title="probes")
    for column in ("kind", "probe", "result", "reason or failure"):
        detail.add_column(column, overflow="fold")
    for o in outcomes:
        style = {"refused": "green", "accepted": "yellow", "crashed": "red"}[o.result]
        detail.add_row(o.kind, o.probe, f"[{style}]{o.result}[/]", o.detail[:120])
    console.print(detail)
    summary = Table(title="summary (targets: 0 crashed or stalled, 0 silently accepted)")
    for column in ("kind", "probes", "refused", "crashed", "accepted"):
        summary.add_column(column, justify="right" if column != "kind" else "left")
    for kind in [*dict.fromkeys(o.kind for o in outcomes), "all"]:
        mine = [o for o in outcomes if kind in ("all", o.kind)]
        summary.add_row(kind, str(len(mine)), *(str(sum(o.result == r for o in mine))
                                                for r in ("refused", "crashed", "accepted")))
    console.print(summary)


if __name__ == "__main__":
    main()
