"""A JAX learner next to PyTorch learners: one step side by side, mixed runs against all-torch runs, and
what syncing costs a JAX learner's throughput.

    python benchmarks/frameworks.py [--parts step,runs,throughput] [--strategies decoupled,diloco]
                                    [--steps N] [--repeats R] [--set key=value ...] [--out FILE]

All in one invocation, on this machine's CPU, fp32:
  step        the built-in GPT (the default config's shape) in torch and in Flax from the same Θ and batch:
              both losses, their relative difference (target ≤ 1e-5), and ‖Δθ_jax − Δθ_torch‖ / ‖Δθ_torch‖
              after one step of the learners' AdamW (clipping, decay on matrices, the schedule's first rate;
              target ≤ 1e-3).
  runs        per strategy, `diloco run` on the default config with learners.frameworks = torch ×4 and then
              torch, torch, jax, jax: final loss of Θ (mixed within 1% of all-torch is the target) and every
              token accounted (merged + stale + lost = trained, the learners' own counts summing to it).
  throughput  one JAX learner's jitted loop (the default config's model and batch) for --steps steps with
              a JaxLearner syncing to a `diloco syncer` process of its own (strategy decoupled, one learner, the
              default H and fragments), and the same compiled loop without syncing, alternated --repeats
              times; tokens/s of each, median ratio (target ≥ 0.95). The clock stops once the last step's
              params are ready on the device. Also per run: tensors whose device → host copy the staging
              thread made (pushes) and those copied on the training step (merges read them); the training
              thread's time in learner.step per step (wall and its own CPU) and the process's CPU per step,
              which other jobs on a shared host move far less than they move tokens/s; and the ratio that
              time alone gives, step / (step + learner.step), which leaves out what the link's threads
              and the syncer process take from the step's cores.

Prints a table per part and writes JSON (default benchmarks/results/frameworks.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from children import Processes, diloco, tail  # benchmarks/children.py
from syncer_process import syncer_process  # benchmarks/syncer_process.py

LOSS_TARGET, DELTA_TARGET, RUN_TARGET, THROUGHPUT_TARGET = 1e-5, 1e-3, 0.01, 0.95
MIXED = ["torch", "torch", "jax", "jax"]


def step_part(config: Any) -> dict[str, Any]:
    from diloco.jax.equivalence import compare_one_step
    from diloco.materials import prepare

    cfg = prepare(config).model.cfg
    result = compare_one_step(cfg, config.train, seed=config.seed).as_dict()
    result.update(loss_ok=result["loss_rel_diff"] <= LOSS_TARGET, delta_ok=result["delta_rel_diff"] <= DELTA_TARGET)
    return result


def one_run(procs: Processes, work: Path, name: str, sets: list[str]) -> dict[str, Any]:
    out = work / name
    log = work / f"{name}.log"
    proc = procs.start(diloco("run", "-q", "--out", str(out), *[a for s in sets for a in ("--set", s)]), log)
    if proc.wait() != 0:
        raise SystemExit(f"diloco run {name} failed:\n{tail(log)}")
    summary = json.loads((out / "summary.json").read_text())
    reports = [json.loads(p.read_text()) for p in sorted((out / "learners").glob("learner-*.json"))]
    accounted = summary["tokens_merged"] + summary["tokens_stale"] + summary["tokens_lost"]
    return {"final_eval_loss": summary["final_eval_loss"], "tokens": summary["tokens"],
            "tokens_merged": summary["tokens_merged"], "tokens_stale": summary["tokens_stale"],
            "tokens_lost": summary["tokens_lost"], "learner_tokens": [r["tokens"] for r in reports],
            "frameworks": [r.get("framework", "torch") for r in reports],
            "every_token_accounted": accounted == summary["tokens"] == sum(r["tokens"] for r in reports)
            and summary.get("duplicates", 0) == 0,
            "training_time_s": summary["training_time_s"]}


def runs_part(strategies: list[str], sets: list[str]) -> dict[str, Any]:
    procs = Processes()
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="frameworks-") as tmp:
            for strategy in strategies:
                base = [f"strategy={strategy}", *sets]
                torch_run = one_run(procs, Path(tmp), f"{strategy}-torch", base)
                mixed = one_run(procs, Path(tmp), f"{strategy}-mixed", [*base, f"learners.frameworks={json.dumps(MIXED)}"])
                rel = abs(mixed["final_eval_loss"] - torch_run["final_eval_loss"]) / torch_run["final_eval_loss"]
                results[strategy] = {"all_torch": torch_run, "mixed": mixed, "loss_rel_diff": rel,
                                     "loss_ok": rel <= RUN_TARGET,
                                     "tokens_ok": torch_run["every_token_accounted"] and mixed["every_token_accounted"]}
    finally:
        procs.stop_all()
    return results


def throughput_part(config: Any, sets: list[str], steps: int, repeats: int) -> dict[str, Any]:
    import jax
    import numpy as np

    from diloco.data import ShardSampler
    from diloco.jax.equivalence import flax_params_for
    from diloco.jax.flax_gpt import FlaxGPT
    from diloco.jax.jax_learner import JaxLearner
    from diloco.jax.jax_training import JaxReplica
    from diloco.materials import prepare
    from diloco.fragments import embedding_names

    t = config.train
    materials = prepare(config)
    model = FlaxGPT(materials.model.cfg)
    theta = {n: p.detach() for n, p in materials.model.named_parameters()}
    initial = flax_params_for(model, theta)
    replica = JaxReplica(initial, lambda p, x, y: model.apply({"params": p}, x, y), t,
                         ShardSampler(materials.corpus.train, learner=0, learners=1, seq_len=t.seq_len,
                                      batch_size=t.batch_size, seed=config.seed), planned_steps=steps)
    replica.compile()

    def loop(learner: JaxLearner | None) -> tuple[float, dict[str, float]]:
        """tokens/s, and what the contention on this host does not change: the training thread's time in
        `learner.step` (wall and its own CPU) and the whole process's CPU, per step."""
        replica.params, replica.opt_state, replica.steps = (learner.params if learner else initial), \
            replica.jitted.optimizer.init(initial), 0
        for _ in range(3):  # warm: the first steps' allocations
            replica.train_step()
        in_step = in_step_cpu = 0.0
        began, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            tokens = replica.train_step()
            if learner is not None:
                wall, own = time.perf_counter(), time.thread_time()
                replica.params = learner.step(replica.params, tokens)
                in_step, in_step_cpu = in_step + time.perf_counter() - wall, in_step_cpu + time.thread_time() - own
        jax.block_until_ready(replica.params)
        elapsed = time.perf_counter() - began
        per_step = {"process_cpu_ms_per_step": 1e3 * (time.process_time() - cpu) / steps,
                    "sync_ms_per_step": 1e3 * in_step / steps, "sync_cpu_ms_per_step": 1e3 * in_step_cpu / steps}
        return steps * t.batch_size * t.seq_len / elapsed, per_step

    def synced() -> tuple[float, dict[str, float]]:
        with syncer_process([*sets, "strategy=decoupled", "learners.count=1", f"train.tokens={10 ** 12}"]) as port:
            learner = JaxLearner(initial, syncer=f"127.0.0.1:{port}", order=list(theta),
                                 embeddings=sorted(embedding_names(materials.model)))
            rate, per_step = loop(learner)
            report = learner.close()
            mirror = learner.mirror
            return rate, {"merges": report["merges"], "pushes": report["pushes"], "staged_to_host": mirror.staged,
                          "copied_to_host_on_step": mirror.copied_on_step, **per_step}

    rows = []
    for _ in range(repeats):
        alone, alone_cpu = loop(None)
        rate, counts = synced()
        rows.append({"tokens_per_s_without_sync": alone, "tokens_per_s_with_sync": rate, "ratio": rate / alone,
                     "process_cpu_ms_per_step_without_sync": alone_cpu["process_cpu_ms_per_step"], **counts})
    ratio = statistics.median(r["ratio"] for r in rows)
    sync_ms = statistics.median(r["sync_ms_per_step"] for r in rows)
    step_ms = statistics.median(1e3 * t.batch_size * t.seq_len / r["tokens_per_s_without_sync"] for r in rows)
    return {"steps": steps, "repeats": rows, "median_ratio": ratio, "ok": ratio >= THROUGHPUT_TARGET,
            "median_sync_ms_per_step": sync_ms, "median_step_ms_without_sync": step_ms,
            "ratio_from_training_thread": step_ms / (step_ms + sync_ms),
            "tokens_per_step": t.batch_size * t.seq_len, "H": config.outer.H, "fragments": config.outer.fragments}


