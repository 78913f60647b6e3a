"""What a learner's own checkpoints cost: tokens/s of the built-in learner with and without them.

One learner of the default model trains against a live shard in this process, alternately with
`failures.learner_checkpoints` on and off (`--pairs` times each, the order swapped every pair so that a
drift in the machine's load does not favour one side). Reported per arm: tokens/s (the learner's own
report: tokens over its wall time), and for the arm with checkpoints the checkpoints written and
skipped, the training thread's copy time per checkpoint against the step time, and the measured cost
the period is derived from (copies plus the time steps lost while a write ran beside them) against the
time the steps took (target ≤ 1%).

    python benchmarks/checkpoint_cost.py --pairs 3 --steps 200

Writes JSON (default benchmarks/results/checkpoint_cost.json). Its figures are times: run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from diloco.client.builtin_loop import run_learner
from diloco.config import load_config
from diloco.shard.server import ShardPlan, SyncerShard, serve


def one_run(steps: int, checkpoints: bool) -> dict[str, Any]:
    config = load_config(None, ["learners.count=1",
                                f"failures.learner_checkpoints={'true' if checkpoints else 'false'}"])
    config.train.tokens = steps * config.train.batch_size * config.train.seq_len
    shard = SyncerShard(config, ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0")
    shard.plan = ShardPlan(0, 1, (f"127.0.0.1:{port}",))
    try:
        with tempfile.TemporaryDirectory() as out:
            report = run_learner(config, syncer=f"127.0.0.1:{port}", learner=0, out=Path(out))
    finally:
        shard.stop()
        server.stop(0)
    step_s = report["busy_s"] / max(1, report["steps"])
    return {"checkpoints": checkpoints, "tokens_per_s": report["tokens_per_s"], "steps": report["steps"],
            "step_s": step_s, "written": report.get("checkpoints_written"),
            "skipped": report.get("checkpoints_skipped"), "copy_s": report.get("checkpoint_copy_s"),
            "copy_share": (report["checkpoint_copy_total_s"] / report["busy_s"]) if checkpoints else None,
            "write_s": report.get("checkpoint_write_s"), "period": report.get("checkpoint_period"),
            "cost_s": report.get("checkpoint_cost_s"),
            "measured_cost_share": (report["checkpoint_cost_total_s"] / report["busy_s"]) if checkpoints else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", default="benchmarks/results/checkpoint_cost.json")
    args = p.parse_args()
    one_run(min(args.steps, 20), True)  # warm-up: the first run in a process pays torch's first-use costs
    runs = []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        runs += [one_run(args.steps, on) for on in order]
    on = [r for r in runs if r["checkpoints"]]
    off = [r for r in runs if not r["checkpoints"]]
    rate_on = statistics.median(r["tokens_per_s"] for r in on)
    rate_off = statistics.median(r["tokens_per_s"] for r in off)
    copy_share = statistics.median(r["copy_share"] for r in on)
    measured = statistics.median(r["measured_cost_share"] for r in on)
    result = {"runs": runs, "tokens_per_s_with": rate_on, "tokens_per_s_without": rate_off,
              "cost": 1 - rate_on / rate_off, "copy_share_of_step_time": copy_share,
              "measured_cost_share": measured}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'arm':<22}{'tokens/s (median)':>20}{'checkpoints':>14}")
    print(f"{'without checkpoints':<22}{rate_off:>20,.0f}{'':>14}")
    print(f"{'with checkpoints':<22}{rate_on:>20,.0f}{statistics.median(r['written'] for r in on):>14}")
    print(f"cost: {result['cost']:+.2%} of tokens/s (target <= 1%); copies on the training thread: "
          f"{copy_share:.2%} of step time; copies and the steps' slowdown while written, as the learner "
          f"measured them: {measured:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
