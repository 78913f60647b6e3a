"""A soak: the real runtime for a long run under continuous churn, next to its fault-free twin.

The faulty run (`diloco run`'s launcher, in this process) has its learners SIGKILLed one every
`--learner-every` seconds (drawn at random, restarted 2 s later with their id: own checkpoint, own
progress, the current Θ), a syncer shard SIGKILLed every `--shard-every` seconds (restarted with
`--resume`), and a partition: a learner frozen (SIGSTOP: nothing in or out, its connections held open)
for `--partition-s` seconds at a third and at two thirds of `--minutes`. The twin is the same config
without faults, run at the same time as a separate `diloco run` (so that both see the same machine).

Reported: per shard process, its resident memory over time (the shards' own `syncer` metrics) and its
growth past its value 2 minutes into its life (target: within 1.2×); tokens trained, lost and counted
twice (target 0), as `diloco chaos` accounts them; the final eval loss against the twin's.

    nice -n 10 python benchmarks/soak.py --minutes 20 --tokens 20000000

The run lasts as long as its token budget does (`--tokens`; the kills are planned over `--minutes`):
the duration actually run is in the report. Writes JSON (default benchmarks/results/soak.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.config import load_config
from diloco.launch.chaos import ChaosMonkey, Kill, account, learner_starts, restart_summary
from diloco.launch.launcher import Launcher
from diloco.metrics.records import records_of

RSS_SETTLED_S = 120.0
"""A shard process's memory is judged against its value this long into its life."""
NEW_LIFE_GAP_S = 3.5
"""A shard records its memory every 2 s: a longer silence is a kill, and what follows a new process."""


def plan_churn(rng: random.Random, learners: int, shards: int, minutes: float, learner_every: float,
               shard_every: float) -> list[Kill]:
    """A learner kill every `learner_every` s and a shard kill every `shard_every` s, from the first
    period on; victims drawn at random."""
    kills = [Kill(t, f"learner-{rng.randrange(learners)}") for t in _times(minutes, learner_every)]
    kills += [Kill(t, f"syncer-{rng.randrange(shards)}") for t in _times(minutes, shard_every)]
    return sorted(kills, key=lambda k: k.at_s)


def _times(minutes: float, every: float) -> list[float]:
    return [every * i for i in range(1, int(minutes * 60 / every) + 1)]


def partition(launcher: Launcher, victim: str, at_s: float, for_s: float, done: threading.Event,
              log: list[dict[str, Any]]) -> None:
    """Freeze `victim`'s process group for `for_s` seconds, `at_s` into training."""
    while not hasattr(launcher, "training_started"):
        if done.wait(0.5):
            return
    if done.wait(max(0.0, launcher.training_started + at_s - clock.monotonic())):
        return
    child = launcher.children.children.get(victim)
    if child is None or child.returncode is not None:
        return
    group = child.process.pid  # each child leads its own session
    try:
        os.killpg(group, signal.SIGSTOP)
        began = clock.monotonic() - launcher.training_started
        done.wait(for_s)
        os.killpg(group, signal.SIGCONT)
    except ProcessLookupError:  # killed (and restarted as another process) meanwhile: the partition ended
        return
    log.append({"victim": victim, "at_s": began, "for_s": for_s})


def shard_memory(metrics: Path) -> list[dict[str, Any]]:
    """Per shard process life: its memory over time, and its peak against its value `RSS_SETTLED_S` in."""
    lives = []
    for path in sorted(metrics.glob("syncer*.jsonl")):
        life: list[dict[str, Any]] = []
        for record in records_of(path, "syncer") + [None]:
            if record is None or (life and record["time_s"] - life[-1]["time_s"] > NEW_LIFE_GAP_S):
                if life:
                    lives.append(_memory_life(path.stem, life))
                life = []
            if record is not None and record.get("memory_bytes"):
                life.append(record)
    return lives