def show(console: Console, result: dict[str, Any]) -> None:
    if "step" in result:
        s = result["step"]
        table = Table(title="one step, same Θ and batch (fp32, CPU)")
        for col in ("loss torch", "loss jax", "loss rel diff", "‖Δθ_jax − Δθ_torch‖/‖Δθ_torch‖"):
            table.add_column(col)
        table.add_row(f"{s['loss_torch']:.7f}", f"{s['loss_jax']:.7f}", f"{s['loss_rel_diff']:.2e}",
                      f"{s['delta_rel_diff']:.2e}")
        console.print(table)
    if "runs" in result:
        table = Table(title="diloco run: all torch vs torch ×2 + jax ×2 (same invocation)")
        for col in ("strategy", "loss all-torch", "loss mixed", "rel diff", "tokens torch / mixed", "accounted"):
            table.add_column(col)
        for strategy, r in result["runs"].items():
            table.add_row(strategy, f"{r['all_torch']['final_eval_loss']:.4f}", f"{r['mixed']['final_eval_loss']:.4f}",
                          f"{r['loss_rel_diff']:.2%}", f"{r['all_torch']['tokens']:,} / {r['mixed']['tokens']:,}",
                          str(r["tokens_ok"]))
        console.print(table)
    if "throughput" in result:
        table = Table(title=f"JAX learner tokens/s, {result['throughput']['steps']} steps")
        for col in ("without sync", "with sync", "ratio", "merges", "tensors staged / copied on the step",
                    "learner.step ms (CPU) per step", "process CPU ms/step off / on"):
            table.add_column(col)
        for r in result["throughput"]["repeats"]:
            table.add_row(f"{r['tokens_per_s_without_sync']:,.0f}", f"{r['tokens_per_s_with_sync']:,.0f}",
                          f"{r['ratio']:.3f}", str(r["merges"]),
                          f"{r['staged_to_host']} / {r['copied_to_host_on_step']}",
                          f"{r['sync_ms_per_step']:.2f} ({r['sync_cpu_ms_per_step']:.2f})",
                          f"{r['process_cpu_ms_per_step_without_sync']:.1f} / {r['process_cpu_ms_per_step']:.1f}")
        console.print(table)
        tp = result["throughput"]
        console.print(f"median ratio {tp['median_ratio']:.3f} (target ≥ {THROUGHPUT_TARGET}); from the training "
                      f"thread's time in learner.step alone ({tp['median_sync_ms_per_step']:.2f} ms on a "
                      f"{tp['median_step_ms_without_sync']:.1f} ms step): {tp['ratio_from_training_thread']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="step,runs,throughput")
    p.add_argument("--strategies", default="decoupled,diloco")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="benchmarks/results/frameworks.json")
    args = p.parse_args()
    from diloco.config import load_config

    config = load_config(None, args.set)
    parts = args.parts.split(",")
    result: dict[str, Any] = {"settings": {"set": args.set, "parts": parts}}
    if "step" in parts:
        result["step"] = step_part(config)
    if "throughput" in parts:
        result["throughput"] = throughput_part(config, args.set, args.steps, args.repeats)
    if "runs" in parts:
        result["runs"] = runs_part(args.strategies.split(","), args.set)
    show(Console(), result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
