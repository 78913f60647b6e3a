"""Sharded learners (FSDP2, HSDP) on this machine (CPU, Gloo): memory, speed, checkpoint cost, join time,
whole-run equivalence with DDP learners, and a mixed run.

    python benchmarks/sharded.py [--steps N] [--width W] [--layers L]
                                 [--parts memory,speed,checkpoint,equal,mixed] [--worlds 2,4] [--meta-init]
                                 [--repeats R] [--speed-h 8,50] [--syncer-process] [--out FILE]

(the 101M-parameter memory measurement: --parts memory --width 1024 --layers 8 --steps 8 --meta-init)

Every learner rank is a benchmarks/sharded_worker.py process; each run's syncer is one shard served in
this process (or its own process: --syncer-process). Parts, all in one invocation:
  memory  one FSDP learner of W = 2 and W = 4 ranks, a GPT of ≥ 20M parameters in 8 fragments (decoupled):
          per rank, the sync boundary's staging peak (the gathered tensors alive at once at rank 0, per
          phase: seeding the shard, training, leaving; answers are scattered into buffers of one rank's
          rows), the RSS growth after the first step (everything
          syncing holds on the host, the client link's encoded pushes and decoded answers included), and the
          anchors (each rank's rows only), the peak (VmHWM) of rank 0 and of the other ranks, and the
          resident memory by stage. Target: staging ≤ 1.5 × the largest fragment in fp32; the per-rank
          peak falls as W grows. --meta-init: each rank builds the model on the meta device and fills
          its own rows only.
          It also times the W = 2 learner against the same loop without syncing, one run each (below).
  speed   the same W = 2 FSDP loop with syncing and without it (no Learner at all), --repeats runs of each
          taking turns: tokens/s ratio of the medians, target ≥ 0.95 (issue 28), at each --speed-h (default
          8 and 50: with 8 fragments, a push every step or, at the config's default H, one every 6.25 steps;
          give --steps ≥ 48 so that H = 50 reaches its steady rate), and the ranks' CPU per push or answer
          (`cpu_s_per_sync_message`: what syncing costs at any H and step time).
  checkpoint  the synced W = 2 FSDP learner with its own-progress checkpoints on (as the built-in learner
          keeps them: DCP async_save every rank at its cost-derived period; pushes go at once) and off,
          --repeats runs each taking turns: tokens/s of the medians and
          checkpoint_cost_fraction = 1 − on / off, target ≤ 0.01 (issue 31); with each run's period (from
          the copy) and the cost of its checkpoints as the learner measured them (the copy plus what the
          steps lost while the write ran beside them) over its training time. --checkpoint-every: the
          longest period (failures.checkpoint_every, default 25).
  speed and checkpoint also give what wall time cannot show on a shared host: the learner ranks' CPU seconds
          per token (every thread of each rank) with and without syncing / checkpoints, and the shard's CPU.
  equal   2 learners of 2 ranks each, FSDP against DDP, synchronous DiLoCo, Decoupled DiLoCo, and Decoupled
          DiLoCo with quorum = all learners (round membership not left to timing): the final Θ's loss on
          held-out batches; target |relative difference| ≤ 1e-3; and DDP against DDP again in the same
          invocation, the run-to-run noise each configuration has without any sharding.
  mixed   a 2-rank FSDP learner, a 2-rank DDP learner and a 1-process learner against one shard:
          merged + stale + lost = trained for each (`core/accounting.learner_tokens`), with nothing lost or
          counted twice (every learner leaves cleanly).
--syncer-process: the shard of memory, speed and checkpoint runs is a `diloco syncer` process of its own
with one arithmetic thread (benchmarks/syncer_process.py), as gpu.py and frameworks.py run it; else it is
served in this process (equal and mixed always: they read its Θ and ledger).

Prints a table and writes JSON (default benchmarks/results/sharded.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from children import Processes, tail  # benchmarks/children.py
from diloco.config import load_config
from diloco.core.accounting import learner_tokens
from diloco.models.gpt import GPT, GPTConfig
from diloco.shard.server import ShardPlan, SyncerShard, serve
from sharded_table import show  # benchmarks/sharded_table.py
from sharded_worker import VOCAB, batch
from syncer_process import syncer_process  # benchmarks/syncer_process.py

WORKER = Path(__file__).parent / "sharded_worker.py"
MEMORY_TARGET, SPEED_TARGET, EQUAL_TARGET = 1.5, 0.95, 1e-3
RUN_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def syncer_settings(learners: int, strategy: str, fragments: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [f"learners.count={learners}", f"strategy={strategy}", f"outer.H={max(4, fragments)}",
            f"outer.fragments={fragments}", "train.tokens=1000000000", "learners.speeds=[]", *extra]


def start_syncer(learners: int, strategy: str, fragments: int, extra: tuple[str, ...] = ()
                 ) -> tuple[Any, SyncerShard, str]:
    config = load_config(None, syncer_settings(learners, strategy, fragments, extra))
    shard = SyncerShard(config, ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0", workers=16)
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    return server, shard, address


def start_learner(procs: Processes, out: Path, learner: int, world: int, sharding: str, args: argparse.Namespace,
                  syncer: str | None, width: int, layers: int, meta_init: bool = False,
                  checkpoints: bool = False) -> list[subprocess.Popen]:
    port, started = free_port(), []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        sync = ["--syncer", syncer] if syncer else ["--no-sync"]
        argv = [sys.executable, str(WORKER), *sync, "--id", str(learner), "--sharding", sharding, "--width", str(width),
                "--layers", str(layers), "--steps", str(args.steps), "--out", str(out),
                *(["--meta-init"] if meta_init else []),
                *(["--checkpoints", "--checkpoint-every", str(args.checkpoint_every)] if checkpoints else [])]
        started.append(procs.start(argv, out / f"learner-{learner}-rank-{rank}.log", env=env))
    return started


def wait_all(procs: Processes, started: list[subprocess.Popen], out: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for proc in started:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            procs.stop_all()
            logs = "\n".join(tail(log, 20) for log in sorted(out.glob("*.log")))
            raise SystemExit(f"a learner rank exited with {code}:\n{logs}")


def run(learners: list[tuple[int, str]], strategy: str, fragments: int, args: argparse.Namespace, width: int,
        layers: int, sync: bool = True, extra: tuple[str, ...] = (), meta_init: bool = False,
        checkpoints: bool = False, served_here: bool = False) -> dict[str, Any]:
    """One run: learners as (ranks, sharding); returns every rank's report, the shard's, and Θ's loss (the
    last two None when the shard is a process of its own: `--syncer-process`, unless `served_here`)."""
    if sync and args.syncer_process and not served_here:
        usage: dict[str, float] = {}
        with syncer_process(syncer_settings(len(learners), strategy, fragments, extra), usage=usage) as port:
            reports = train(learners, args, width, layers, f"127.0.0.1:{port}", meta_init, checkpoints)
        return {**reports, "shard_cpu_s": usage["cpu_s"]}
    server, shard, address = start_syncer(len(learners), strategy, fragments, extra) if sync else (None, None, None)
    try:
        cpu_began = time.process_time()  # this process: the shard (its server's threads), and waiting on the ranks
        reports = train(learners, args, width, layers, address, meta_init, checkpoints)
        shard_cpu_s = time.process_time() - cpu_began if sync else 0.0
        theta = dict(shard.core.theta) if shard is not None else None
        shard_report = shard.report() if shard is not None else None
    finally:
        if server is not None:
            server.stop(0)
            shard.stop()
    return {**reports, "shard": shard_report, "shard_cpu_s": shard_cpu_s,
            "loss": loss_of(theta, width, layers) if theta else None}


def train(learners: list[tuple[int, str]], args: argparse.Namespace, width: int, layers: int, address: str | None,
          meta_init: bool, checkpoints: bool) -> dict[str, Any]:
    """Every learner's ranks trained against `address` (None: no syncing) to the end; their reports."""
    out = Path(tempfile.mkdtemp(prefix="sharded-"))
    procs = Processes()
    try:
        started = [p for m, (world, sharding) in enumerate(learners)
                   for p in start_learner(procs, out, m, world, sharding, args, address, width, layers, meta_init,
                                          checkpoints)]
        wait_all(procs, started, out)
    finally:
        procs.stop_all()
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("learner-*-rank-*.json"))]
    shutil.rmtree(out, ignore_errors=True)  # checkpoints and parameters: hundreds of MB a run
    return {"reports": reports, "shard": None, "loss": None}