def _memory_life(name: str, life: list[dict[str, Any]]) -> dict[str, Any]:
    start = life[0]["time_s"]
    settled = next((r["memory_bytes"] for r in life if r["time_s"] - start >= RSS_SETTLED_S), None)
    later = [r["memory_bytes"] for r in life if r["time_s"] - start >= RSS_SETTLED_S]
    return {"shard": name, "from_s": start, "to_s": life[-1]["time_s"], "settled_bytes": settled,
            "peak_after_bytes": max(later) if later else None,
            "growth": max(later) / settled if settled else None,
            "samples": [(round(r["time_s"], 1), r["memory_bytes"]) for r in life[:: max(1, len(life) // 40)]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0, help="the span the kills are planned over")
    p.add_argument("--tokens", type=int, default=20_000_000, help="the token budget of both runs")
    p.add_argument("--learner-every", type=float, default=45.0)
    p.add_argument("--shard-every", type=float, default=300.0)
    p.add_argument("--partition-s", type=float, default=40.0)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--spares", type=int, default=4, help="spare learners ready before training (at most one per planned kill) the restarts take "
                   "(0: fresh starts)")
    p.add_argument("--out", default=None, help="run folder (default: a folder under /tmp)")
    p.add_argument("--json", default="benchmarks/results/soak.json")
    args = p.parse_args()
    out = Path(args.out or f"/tmp/soak-{os.getpid()}")
    sets = ["--set", f"train.tokens={args.tokens}", "--set", "metrics.every_steps=1",
            "--set", f"train.eval_points={max(2, int(args.minutes))}"]
    config = load_config(None, [s for s in sets if s != "--set"])
    began = clock.monotonic()
    twin = subprocess.Popen([sys.executable, "-m", "diloco", "run", "-q", "--shards", str(args.shards),
                             "--out", str(out / "twin"), *sets], stdout=subprocess.DEVNULL)
    launcher = Launcher(config, sets, out / "faulty", shards=args.shards)
    rng = random.Random(args.seed)
    kills = plan_churn(rng, config.learners.count, args.shards, args.minutes, args.learner_every, args.shard_every)
    monkey = ChaosMonkey(launcher, kills, restart_after_s=2.0, spare_count=args.spares)
    partitions: list[dict[str, Any]] = []
    threads = [monkey.start()] + [threading.Thread(target=partition, daemon=True, args=(
        launcher, f"learner-{rng.randrange(config.learners.count)}", share * args.minutes * 60, args.partition_s,
        monkey.done, partitions)) for share in (1 / 3, 2 / 3)]
    for thread in threads[1:]:
        thread.start()
    try:
        faulty = launcher.run(before_learners=monkey.ready_spares)
    finally:
        monkey.done.set()
        for thread in threads:
            thread.join()
    faulty_s = clock.monotonic() - began
    twin.wait()
    clean = json.loads((out / "twin" / "summary.json").read_text())
    accounting = account(out / "faulty", faulty)
    memory = shard_memory(out / "faulty" / "metrics")
    growths = [m["growth"] for m in memory if m["growth"] is not None]
    result = {
        "minutes_planned": args.minutes, "faulty_wall_s": faulty_s, "tokens_budget": args.tokens, "spares": args.spares,
        "kills": [vars(k) for k in kills], "partitions": partitions,
        "shard_memory": memory, "shard_rss_growth_max": max(growths) if growths else None,
        "tokens_trained": accounting["tokens_trained"], "tokens_lost": accounting["tokens_lost"],
        "tokens_lost_share": accounting["tokens_lost"] / max(1, accounting["tokens_trained"]),
        "duplicates": accounting["tokens_counted_twice"], "retries_recognised": accounting["retries_recognised"],
        "final_eval_loss": faulty["final_eval_loss"], "twin_final_eval_loss": clean["final_eval_loss"],
        "loss_vs_twin": faulty["final_eval_loss"] / clean["final_eval_loss"],
        **restart_summary(learner_starts(out / "faulty" / "metrics")),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'faulty run wall s':<34}{faulty_s:>12.0f}")
    print(f"{'kills / partitions':<34}{sum(k.restarted_at_s is not None for k in kills):>8} / {len(partitions)}")
    print(f"{'shard RSS growth past 2 min (max)':<34}{result['shard_rss_growth_max'] or float('nan'):>12.3f}"
          f"   target <= 1.2")
    print(f"{'tokens trained / lost':<34}{result['tokens_trained']:>12,} / {result['tokens_lost']:,.0f}"
          f" ({result['tokens_lost_share']:.2%})")
    print(f"{'tokens counted twice':<34}{result['duplicates']:>12,.0f}   target 0")
    print(f"{'final eval loss / twin':<34}{result['final_eval_loss']:>12.4f} / {result['twin_final_eval_loss']:.4f}"
          f" ({result['loss_vs_twin']:.4f}x)")
    return 0 if result["duplicates"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
