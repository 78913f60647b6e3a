"""`diloco chaos`'s kill schedule in the simulator: where the faulty run's loss gap comes from, without noise.

A real chaos run (`diloco chaos --kill-learners 10 --kill-syncer 2 --seed 1`) ends a few percent above its
fault-free twin, and one invocation cannot tell a 1% change from this host's noise. The simulator runs
the same schedule deterministically: the fault-free run first, then the same kills (`launch/chaos.py`'s
`plan_kills` with the same seed, so the same victims at the same shares of the run) as crashes of the
learners (`failures.crashes`, each back after `--recovery-share` of the fault-free run's time, as long as a
real restart takes against a real run), and a syncer kill as every learner's link down for that long (the
simulator has no shard process to kill). Reported per config seed: the final loss of both, their ratio,
and what differs between them: tokens lost, tokens merged stale, rounds, learners per round, staleness.

    python benchmarks/churn_sim.py --seed 1 --config-seeds 0,1,2
    python benchmarks/churn_sim.py --seed 1 --one-kill    # each kill alone: what one restart costs

Writes JSON (default benchmarks/results/churn_sim.json): per run `loss_vs_clean`, `tokens_lost_share`,
`tokens_stale_share`, `rounds`, `participants_mean`, `stale_fraction`. Deterministic: it may run beside
other work, but it takes two CPU cores' worth of minutes per config seed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from diloco.config import load_config
from diloco.launch.chaos import Kill, plan_kills
from diloco.outputs import write_output
from diloco.results import RunResult
from diloco.sim.driver import simulate

RECOVERY_SHARE = 0.065
"""A real learner restart (the chaos command's 2 s delay and ~1.5 s to its first step) against its fault-free
run (54 s): `chaos-s39-final-k10s2-s1.json`."""


def failures_of(kills: list[Kill], learners: int, recovery_s: float) -> list[str]:
    """The kills as the simulator's failures: a learner's as its crash, a syncer's as every link down."""
    crashes = [f"{{learner={k.victim.split('-')[1]}, at_s={k.at_s:.4f}}}" for k in kills
               if k.victim.startswith("learner-")]
    outages = [f"{{learner={m}, at_s={k.at_s:.4f}, duration_s={recovery_s:.4f}}}" for k in kills
               if k.victim.startswith("syncer-") for m in range(learners)]
    return [f"failures.crashes=[{', '.join(crashes)}]", f"failures.outages=[{', '.join(outages)}]",
            f"failures.recovery_s={recovery_s:.4f}"]


def figures(run: RunResult) -> dict[str, Any]:
    stats = run.round_stats
    return {"final_eval_loss": run.final_eval_loss, "training_time_s": run.training_time_s, "rounds": run.rounds,
            "tokens": run.tokens, "tokens_lost_share": run.tokens_lost / run.tokens,
            "tokens_stale_share": run.tokens_stale / run.tokens,
            "participants_mean": stats.get("participants_mean"), "stale_fraction": stats.get("stale_fraction"),
            "participants_histogram": stats.get("participants_histogram"),
            "staleness_histogram": stats.get("staleness_histogram")}


def compare(overrides: list[str], config_seed: int, kills_of, recovery_share: float) -> list[dict[str, Any]]:
    """The fault-free run of one config seed, then each schedule `kills_of(clean_time_s)` gives."""
    settings = [*overrides, f"seed={config_seed}"]
    config = load_config(None, settings)
    clean = figures(simulate(config))
    recovery_s = recovery_share * clean["training_time_s"]
    rows = []
    for kills in kills_of(clean["training_time_s"]):
        faulty = figures(simulate(load_config(None, [*settings, *failures_of(kills, config.learners.count,
                                                                             recovery_s)])))
        rows.append({"config_seed": config_seed, "kills": [{"victim": k.victim, "at_s": k.at_s} for k in kills],
                     "recovery_s": recovery_s, "clean": clean, "faulty": faulty,
                     "loss_vs_clean": faulty["final_eval_loss"] / clean["final_eval_loss"] - 1})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1, help="the chaos command's --seed: which kills, when")
    p.add_argument("--kill-learners", type=int, default=10)
    p.add_argument("--kill-syncer", type=int, default=2)
    p.add_argument("--config-seeds", default="0", help="comma-separated run seeds (`seed`), each with its twin")
    p.add_argument("--recovery-share", type=float, default=RECOVERY_SHARE,
                   help="a restart's time as a share of the fault-free run's")
    p.add_argument("--one-kill", action="store_true", help="each learner kill of the schedule alone, not all")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    p.add_argument("--json", default="benchmarks/results/churn_sim.json")
    args = p.parse_args()
    learners = load_config(None, args.set).learners.count

    def kills_of(duration_s: float) -> list[list[Kill]]:
        kills = plan_kills(random.Random(args.seed), learners, 1, args.kill_learners, args.kill_syncer, duration_s)
        return [[k] for k in kills if k.victim.startswith("learner-")] if args.one_kill else [kills]

    rows = [row for s in args.config_seeds.split(",") for row in
            compare(args.set, int(s), kills_of, args.recovery_share)]
    print(f"{'seed':>4} {'kills':>28} {'clean':>7} {'faulty':>7} {'vs clean':>8} {'lost':>6} {'stale':>6} "
          f"{'stale clean':>11} {'rounds':>9} {'per round':>9}")
    for r in rows:
        what = (f"{r['kills'][0]['victim']} at {r['kills'][0]['at_s']:.1f} s" if len(r["kills"]) == 1
                else f"{len(r['kills'])} kills")
        c, f = r["clean"], r["faulty"]
        print(f"{r['config_seed']:>4} {what:>28} {c['final_eval_loss']:7.4f} {f['final_eval_loss']:7.4f} "
              f"{r['loss_vs_clean']:+8.2%} {f['tokens_lost_share']:6.2%} {f['tokens_stale_share']:6.2%} "
              f"{c['tokens_stale_share']:11.2%} {c['rounds']:>4}/{f['rounds']:<4} {f['participants_mean']:9.2f}")
    mean = statistics.mean(r["loss_vs_clean"] for r in rows)
    print(f"mean loss vs clean over {len(rows)} runs: {mean:+.2%}")
    write_output(Path(args.json), json.dumps({"seed": args.seed, "kill_learners": args.kill_learners,
                                              "kill_syncer": args.kill_syncer, "one_kill": args.one_kill,
                                              "overrides": args.set, "recovery_share": args.recovery_share,
                                              "mean_loss_vs_clean": mean, "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
