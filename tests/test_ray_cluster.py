"""`diloco run --ray` on a real multi-node Ray cluster on this machine (Ray's own `Cluster` utility, in a
process of its own: a head and several raylet nodes, with labels standing for regions, prices and roles).

Nodes join and leave while a run trains; every test asserts on the run's end state: it completed, where
its learners ran, and every token accounted for (trained = merged + stale + lost, none counted twice),
with no process of the run left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

ray = pytest.importorskip("ray")

from conftest import TINY, child_env, tiny_config, wait_for  # noqa: E402
from diloco.cluster.local_nodes import LocalCluster, NodeRef  # noqa: E402
from diloco.core.accounting import ledger_of  # noqa: E402
from diloco.launch.chaos import account  # noqa: E402
from test_runtime import sets  # noqa: E402

pytestmark = pytest.mark.integration

RUN = [*TINY, "learners.speeds=[0.1, 0.1]", "metrics.every_steps=1", "outer.fragments=2",
       "cluster.syncer_labels={role = 'syncer'}", "cluster.learner_labels={role = 'learner'}"]
"""Two tiny learners slowed to a tenth (their runs then last long enough for nodes to come and go), every
step recorded (tokens are then accounted exactly); shards on the head node."""


def learner_node(cluster: LocalCluster, region: str, price: float, cpus: int = 1) -> NodeRef:
    return cluster.add_node(num_cpus=cpus, labels={"role": "learner", "region": region,
                                                   "price_per_hour": str(price)})


@pytest.fixture
def cluster():
    cluster = LocalCluster(head_cpus=2, head_labels={"role": "syncer"})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def run(out: Path, *overrides: str, during: Callable | None = None) -> tuple[dict, object]:
    """A run on the cluster this process is connected to, in a thread; `during(launcher)` acts on the
    cluster meanwhile from this thread (Ray changes nodes from the main thread only)."""
    from diloco.cluster.ray_launcher import RayLauncher

    config = tiny_config(*RUN[len(TINY):], *overrides)
    launcher = RayLauncher(config, sets(*RUN, *overrides), out, address="auto")
    outcome: dict = {}

    def go() -> None:
        try:
            outcome["summary"] = launcher.run()
        except BaseException as exc:  # reported by the test, not lost in the thread
            outcome["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    if during is not None:
        during(launcher)
    thread.join(timeout=600)
    assert "error" not in outcome, outcome.get("error")
    return outcome["summary"], launcher


def trained_share(launcher) -> float:
    return sum(launcher.progress.tokens.values()) / launcher.budget


def placements(summary: dict, prefix: str) -> list[dict]:
    return [p for p in summary["cluster"]["placements"] if p["name"].startswith(prefix)]


def assert_accounted(out: Path, summary: dict) -> None:
    accounting = account(out, summary)
    assert accounting["tokens_counted_twice"] == 0
    assert 0 <= accounting["tokens_lost"] <= accounting["tokens_trained"]
    assert summary["tokens_merged"] + summary["tokens_stale"] + summary["tokens_lost"] == pytest.approx(
        accounting["tokens_trained"], rel=1e-9)


def assert_no_process_left(out: Path) -> None:
    """No process of the run (every one has the run's folder on its command line) outlives it."""
    def ours() -> list[str]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(out) in cmdline and entry.name != str(os.getpid()):
                found.append(cmdline)
        return found

    wait_for(lambda: not ours(), 30, lambda: f"the run's processes to end: {ours()}")


def test_learners_fill_the_cheapest_nodes_first_and_the_run_reports_its_cost(cluster, tmp_path):
    expensive = learner_node(cluster, "a", 3.0, cpus=2)
    cheap = learner_node(cluster, "b", 0.5)
    middle = learner_node(cluster, "c", 1.0)
    summary, _ = run(tmp_path, "train.tokens=20480")
    learners = placements(summary, "learner")
    assert {p["node"] for p in learners} == {cheap.node_id, middle.node_id}  # not the dearest
    assert expensive.node_id not in {p["node"] for p in summary["cluster"]["placements"]}
    assert summary["launcher"] == "ray" and summary["learners"] == 2
    report = summary["cluster"]
    assert report["node_hours"] > 0 and report["cost"] > 0
    assert report["cost"] == pytest.approx(sum(n["hours"] * n["price_per_hour"] for n in report["nodes"].values()))
    assert report["cost_per_million_tokens"] == pytest.approx(report["cost"] / (summary["tokens_merged"] / 1e6))
    assert summary["tokens_lost"] == 0 and summary["duplicates"] == 0
    assert_accounted(tmp_path, summary)
    assert (tmp_path / "model.pt").is_file() and (tmp_path / "metrics.jsonl").is_file()
    assert_no_process_left(tmp_path)


def test_a_learner_of_two_processes_runs_as_one_gang_on_a_node_with_room_for_both(cluster, tmp_path):
    gang_home = cluster.add_node(num_cpus=2, labels={"role": "learner", "region": "a", "price_per_hour": "2.0"})
    learner_node(cluster, "a", 0.5)  # cheaper, but one CPU: no room for the gang
    summary, _ = run(tmp_path, "learners.speeds=[0.1]", "cluster.learner_processes=2", "train.tokens=10240")
    assert [p["node"] for p in placements(summary, "learner")] == [gang_home.node_id]
    report = json.loads((tmp_path / "learners" / "learner-0.json").read_text())
    assert report["world"] == 2 and report["tokens"] > 0
    assert_accounted(tmp_path, summary)
    assert_no_process_left(tmp_path)


def test_a_node_that_joins_mid_run_gains_a_learner_whose_pushes_merge(cluster, tmp_path):
    learner_node(cluster, "a", 1.0)
    learner_node(cluster, "a", 1.0)
    added = {}

    def add_a_node(launcher) -> None:
        wait_for(lambda: trained_share(launcher) > 0.1, 120, "10% of the run")
        added["node"] = learner_node(cluster, "b", 1.0)

    summary, _ = run(tmp_path, "train.tokens=153600", "learners.max=3", during=add_a_node)
    newcomer = [p for p in placements(summary, "learner") if p["node"] == added["node"].node_id]
    assert [p["name"] for p in newcomer] == ["learner-2"]
    assert summary["learners"] == 3 and summary["cluster"]["learners_started"] == 3
    shards = json.loads((tmp_path / "syncer" / "shards.json").read_text())
    merged, stale = ledger_of(shards, 2)
    # merged at all: on a loaded host a newcomer's every push may land a version behind (merged as stale)
    assert sum(merged.values()) + sum(stale.values()) > 0, shards[0]["ledger"].get("2")
    assert_accounted(tmp_path, summary)
    assert_no_process_left(tmp_path)


def test_a_region_outage_mid_run_the_others_train_on_and_the_region_comes_back(cluster, tmp_path):
    learner_node(cluster, "a", 1.0)
    east = [learner_node(cluster, "b", 1.0), learner_node(cluster, "b", 1.0)]
    back = {}

    def outage(launcher) -> None:
        wait_for(lambda: trained_share(launcher) > 0.2, 120, "20% of the run")
        for node in east:
            cluster.remove_node(node)
        wait_for(lambda: len(launcher.fleet.running) == 1, 60, "the region's learners counted lost")
        time.sleep(2.0)
        back["node"] = learner_node(cluster, "b", 1.0)

    summary, launcher = run(tmp_path, "learners.speeds=[0.1, 0.1, 0.1]", "learners.min=1", "train.tokens=92160",
                            during=outage)
    report = summary["cluster"]
    assert report["learners_lost"] == 2
    returned = [p for p in placements(summary, "learner") if p["node"] == back["node"].node_id]
    assert returned, "no learner started in the region once it came back"
    assert summary["tokens"] >= launcher.budget  # the run trained its whole budget through the outage
    assert_accounted(tmp_path, summary)
    assert_no_process_left(tmp_path)


def test_a_shard_whose_node_dies_is_resumed_on_another_node_from_its_journal(cluster, tmp_path):
    learner_node(cluster, "a", 1.0)
    learner_node(cluster, "a", 1.0)
    shard_home = cluster.add_node(num_cpus=1, labels={"role": "shard"})

    def kill_the_shard(launcher) -> None:
        wait_for(lambda: trained_share(launcher) > 0.25, 120, "25% of the run")
        cluster.add_node(num_cpus=1, labels={"role": "shard"})  # where it can go next
        cluster.remove_node(shard_home)

    summary, _ = run(tmp_path, "train.tokens=61440", "cluster.syncer_labels={role = 'shard'}", during=kill_the_shard)
    shards = placements(summary, "syncer")
    assert [p["outcome"] for p in shards] == ["lost", "exited 0"]
    assert shards[0]["node"] == shard_home.node_id and shards[1]["node"] != shard_home.node_id
    assert summary["cluster"]["shard_restarts"] == 1
    assert_accounted(tmp_path, summary)
    assert_no_process_left(tmp_path)


def test_ctrl_c_stops_the_run_and_leaves_no_actor_and_no_process(cluster, tmp_path):
    learner_node(cluster, "a", 1.0)
    learner_node(cluster, "a", 1.0)
    command = [sys.executable, "-m", "diloco", "run", "--ray", cluster.address, "--quiet", "--out", str(tmp_path),
               *sets(*RUN, "train.tokens=400000")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env())
    wait_for(lambda: any((tmp_path / "metrics").glob("learner-*.jsonl")) or process.poll() is not None, 120,
             "a learner training")
    assert process.poll() is None, process.stdout.read().decode()
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=120)[0].decode()
    assert process.returncode == 130, output[-2000:]
    assert_no_process_left(tmp_path)

    def ours_alive() -> list:
        from ray._private import state

        return [a for a in state.actors().values()
                if a.get("State") == "ALIVE" and a.get("ActorClassName", "").endswith("ProcessHost")]

    wait_for(lambda: not ours_alive(), 30, lambda: f"no actor of the run alive: {ours_alive()}")


def test_the_local_cluster_refuses_an_unknown_node_in_one_line_and_stays_usable(cluster):
    with pytest.raises(RuntimeError, match="could not remove: KeyError"):
        cluster.remove_node(NodeRef("f" * 56))
    node = learner_node(cluster, "a", 1.0)
    assert node.node_id in {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    cluster.remove_node(node)
    wait_for(lambda: node.node_id not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}, 60, "the node gone")
