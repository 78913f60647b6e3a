"""Elastic capacity on a multi-node Ray cluster on this machine: `diloco run --ray` with nodes coming
and going, against the same run on a cluster that does not change.

The cluster (Ray's own `Cluster` utility in a process of its own, `diloco.cluster.local_nodes`: one raylet
per node, all on this host): a head node
for the syncer, and one learner node (1 CPU: one learner) per learner, in two regions, `east` and
`west`. The config is the built-in default (4 learners at speeds 1, 1, 0.5, 0.25) with
`learners.min = 2`, `learners.max = 4`.

The churn, on a seeded schedule counted in the share of the token budget trained:
- at 15%, 30%, 45%, 60% and 75%: a learner node leaves (drawn at random), and 2 s later a node joins
  (in a region drawn at random);
- at 50%: a region outage, every `west` node at once; two `west` nodes come back at 65%.

Reported for both runs: final eval loss (and their ratio), tokens trained, merged, stale and lost, tokens
counted twice, goodput of the capacity that was up (busy seconds over the seconds learners were up
and training; also over the seconds their nodes were held, start-up included), tokens merged per
node-hour, and for each node that joined mid-run the time from its arrival to its learner's first merged
push, in seconds and in H-periods of that learner (H of its own measured step times).

    python benchmarks/elastic.py                  # the default run, ~4 min on 2 cores
    python benchmarks/elastic.py --quick          # a tiny model: checks the script in ~1.5 min

Prints a table and writes JSON (default benchmarks/results/elastic.json). Run it alone on the machine:
its figures are times.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
from rich.console import Console
from rich.table import Table

from diloco.cluster.local_nodes import LocalCluster, NodeRef
from diloco.cluster.ray_launcher import RayLauncher
from diloco.config import load_config
from diloco.launch.chaos import account

ELASTIC = ["learners.min=2", "learners.max=4", "metrics.every_steps=1",
           "cluster.syncer_labels={role = 'syncer'}", "cluster.learner_labels={role = 'learner'}"]
QUICK = ["model.layers=1", "model.width=32", "model.heads=2", "train.seq_len=16", "train.batch_size=4",
         "train.tokens=122880", "train.eval_batches=2", "outer.H=10", "learners.speeds=[0.1, 0.1, 0.05, 0.025]"]
"""A tiny model, slowed so that the run lasts long enough for the churn."""
CHURN_MARKS = (0.15, 0.30, 0.45, 0.60, 0.75)
OUTAGE_AT, OUTAGE_BACK_AT = 0.50, 0.65
JOIN_AFTER_S = 2.0


class Nodes:
    """The learner nodes of the cluster, by region."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.live: dict[str, list[NodeRef]] = {"east": [], "west": []}
        self.arrivals: list[dict[str, Any]] = []

    def add(self, region: str, launcher: RayLauncher | None = None) -> None:
        node = self.cluster.add_node(num_cpus=1, labels={"role": "learner", "region": region})
        self.live[region].append(node)
        if launcher is not None:
            self.arrivals.append({"node": node.node_id, "region": region,
                                  "arrival_s": time.monotonic() - launcher.origin_monotonic})

    def remove(self, node: NodeRef) -> None:
        for nodes in self.live.values():
            if node in nodes:
                nodes.remove(node)
        self.cluster.remove_node(node)


def share(launcher: RayLauncher) -> float:
    return sum(launcher.progress.tokens.values()) / launcher.budget


