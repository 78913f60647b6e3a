"""Where `diloco run --ray` puts learners and shards, decided without a cluster (`cluster/node_choice.py`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import child_env, tiny_config
from diloco.cluster.node_choice import Demand, Fleet, Node, choose_nodes, learner_demand, live_nodes, syncer_demand
from diloco.errors import ConfigError


def node(name: str, cpus: float = 2, price: str | None = None, **labels: str) -> Node:
    if price is not None:
        labels["price_per_hour"] = price
    return Node(name, "10.0.0.1", {"CPU": cpus}, labels)


def test_the_cheapest_matching_node_fills_first_and_a_node_takes_as_many_as_fit():
    nodes = [node("a", 4, "3.0"), node("b", 2, "1.0"), node("c", 1, "2.0"), node("d", 8, "0.5", region="us")]
    need = Demand({"CPU": 1}, {})
    chosen = choose_nodes(nodes, need, {}, 6, "price_per_hour")
    assert [n.id for n in chosen] == ["d"] * 6
    chosen = choose_nodes(nodes, Demand({"CPU": 1}, {"region": "eu"}), {}, 2, "price_per_hour")
    assert chosen == []  # no node carries the label
    nodes[3] = node("d", 8, "0.5", region="us")
    held = {"d": {"CPU": 7.5}, "b": {"CPU": 1}}
    assert [n.id for n in choose_nodes(nodes, need, held, 4, "price_per_hour")] == ["b", "c", "a", "a"]


def test_an_unpriced_node_counts_as_paid_for_and_a_bad_price_is_left_out():
    raw = [{"NodeID": "x", "Alive": True, "NodeManagerAddress": "h", "Resources": {"CPU": 1}, "Labels": {}},
           {"NodeID": "y", "Alive": True, "NodeManagerAddress": "h", "Resources": {"CPU": 1},
            "Labels": {"price_per_hour": "nan"}},
           {"NodeID": "z", "Alive": True, "NodeManagerAddress": "h", "Resources": {"CPU": 1},
            "Labels": {"price_per_hour": "-1"}},
           {"NodeID": "w", "Alive": False, "NodeManagerAddress": "h", "Resources": {"CPU": 1}, "Labels": {}}]
    assert [n.id for n in live_nodes(raw, "price_per_hour")] == ["x"]
    assert live_nodes(raw, "price_per_hour")[0].price("price_per_hour") == 0.0


def test_a_gang_reserves_all_its_processes_on_one_node():
    config = tiny_config("cluster.learner_processes=4", "cluster.learner_cpus=0.5", "cluster.learner_gpus=1",
                         "cluster.learner_resources={h100 = 1}", "cluster.learner_labels={region = 'eu'}")
    need = learner_demand(config.cluster)
    assert dict(need.resources) == {"CPU": 2.0, "GPU": 4.0, "h100": 4.0}
    big = Node("g", "h", {"CPU": 8, "GPU": 8, "h100": 8}, {"region": "eu"})
    assert need.room(big, {}) == 2 and need.room(big, {"GPU": 5}) == 0
    assert dict(syncer_demand(config.cluster).resources) == {"CPU": 1.0}


def test_fractional_reservations_add_up_exactly():
    need = Demand({"CPU": 0.1}, {})
    assert need.room(Node("n", "h", {"CPU": 0.3}, {}), {"CPU": 0.2}) == 1


def test_lost_ids_start_again_first_then_configured_then_new_ones():
    fleet = Fleet(tiny_config("learners.count=2", "learners.min=1", "learners.max=4").learners)
    assert fleet.next_ids(3) == [0, 1, 2]
    for m in (0, 1, 2):
        fleet.start(m, "a")
    assert fleet.room() == 1
    fleet.lost(1)
    fleet.finished(2)
    assert fleet.next_ids(2) == [1, 3]  # 2 finished its share: never again
    fleet.start(1, "b")
    assert fleet.running == {0: "a", 1: "b"} and not fleet.vacant and fleet.started == [0, 1, 2]


@pytest.mark.parametrize("override, message", [
    ("learners.max=1", "learners.max' must be at least learners.count"),
    ("learners.min=9", "learners.min' must be at most learners.count"),
    ("cluster.learner_resources={h100 = -1}", "cluster.learner_resources.h100' must be zero or positive"),
    ("cluster.learner_cpus=0", "a learner must reserve something"),
    ("cluster.learner_labels={region = 3}", "cluster.learner_labels.region' must be a string"),
    ("cluster.learner_processes=0", "cluster.learner_processes' must be positive"),
])
def test_bad_cluster_settings_are_refused_with_their_key(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("learners.count=2", override)


def test_import_diloco_never_imports_ray_and_run_without_ray_says_what_to_install(tmp_path):
    code = ("import sys\nimport diloco, diloco.cli, diloco.launch.launcher, diloco.launch.runtime_cli\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n"
            "sys.modules['ray'] = None  # as if Ray were not installed\n"
            "from diloco.cli import main\n"
            f"raise SystemExit(main(['run', '--ray', 'local', '--out', {str(tmp_path)!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode != 0
    assert "--ray needs Ray: pip install 'diloco[ray]'" in done.stdout + done.stderr