def loss_of(theta: dict[str, torch.Tensor], width: int, layers: int, seq: int = 32) -> float:
    """Held-out loss of `theta` on 8 batches of the workers' token stream (another seed)."""
    model = GPT(GPTConfig(vocab_size=VOCAB, context=seq, layers=layers, width=width, heads=4, dropout=0.0))
    model.load_state_dict({n: t.to(torch.float32) for n, t in theta.items()}, strict=False)
    generator = torch.Generator().manual_seed(424242)
    with torch.no_grad():
        losses = [float(model(x[:, :-1], x[:, 1:])) for x in (batch(generator, 8, seq) for _ in range(8))]
    return sum(losses) / len(losses)


def memory_and_speed(args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for world in args.worlds:
        r = run([(world, "fsdp")], "decoupled", 8, args, args.width, args.layers, meta_init=args.meta_init)
        reports = r["reports"]
        others = [x for x in reports if x["rank"] != 0]
        fragment = reports[0]["largest_fragment_bytes"]
        rows[f"W{world}"] = {
            "world": world, "parameters": reports[0]["parameters"], "fragments": reports[0]["fragments"],
            "largest_fragment_bytes": fragment,
            "staging_peak_bytes": max(x["peak_staging_bytes"] for x in reports),
            "staging_over_fragment": max(x["peak_staging_bytes"] for x in reports) / fragment,
            "gathered_peak_rank0_bytes": reports[0].get("peak_gathered_bytes", {}),
            "rss_growth_max_bytes": max(x["rss_growth_bytes"] for x in reports),
            "rss_growth_over_fragment": max(x["rss_growth_bytes"] for x in reports) / fragment,
            "peak_rss_max_bytes": max(x["peak_rss_bytes"] for x in reports),
            "peak_rss_rank0_bytes": reports[0]["peak_rss_bytes"],
            "peak_rss_joined_rank0_bytes": reports[0].get("peak_rss_joined_bytes"),
            "peak_rss_other_ranks_bytes": max(x["peak_rss_bytes"] for x in others),
            "rss_stages_rank0": reports[0].get("rss_bytes"), "rss_stages_rank1": others[0].get("rss_bytes"),
            "meta_init": reports[0].get("meta_init", False),
            "anchor_bytes_per_rank": max(x["anchor_bytes"] for x in reports),
            "bytes_between_ranks_rank0": reports[0]["bytes_between_ranks"], "bytes_up": reports[0]["bytes_up"],
            "bytes_down": reports[0]["bytes_down"], "join_s": max(x["join_s"] for x in reports),
            "tokens_per_s_synced": reports[0]["tokens_per_s"], "merges": reports[0]["merges"],
            "shard_answers_sent": (r["shard"] or {}).get("answers_sent"),
            "shard_answer_bytes_sent": (r["shard"] or {}).get("answer_bytes_sent")}
        if world == 2:
            off = run([(2, "fsdp")], "decoupled", 8, args, args.width, args.layers, sync=False,
                      meta_init=args.meta_init)["reports"]
            rows["W2"]["tokens_per_s_unsynced"] = off[0]["tokens_per_s"]
            rows["W2"]["speed_ratio"] = rows["W2"]["tokens_per_s_synced"] / off[0]["tokens_per_s"]
    return rows


def alternated(args: argparse.Namespace, variants: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each variant (`run`'s keyword arguments) of one W = 2 FSDP learner run `--repeats` times, the
    variants taking turns (first place rotating) so that a busy spell of the host falls on each alike;
    per variant, rank 0's report of each run."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(args.repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            r = run([(2, "fsdp")], "decoupled", 8, args, args.width, args.layers, meta_init=args.meta_init,
                    **variants[name])
            ranks = r["reports"]
            runs[name].append({**next(x for x in ranks if x["rank"] == 0), "shard_cpu_s": r.get("shard_cpu_s", 0.0),
                               "learner_cpu_s": sum(x["train_cpu_s"] for x in ranks),
                               "learner_tokens": sum(x["tokens"] for x in ranks),
                               "threads": {f"rank {x['rank']} {name}": cpu
                                           for x in ranks for name, cpu in x.get("train_cpu_s_by_thread", {}).items()}})
    return runs


def cpu_figures(runs: list[dict[str, Any]], baseline: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """What wall time cannot show on a shared host: the learner ranks' CPU seconds per token (every thread of
    each rank) in `runs` against `baseline` (medians; `name`_cpu_ratio = baseline / runs, so ≥ 1 - x means
    `runs` cost the ranks at most x more CPU per token), and the shard's CPU beside them."""
    per_token = [r["learner_cpu_s"] / r["learner_tokens"] for r in runs]
    base = [r["learner_cpu_s"] / r["learner_tokens"] for r in baseline]
    return {f"{name}_cpu_ratio": statistics.median(base) / statistics.median(per_token),
            f"learner_cpu_us_per_token_{name}": [1e6 * v for v in per_token],
            "learner_cpu_us_per_token_baseline": [1e6 * v for v in base],
            "shard_cpu_s": [r["shard_cpu_s"] for r in runs], "learner_cpu_s": [r["learner_cpu_s"] for r in runs]}


def median_tokens_per_s(reports: list[dict[str, Any]]) -> float:
    return statistics.median(r["tokens_per_s"] for r in reports)


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 28: the synced W = 2 FSDP learner's tokens/s against the same loop with no Learner at all, at each
    `--speed-h` (H = 8 with 8 fragments pushes a fragment every step; the config's default H one every
    H / 8 steps), and what one sync message (a push or an answer) costs the ranks in CPU."""
    variants: dict[str, dict[str, Any]] = {"unsynced": {"sync": False}}
    variants.update({f"H{h}": {"extra": (f"outer.H={h}",)} for h in args.speed_h})
    runs = alternated(args, variants)
    unsynced = median_tokens_per_s(runs["unsynced"])
    rows = {}
    for h in args.speed_h:
        synced = runs[f"H{h}"]
        rows[str(h)] = {"tokens_per_s_synced": median_tokens_per_s(synced), "tokens_per_s_unsynced": unsynced,
                        "speed_ratio": median_tokens_per_s(synced) / unsynced,
                        "runs_synced": [r["tokens_per_s"] for r in synced],
                        "merges": [r["merges"] for r in synced], "pushes": [r["pushes"] for r in synced],
                        "merges_trained": [r["merges_trained"] for r in synced],
                        "pushes_trained": [r["pushes_trained"] for r in synced],
                        "cpu_s_per_sync_message": cpu_per_message(synced, runs["unsynced"]),
                        "thread_cpu_s": thread_medians(synced),
                        **cpu_figures(synced, runs["unsynced"], "synced")}
    return {"runs_unsynced": [r["tokens_per_s"] for r in runs["unsynced"]],
            "thread_cpu_s_unsynced": thread_medians(runs["unsynced"]), "by_H": rows}


def thread_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per rank and thread name, the median over runs of its CPU seconds in the training steps (0 in a run
    that had no such thread)."""
    names = sorted({name for r in runs for name in r["threads"]})
    return {name: statistics.median(r["threads"].get(name, 0.0) for r in runs) for name in names}


def cpu_per_message(synced: list[dict[str, Any]], unsynced: list[dict[str, Any]]) -> float:
    """The ranks' CPU seconds that syncing added per push or answer (median over runs): each synced run's CPU
    above what its tokens cost without syncing (the unsynced runs' median per token), over its messages."""
    base = statistics.median(r["learner_cpu_s"] / r["learner_tokens"] for r in unsynced)
    return statistics.median((r["learner_cpu_s"] - base * r["learner_tokens"])
                             / max(1, r["pushes_trained"] + r["merges_trained"]) for r in synced)


def checkpoint_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 31: the synced W = 2 FSDP learner's tokens/s with its own-progress checkpoints on and off
    (pushes never wait for a checkpoint: `core/own_progress.py`)."""
    runs = alternated(args, {"on": {"checkpoints": True}, "off": {}})
    on, off = median_tokens_per_s(runs["on"]), median_tokens_per_s(runs["off"])
    return {"tokens_per_s_checkpoints_on": on, "tokens_per_s_checkpoints_off": off,
            "checkpoint_cost_fraction": 1 - on / off,
            "runs_on": [r["tokens_per_s"] for r in runs["on"]], "runs_off": [r["tokens_per_s"] for r in runs["off"]],
            "checkpoints_written": [r["checkpoints_written"] for r in runs["on"]],
            "checkpoints_skipped": [r["checkpoints_skipped"] for r in runs["on"]],
            "checkpoint_copy_total_s": [r["checkpoint_copy_total_s"] for r in runs["on"]],
            "checkpoint_cost_s": [r["checkpoint_cost_s"] for r in runs["on"]],
            "checkpoint_period": [r["checkpoint_period"] for r in runs["on"]],
            "measured_cost_share": [r["checkpoint_cost_total_s"] / r["train_s"] for r in runs["on"]],
            "checkpoint_every": args.checkpoint_every,
            "train_s_on": [r["train_s"] for r in runs["on"]], "train_s_off": [r["train_s"] for r in runs["off"]],
            "pushes_on": [r["pushes"] for r in runs["on"]], "pushes_off": [r["pushes"] for r in runs["off"]],
            **cpu_figures(runs["on"], runs["off"], "checkpoints")}


EQUIVALENCE_RUNS = {
    "diloco": ("diloco", ()),
    "decoupled": ("decoupled", ()),
    "decoupled_quorum_all": ("decoupled", ("outer.quorum=0", "outer.grace=0")),
    "decoupled_reproducible": ("decoupled", ("outer.reproducible=true",)),
}
"""Synchronous DiLoCo; Decoupled DiLoCo as configured by default (a round takes the pushes that have
arrived: which round a push joins is timing); and Decoupled DiLoCo whose every round waits for every
learner (quorum = all), so round membership no longer depends on timing (when an answer lands still does);
and Decoupled DiLoCo with nothing left to timing (`outer.reproducible`: answers merged exactly τ steps
after sending, pushes on the step schedule, equal shares), where only the sharding's arithmetic can differ."""


def equivalence(args: argparse.Namespace) -> dict[str, Any]:
    """Per configuration: 2 learners × 2 ranks under FSDP, then under DDP twice. FSDP vs DDP is the target;
    DDP vs DDP, in the same invocation, is the run-to-run noise of the configuration itself."""
    rows = {}
    for name, (strategy, extra) in EQUIVALENCE_RUNS.items():
        losses = {s: run([(2, s.split("-")[0])] * 2, strategy, 3, args, 64, 2, extra=extra, served_here=True)["loss"]
                  for s in ("fsdp", "ddp", "ddp-again")}
        rows[name] = {"fsdp_loss": losses["fsdp"], "ddp_loss": losses["ddp"], "ddp_again_loss": losses["ddp-again"],
                      "relative_difference": abs(losses["fsdp"] - losses["ddp"]) / losses["ddp"],
                      "ddp_noise": abs(losses["ddp-again"] - losses["ddp"]) / losses["ddp"]}
    return rows


def mixed(args: argparse.Namespace) -> dict[str, Any]:
    r = run([(2, "fsdp"), (2, "ddp"), (1, "ddp")], "decoupled", 3, args, 64, 2, served_here=True)
    numel = {int(p): n for p, n in r["shard"]["fragment_numel"].items()} if "fragment_numel" in r["shard"] else None
    per_learner = {}
    for m in range(3):
        ranks = [x for x in r["reports"] if x["learner"] == m]
        trained = sum(x["tokens"] for x in ranks)
        entry = r["shard"]["ledger"].get(m, {})
        merged, stale = entry.get("merged", {}), entry.get("stale", {})
        sizes = numel or {p: 1 for p in set(merged) | set(stale)}
        split = learner_tokens(trained, merged, stale, sizes)
        # Every learner left cleanly: each token it trained was merged (on time or stale) exactly once.
        per_learner[m] = {**split, "accounted": split["lost"] == 0 and split["counted_twice"] == 0
                          and abs(split["merged"] + split["stale"] - trained) < 1e-6}
    return {"learners": per_learner, "all_accounted": all(v["accounted"] for v in per_learner.values())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--width", type=int, default=576)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--parts", default="memory,equal,mixed")
    p.add_argument("--worlds", default="2,4", type=lambda text: [int(w) for w in text.split(",")],
                   help="memory: the learner sizes measured")
    p.add_argument("--meta-init", action="store_true",
                   help="memory: build each rank's model on the meta device and fill its own rows only")
    p.add_argument("--repeats", type=int, default=3, help="speed, checkpoint: runs of each variant (medians)")
    p.add_argument("--speed-h", default="8,50", type=lambda text: [int(h) for h in text.split(",")],
                   help="speed: the outer H of each synced variant (8 fragments: H = 8 pushes one every step; 50 is "
                        "the config's default)")
    p.add_argument("--checkpoint-every", type=int, default=25,
                   help="checkpoint: the longest checkpoint period in steps (failures.checkpoint_every)")
    p.add_argument("--syncer-process", action="store_true",
                   help="memory, speed, checkpoint: the shard in a `diloco syncer` process of its own with one "
                        "arithmetic thread (benchmarks/syncer_process.py), not in this one")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sharded.json")
    args = p.parse_args()
    results: dict[str, Any] = {"steps": args.steps, "width": args.width, "layers": args.layers,
                               "meta_init": args.meta_init, "repeats": args.repeats,
                               "syncer_process": args.syncer_process, "command": " ".join(sys.argv)}
    parts = args.parts.split(",")
    if "memory" in parts:
        results["memory_speed"] = memory_and_speed(args)
    if "speed" in parts:
        results["speed"] = speed(args)
    if "checkpoint" in parts:
        results["checkpoint"] = checkpoint_cost(args)
    if "equal" in parts:
        results["equivalence"] = equivalence(args)
    if "mixed" in parts:
        results["mixed"] = mixed(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    show(results)


if __name__ == "__main__":
    main()
