"""The shard under test for `adversarial.py`: a `diloco syncer` subprocess with a secret and state on
disk, the honest learners' clients, and how a probe's outcome is told (a refusal, or anything else)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import torch

from diloco.transport.calls import ShardClient
from diloco.transport.frames import encode_fp32, tensor_header
from diloco.transport.security import TransportSecurity, learner_security, make_channel
from diloco.transport.stream_calls import syncer_stub
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

    def __init__(self, workdir: Path, *options: str) -> None:
        """`options`: more `diloco syncer` options (`--operator-seeds`)."""
        self.workdir = workdir
        secret_file = workdir / "secret"
        secret_file.write_bytes(SECRET)
        port_file = workdir / "port"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco", "syncer", *TINY_SETS, "--bind",
             "127.0.0.1:0", "--port-file", str(port_file), "--secret-file", str(secret_file), "--out",
             str(workdir / "syncer"), "-q", *options], stdout=subprocess.DEVNULL, stderr=open(workdir / "syncer.log", "w"),
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
        return syncer_stub(make_channel(self.address, security))

    def seed(self, by_operator: bool = False) -> None:
        """Learners 0 and 1 join; 0 (or the run secret's holder) seeds Θ with two small fragments; both take
        it and push once."""
        torch.manual_seed(0)
        values = {"w0": torch.randn(64) * 0.02, "w1": torch.randn(64) * 0.02}
        layout = [pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=f"w{p}", shape=[64])]) for p in (0, 1)]
        for m, client in self.clients.items():
            client.join(m, host=f"honest-{m}")
        seeder = ShardClient(self.address, self.run_secret) if by_operator else self.clients[0]
        if not seeder.init(layout, values):
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
        theta = ShardClient(self.address, self.run_secret).pull(0, observer=True).values
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
            theta = ShardClient(self.address, self.run_secret).pull(0, observer=True).values
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