def churn(nodes: Nodes, launcher: RayLauncher, seed: int, done: threading.Event) -> list[dict[str, Any]]:
    """The schedule above, acted out as the run reaches each mark; returns what was done and when."""
    rng = random.Random(seed)
    events = sorted([(m, "leave-join") for m in CHURN_MARKS] + [(OUTAGE_AT, "outage"), (OUTAGE_BACK_AT, "back")])
    log, outage = [], False
    for mark, what in events:
        while share(launcher) < mark:
            if done.wait(0.2):
                return log
        at = time.monotonic() - launcher.origin_monotonic
        if what == "leave-join":
            candidates = [n for ns in nodes.live.values() for n in ns]
            if candidates:
                nodes.remove(rng.choice(candidates))
            time.sleep(JOIN_AFTER_S)
            nodes.add("east" if outage else rng.choice(["east", "west"]), launcher)  # nothing joins a region that is out
        elif what == "outage":
            outage = True
            for node in list(nodes.live["west"]):
                nodes.remove(node)
        else:
            outage = False
            nodes.add("west", launcher)
            nodes.add("west", launcher)
        log.append({"at_share": mark, "what": what, "at_s": at})
    return log


def learner_records(metrics: Path) -> dict[int, list[list[dict[str, Any]]]]:
    """Per learner, its lives, each the list of its step records (a life ends when its counters restart)."""
    lives: dict[int, list[list[dict[str, Any]]]] = {}
    for path in sorted(metrics.glob("learner-*.jsonl")):
        records = [r for line in path.read_text().splitlines() if line.strip()
                   for r in [_json(line)] if r and r.get("kind") == "learner"]
        for record in records:
            runs = lives.setdefault(record["learner"], [])
            if not runs or record["tokens"] < runs[-1][-1]["tokens"] or record["steps"] < runs[-1][-1]["steps"]:
                runs.append([])
            runs[-1].append(record)
    return lives


