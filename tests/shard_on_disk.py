"""A real shard with a state folder, its Θ seeded, for the journal and state-file tests; the fixture that
leaves no such shard running after a test; and how those tests damage a file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import retire_update_stream, tiny_config


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


class SeededShard:
    """A shard with a state folder, served, its Θ seeded by a learner that only sends by hand."""

    running: list[SeededShard] = []
    """Not killed yet: a test that fails half-way leaves no server behind (`_no_shard_left`)."""

    def __init__(self, state_dir: Path, resume: bool = False, address: str | None = None, metrics=None) -> None:
        from diloco.client.learner_client import Learner
        from diloco.shard.server import ShardPlan, SyncerShard, serve
        from diloco.transport.calls import ShardClient

        self.config = tiny_config("learners.count=1", "outer.fragments=1", "outer.H=4")
        self.shard = SyncerShard(self.config, ShardPlan(0, 1, ("",)), metrics, state_dir=state_dir, resume=resume)
        self.server, port = serve(self.shard, address or "127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.shard.plan = ShardPlan(0, 1, (self.address,))
        self.learner = None
        if not resume:
            self.learner = Learner(tiny_model(), syncer=self.address, learner=0)
            self.learner.link._halt.set()  # this learner only sends by hand here, and takes no answers:
            retire_update_stream(self.shard, 0)
        self.client = ShardClient(self.address)
        SeededShard.running.append(self)

    def push_message(self, seq: int, value: float = 0.01, base_version: int | None = None):
        from diloco.transport.frames import encode_fp32, tensor_header
        from diloco.v1 import diloco_pb2 as pb

        names = [n for n in self.shard.core.theta]
        encoded = encode_fp32({n: torch.full_like(self.shard.core.theta[n], value * seq) for n in names})
        version = self.shard.core.version(0) if base_version is None else base_version
        header = pb.PushHeader(learner=0, fragment=0, base_version=version, seq=seq, tokens=8, steps=1, step=seq,
                               step_time_s=0.1, tensors=[tensor_header(n, encoded[n]) for n in names])
        return header, encoded

    def assert_resumes_as(self, state_dir: Path, live: dict,
                          keys: tuple[str, ...] = ("theta", "fragments", "rounds", "last_weight", "ledger")) -> None:
        """Killed now, a shard resumed from `state_dir` (its saved state and journal) holds `live`'s `keys`
        (`frozen` core state) bit for bit."""
        from diloco.shard.server import ShardPlan, SyncerShard
        from core_state import frozen, same

        self.kill()
        resumed = SyncerShard(self.config, ShardPlan(0, 1, ("",)), state_dir=state_dir, resume=True)
        try:
            after = frozen(resumed.core)
            for key in keys:
                assert same(live[key], after[key]), key
        finally:
            resumed.stop()

    def kill(self) -> None:
        """As SIGKILL: nothing more is saved (the journal is what is on disk)."""
        self.client.close()
        self.shard.stop()
        self.server.stop(0)
        if self in SeededShard.running:
            SeededShard.running.remove(self)


@pytest.fixture(autouse=True)
def _no_shard_left():
    yield
    for shard in list(SeededShard.running):
        shard.kill()
