"""Learners that die, go silent or restart: the syncer carries on, nobody waits for a dead peer, and a
restarted learner picks up its own state and Θ, with every push counted once."""

from __future__ import annotations

import threading
import time

import torch

from conftest import tiny_config
from diloco.runtime.learner import Learner
from diloco.runtime.loop import run_learner
from diloco.runtime.syncer import ShardPlan, SyncerShard, serve


def live_shard(*overrides: str) -> tuple[SyncerShard, object, str]:
    shard = SyncerShard(tiny_config(*overrides), ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    return shard, server, address


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
        silent._halt.set()  # its process hangs: no more heartbeats, pushes or leave
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
        assert entry.merged[p] + entry.late[p] == first["tokens"] + second["tokens"]


def test_a_syncer_killed_mid_run_restarts_from_its_journal_and_counts_every_token_once(tmp_path):
    """SIGKILL the shard while learners train; restart it with --resume: learners keep training meanwhile,
    retry their pushes, reconnect, and every token each trained is merged exactly once per fragment."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from diloco.transport.client import ShardClient
    from test_runtime import free_port, sets
    from conftest import TINY

    overrides = [*TINY, "learners.count=2", "outer.H=4", "outer.fragments=2", "train.tokens=60000"]
    config = tiny_config(*overrides[len(TINY):])
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "diloco", "syncer", *sets(*overrides), "--bind", address,
               "--out", str(tmp_path), "--exit-when-finished"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "syncer.log", "w")
    syncer = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    reports, restarted = {}, None
    try:
        learners = [threading.Thread(target=lambda m=m: reports.update({m: run_learner(
            config, syncer=address, learner=m, out=tmp_path, connect_timeout_s=60)})) for m in range(2)]
        for thread in learners:
            thread.start()
        client = ShardClient(address)
        client.wait_ready(60)
        deadline = time.monotonic() + 60
        while client.status().rounds < 4:
            assert time.monotonic() < deadline and syncer.poll() is None, (tmp_path / "syncer.log").read_text()
            time.sleep(0.05)
        rounds_before = client.status().rounds
        client.close()
        syncer.send_signal(signal.SIGKILL)  # mid-run, mid-round: no chance to save anything
        syncer.wait()
        time.sleep(1.0)
        restarted = subprocess.Popen([*command, "--resume"], stdout=log, stderr=subprocess.STDOUT,
                                     env=env)
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
            assert entry["merged"].get(p, 0) + entry["late"].get(p, 0) == trained