def _json(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def measure(out: Path, summary: dict[str, Any], arrivals: list[dict[str, Any]], H: int) -> dict[str, Any]:
    cluster = summary["cluster"]
    lives = learner_records(out / "metrics")
    busy = up = 0.0
    for runs in lives.values():
        for records in runs:
            span = records[-1]["time_s"] - records[0]["time_s"] + (records[0].get("step_time_s") or 0.0)
            busy += records[-1]["busy_fraction"] * span
            up += span
    placed_s = cluster["learner_hours"] * 3600
    rounds = [r for line in (out / "metrics.jsonl").read_text().splitlines()
              for r in [_json(line)] if r and r.get("kind") == "round"]
    for arrival in arrivals:
        placed = [p for p in cluster["placements"] if p["node"] == arrival["node"] and p["name"].startswith("learner")]
        arrival["learner"] = placed[0]["name"] if placed else None
        arrival["first_merge_s"] = arrival["h_periods"] = None
        if not placed:
            continue
        arrival["left_s"] = placed[0]["ended_s"] if placed[0]["outcome"] == "lost" else None
        m = int(placed[0]["name"].split("-")[1])
        life = (placed[0]["started_s"], placed[0]["ended_s"])  # a merge of a later life elsewhere is not this node's
        merged = [r["time_s"] for r in rounds if m in r["participants"] and life[0] <= r["time_s"] <= life[1]]
        if merged:
            arrival["first_merge_s"] = min(merged) - arrival["arrival_s"]
            steps = [r["step_time_s"] for runs in lives.get(m, []) for r in runs
                     if r.get("step_time_s") and r["time_s"] >= placed[0]["started_s"]]
            if steps:
                arrival["h_periods"] = arrival["first_merge_s"] / (H * statistics.median(steps))
    accounting = account(out, summary)
    return {
        "final_eval_loss": summary["final_eval_loss"], "training_time_s": summary["training_time_s"],
        "tokens_trained": accounting["tokens_trained"], "tokens_merged": summary["tokens_merged"],
        "tokens_stale": summary["tokens_stale"], "tokens_lost": summary["tokens_lost"],
        "tokens_counted_twice": accounting["tokens_counted_twice"],
        "goodput_while_up": busy / up if up else None,
        "goodput_of_placed_capacity": busy / placed_s if placed_s else None,
        "node_hours": cluster["node_hours"],
        "tokens_merged_per_node_hour": summary["tokens_merged"] / cluster["node_hours"] if cluster["node_hours"] else None,
        "learners_started": cluster["learners_started"], "learners_lost": cluster["learners_lost"],
        "arrivals": arrivals,
    }


def one_run(out: Path, overrides: list[str], seed: int, with_churn: bool) -> dict[str, Any]:
    cluster = LocalCluster(head_cpus=1, head_labels={"role": "syncer"})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        nodes = Nodes(cluster)
        for region in ("east", "east", "west", "west"):
            nodes.add(region)
        config = load_config(None, overrides)
        sets = [x for o in overrides for x in ("--set", o)]
        launcher = RayLauncher(config, sets, out, address="auto")
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def go() -> None:
            try:
                outcome["summary"] = launcher.run()
            except BaseException as exc:
                outcome["error"] = exc
            done.set()

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        events = churn(nodes, launcher, seed, done) if with_churn else []
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        (out / "summary.json").write_text(json.dumps(outcome["summary"], indent=2) + "\n")
        result = measure(out, outcome["summary"], nodes.arrivals, config.outer.H)
        result["events"] = events
        return result
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model (checks the script, not the figures)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--json", default="benchmarks/results/elastic.json", help="JSON file to write")
    parser.add_argument("--keep", metavar="DIR", help="keep the runs' folders under DIR")
    args = parser.parse_args()
    overrides = [*ELASTIC, *(QUICK if args.quick else []), *args.set]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="diloco-elastic-"))
    runs = {}
    for name, with_churn in (("steady", False), ("churn", True)):
        print(f"{name} run ...", file=sys.stderr, flush=True)
        runs[name] = one_run((root / name).resolve(), overrides, args.seed, with_churn)
    steady, churned = runs["steady"], runs["churn"]
    result = {"overrides": overrides, "seed": args.seed, "runs": runs,
              "loss_ratio": churned["final_eval_loss"] / steady["final_eval_loss"]}
    table = Table(title="diloco run --ray: churn against a steady cluster (one invocation)")
    table.add_column("measure")
    table.add_column("steady", justify="right")
    table.add_column("churn", justify="right")
    rows = [("final eval loss", "final_eval_loss", "{:.4f}"), ("training time s", "training_time_s", "{:.1f}"),
            ("tokens trained", "tokens_trained", "{:,.0f}"), ("tokens merged", "tokens_merged", "{:,.0f}"),
            ("tokens stale", "tokens_stale", "{:,.0f}"), ("tokens lost", "tokens_lost", "{:,.0f}"),
            ("tokens counted twice", "tokens_counted_twice", "{:,.0f}"),
            ("goodput while up", "goodput_while_up", "{:.3f}"),
            ("goodput of placed capacity", "goodput_of_placed_capacity", "{:.3f}"),
            ("node-hours", "node_hours", "{:.4f}"), ("merged tokens / node-hour", "tokens_merged_per_node_hour",
                                                      "{:,.0f}"),
            ("learners started / lost", None, None)]
    for label, key, fmt in rows:
        if key is None:
            table.add_row(label, *(f"{r['learners_started']} / {r['learners_lost']}" for r in (steady, churned)))
        else:
            table.add_row(label, *("-" if r[key] is None else fmt.format(r[key]) for r in (steady, churned)))
    console = Console()
    console.print(table)
    console.print(f"final loss, churn / steady: {result['loss_ratio']:.4f}")
    for a in churned["arrivals"]:
        gone = f", its node left {a['left_s'] - a['arrival_s']:.1f} s after arriving" if a.get("left_s") else ""
        merged = f"never merged{gone}" if a["first_merge_s"] is None else (
            f"first merge {a['first_merge_s']:.1f} s after arrival"
            + (f" ({a['h_periods']:.2f} H-periods)" if a["h_periods"] is not None else ""))
        console.print(f"node {a['node'][:8]} ({a['region']}) at {a['arrival_s']:.1f} s: {a['learner']}, {merged}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"JSON: {path}")


if __name__ == "__main__":
    main()
