"""Learners that die, go silent or restart: the syncer carries on, nobody waits for a dead peer, and a
restarted learner picks up its own state and Θ, with every push counted once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import live_shard, retire_update_stream, tiny_config, wait_for
from diloco.client.learner_client import Learner
from diloco.client.builtin_loop import run_learner
from diloco.shard.server import ShardPlan, SyncerShard, serve

pytestmark = pytest.mark.integration  # live shards over real gRPC, learner threads and a syncer process


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def train(learner: Learner, optimizer, steps: int) -> None:
    for _ in range(steps):
        learner.model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        learner.step(tokens=8)


def test_a_synchronous_round_does_not_wait_for_a_learner_that_went_silent():
    shard, server, address = live_shard("strategy=diloco", "learners.count=2", "outer.H=3")
    try:
        alive = Learner(tiny_model(), syncer=address, learner=0)
        silent = Learner(tiny_model(), syncer=address, learner=1)
        silent.link._halt.set()  # its process hangs: no more heartbeats, pushes or leave
        started = time.monotonic()
        train(alive, torch.optim.SGD(alive.model.parameters(), lr=0.1), 3)  # the third step waits for the round
        waited = time.monotonic() - started
        assert alive.merges == 1 and shard.lost == {1}
        assert waited < 20  # noticed after a few missed heartbeats, not never
        assert shard.snapshot()["learners"]["1"]["state"] == "lost"
        alive.close()
    finally:
        shard.stop()
        server.stop(0)


def test_a_restarted_learner_resumes_its_own_state_and_takes_the_current_theta(tmp_path):
    shard, server, address = live_shard("learners.count=2", "outer.H=4", "outer.fragments=2",
                                        "failures.checkpoint_every=5", "train.tokens=20480")
    config = shard.config
    try:
        stop = threading.Event()
        other = threading.Thread(target=run_learner, args=(config,),
                                 kwargs=dict(syncer=address, learner=0, out=tmp_path))
        other.start()
        timer = threading.Timer(1.5, stop.set)  # learner 1 is stopped part-way, as by Ctrl-C or a kill
        timer.start()
        first = run_learner(config, syncer=address, learner=1, out=tmp_path, stop=stop)
        assert first["interrupted"] and 0 < first["steps"] < first["planned_steps"]
        pushes_before = shard.core.ledger[1].pushes
        second = run_learner(config, syncer=address, learner=1, out=tmp_path)
        other.join()
    finally:
        timer.cancel()
        shard.stop()
        server.stop(0)
    assert second["resumed_from_step"] == first["steps"]
    assert second["steps"] > first["steps"] and not second["interrupted"]  # on to the end of the shared budget
    entry = shard.core.ledger[1]
    assert entry.duplicates == 0 and entry.pushes > pushes_before  # its new pushes counted, none twice
    assert shard.finished  # both left at the end: the last rounds are merged
    for p in range(2):  # conservation over both lives of learner 1
        assert entry.merged[p] + entry.stale[p] == first["tokens"] + second["tokens"]


def test_a_syncer_killed_mid_run_restarts_from_its_journal_and_counts_every_token_once(tmp_path):
    """SIGKILL the shard while learners train; restart it with --resume: learners keep training meanwhile,
    retry their pushes, reconnect, and every token each trained is merged exactly once per fragment."""
    import json
    import os
    import signal
    import subprocess

    from diloco.transport.calls import ShardClient
    from test_runtime import sets, started_syncer
    from conftest import TINY

    overrides = [*TINY, "learners.count=2", "outer.H=4", "outer.fragments=2", "train.tokens=60000"]
    config = tiny_config(*overrides[len(TINY):])
    command = [*sets(*overrides), "--out", str(tmp_path), "--exit-when-finished"]
    popen = dict(stdout=open(tmp_path / "syncer.log", "w"), stderr=subprocess.STDOUT,
                 env={**os.environ, "OMP_NUM_THREADS": "1"})
    syncer, port = started_syncer([*command, "--bind", "127.0.0.1:0"], tmp_path / "syncer.port", **popen)
    address = f"127.0.0.1:{port}"
    reports, restarted = {}, None
    try:
        learners = [threading.Thread(target=lambda m=m: reports.update({m: run_learner(
            config, syncer=address, learner=m, out=tmp_path, connect_timeout_s=60)})) for m in range(2)]
        for thread in learners:
            thread.start()
        client = ShardClient(address)

        def four_rounds() -> bool:
            assert syncer.poll() is None, (tmp_path / "syncer.log").read_text()
            return client.status().rounds >= 4

        wait_for(four_rounds, 60, "four rounds merged")
        rounds_before = client.status().rounds
        client.close()
        syncer.send_signal(signal.SIGKILL)  # mid-run, mid-round: no chance to save anything
        syncer.wait()
        time.sleep(1.0)  # the shard stays down a while (what is under test): learners train on and retry
        (tmp_path / "syncer.port").unlink()  # the restarted shard reports again once it listens
        restarted, _ = started_syncer([*command, "--bind", address, "--resume"], tmp_path / "syncer.port", **popen)
        for thread in learners:
            thread.join(timeout=120)
        assert restarted.wait(timeout=60) == 0
    finally:
        for process in (syncer, restarted):
            if process is not None and process.poll() is None:
                process.kill()
    report = json.loads((tmp_path / "syncer" / "shard-0.json").read_text())
    assert report["finished"] and len(report["rounds"]) > rounds_before
    for m in range(2):
        entry = report["ledger"][str(m)]
        trained = reports[m]["tokens"]
        for p in ("0", "1"):  # exactly once: nothing lost in the crash, nothing counted twice
            assert entry["merged"].get(p, 0) + entry["stale"].get(p, 0) == trained


# ---------------------------------------------------------------- the network misbehaves


class Relay:
    """A TCP relay between a learner and the syncer that can be cut (a network partition) and healed."""

    def __init__(self, target: str) -> None:
        import socket
        self.socket_module = socket
        self.target = target.rsplit(":", 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.links: list = []
        self.cut_off = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                client.close()
                continue
            upstream = self.socket_module.create_connection((self.target[0], int(self.target[1])))
            self.links += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source, sink) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.close()
            except OSError:
                pass

    def cut(self) -> None:
        self.cut_off.set()
        for s in self.links:
            try:
                s.shutdown(self.socket_module.SHUT_RDWR)
            except OSError:
                pass
        self.links.clear()

    def heal(self) -> None:
        self.cut_off.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_a_partitioned_learner_trains_on_and_loses_nothing_when_the_network_heals():
    shard, server, address = live_shard("learners.count=2", "outer.H=4", "outer.fragments=2")
    relay = Relay(address)
    try:
        cut_off = Learner(tiny_model(), syncer=relay.address, learner=0)
        other = Learner(tiny_model(), syncer=address, learner=1)
        optimizers = {lr: torch.optim.SGD(lr.model.parameters(), lr=0.1) for lr in (cut_off, other)}

        def steps(n: int) -> float:
            """The slowest step of `n` lockstep steps of both learners."""
            slowest = 0.0
            for _ in range(n):
                for learner, opt in optimizers.items():
                    started = time.monotonic()
                    train(learner, opt, 1)
                    slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.05)  # each step takes a while: 140 of them outlast the syncer's patience
            return slowest

        steps(8)
        relay.cut()
        slowest = steps(140)  # ~7 s apart: longer than the syncer waits before counting it dead
        assert 0 in shard.lost and slowest < 2.0  # nobody waited for the network (a wait would be seconds)
        relay.heal()
        deadline = time.monotonic() + 30
        while 0 in shard.lost and time.monotonic() < deadline:  # it reconnects within a few seconds
            steps(5)
        steps(20)
        assert 0 not in shard.lost and 0 in shard.core.alive  # it spoke again, so it counts again
        merges_after_heal = cut_off.merges
        reports = [cut_off.close(), other.close()]
    finally:
        relay.close()
        shard.stop()
        server.stop(0)
    assert merges_after_heal > 0 and shard.finished
    for m, report in enumerate(reports):  # every token of the partition reached the syncer once
        entry = shard.core.ledger[m]
        assert [entry.merged[p] + entry.stale[p] for p in range(2)] == [report["tokens"]] * 2


def test_a_client_sending_one_byte_at_a_time_does_not_hold_up_anyone():
    import socket
    shard, server, address = live_shard("learners.count=1", "outer.H=3", "outer.fragments=1")
    host, port = address.rsplit(":", 1)
    slow = socket.create_connection((host, int(port)))
    stop = threading.Event()

    def dribble() -> None:
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(1000)
        for byte in preface:
            if stop.wait(0.1):
                return
            try:
                slow.send(bytes([byte]))
            except OSError:
                return

    threading.Thread(target=dribble, daemon=True).start()
    try:
        learner = Learner(tiny_model(), syncer=address, learner=0)
        started = time.monotonic()
        train(learner, torch.optim.SGD(learner.model.parameters(), lr=0.1), 30)
        elapsed = time.monotonic() - started

        def merged() -> bool:
            learner.step(tokens=0)  # merges whatever has arrived
            return learner.merges > 0

        wait_for(merged, 10, "the learner's first merge")
        assert elapsed < 10
        learner.close()
    finally:
        stop.set()
        slow.close()
        shard.stop()
        server.stop(0)


def test_a_push_cut_off_mid_stream_changes_nothing_and_its_retry_counts():
    from diloco.transport.calls import ShardClient
    from diloco.transport.frames import encode_fp32, message_frames, tensor_header
    from diloco.v1 import diloco_pb2 as pb

    shard, server, address = live_shard("learners.count=2", "outer.fragments=1")
    try:
        learner = Learner(tiny_model(), syncer=address, learner=0)
        fragment = learner.fragments[0]
        encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in fragment.names})
        header = pb.PushHeader(learner=0, fragment=0, base_version=0, seq=learner.core.seq + 1, tokens=8, steps=1,
                               tensors=[tensor_header(n, encoded[n]) for n in fragment.names])
        theta = {n: t.clone() for n, t in shard.core.theta.items()}

        def dies_mid_push():
            frames = message_frames(pb.Frame(push=header), encoded)
            yield next(frames)  # the header goes out, then the learner's process dies
            raise ConnectionAbortedError("killed")

        client = ShardClient(address)
        with pytest.raises(Exception):
            client.stub.Push(dies_mid_push(), timeout=10)
        assert shard.core.ledger[0].pushes == 0 and not shard.core.fragments[0].pending
        assert all(torch.equal(shard.core.theta[n], theta[n]) for n in theta)
        assert not client.push(header, encoded).duplicate  # the retry is the first time it counts
        assert shard.core.ledger[0].pushes == 1
        client.close()
        learner.close()
    finally:
        shard.stop()
        server.stop(0)


def test_diloco_chaos_kills_and_restarts_and_counts_no_token_twice(tmp_path):
    """The chaos command end to end on a tiny run: learners and the shard SIGKILLed and restarted."""
    import json
    import subprocess
    import sys

    from conftest import TINY
    from test_runtime import sets

    done = subprocess.run([sys.executable, "-m", "diloco", "chaos", *sets(*TINY, "learners.count=2",
                                                                           "train.tokens=40960"),
                           "--kill-learners", "2", "--kill-syncer", "1", "--restart-after", "0.5", "--seed", "3",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "chaos.json").read_text())
    faulty = result["faulty"]
    assert sum(k["restarted_at_s"] is not None for k in result["kills"]) >= 1
    assert faulty["tokens_counted_twice"] == 0
    assert faulty["tokens_trained"] >= faulty["tokens_lost"] >= 0
    assert all(life["lives"] >= 1 for life in faulty["per_learner"])
    # Every restart took a spare, each imported before the learners started: none imported while they trained.
    assert result["spares_ready"]["all_ready"] and result["spares_ready"]["count"] == {"learner": 2, "syncer": 1}
    restarted = sorted(k["victim"] for k in result["kills"] if k["restarted_at_s"] is not None)
    assert sorted(h["child"] for h in result["spare_handovers"]) == restarted


def test_a_shard_that_dies_right_after_a_merge_comes_back_with_it_and_answers_again(tmp_path):
    """Kill at merge: the round closed and its answer was queued, then the process died before saving
    anything more. The restarted shard replays its journal to the same state and sends the answer."""
    from diloco.transport.calls import ShardClient
    from diloco.transport.frames import encode_fp32, tensor_header
    from diloco.v1 import diloco_pb2 as pb

    config = tiny_config("learners.count=1", "outer.fragments=1", "outer.H=4")
    first = SyncerShard(config, ShardPlan(0, 1, ("",)), state_dir=tmp_path)
    server, port = serve(first, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    first.plan = ShardPlan(0, 1, (address,))
    learner = Learner(tiny_model(), syncer=address, learner=0)
    learner.link._halt.set()  # this learner only sends by hand here, and takes no answers:
    retire_update_stream(first, 0)  # the answers stay queued when the shard dies
    fragment = learner.fragments[0]
    client = ShardClient(address)
    for seq in (learner.core.seq + 1, learner.core.seq + 2):
        encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01 * seq) for n in fragment.names})
        header = pb.PushHeader(learner=0, fragment=0, base_version=first.core.version(0), seq=seq, tokens=8,
                               steps=1, step=learner.core.step + seq - learner.core.seq, step_time_s=0.1,
                               tensors=[tensor_header(n, encoded[n]) for n in fragment.names])
        client.push(header, encoded)
    client.close()
    assert first.core.rounds_closed == 2  # K = 1, everyone in: each push merged at once
    before = first.core.state_dict()
    first.stop()
    server.stop(0)  # the process dies: nothing saved since Init, everything since is in the journal

    second = SyncerShard(config, ShardPlan(0, 1, (address,)), state_dir=tmp_path, resume=True)
    try:
        after = second.core.state_dict()
        assert after["fragments"][0]["version"] == before["fragments"][0]["version"] == 2
        assert all(torch.equal(after["theta"][n], before["theta"][n]) for n in before["theta"])
        assert after["ledger"][0]["last_seq"] == before["ledger"][0]["last_seq"]  # a retry counts once
        answer = second.outboxes[0].get_nowait()  # the answer goes out again
        assert answer.version == 2 and answer.ack_seq == before["ledger"][0]["last_seq"]
    finally:
        second.stop()
