"""One rank of a learner for benchmarks/sharded.py (Gloo, CPU; RANK, WORLD_SIZE, MASTER_* in the
environment). It builds the built-in GPT at --width × --layers, holds it as --sharding says, joins
--syncer (or trains without syncing: --no-sync), trains --steps inner steps on seeded tokens (`batch`) and
writes OUT/learner-ID-rank-R.json: tokens/s over its training steps and the CPU seconds they took, join seconds, its memory (peak RSS,
RSS growth after the first sync, the sync boundary's staging peak, anchors), bytes over the learner's
group, and rank 0 its final parameters (params-ID.pt) for the run's final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from diloco.client.learner_client import Learner
from diloco.client.param_shards import shard_model
from diloco.client.sharded_build import build_sharded
from diloco.client.sharded_checkpoints import ShardedWriter
from diloco.models.gpt import GPT, GPTConfig

VOCAB = 256


def batch(generator: torch.Generator, size: int, seq: int) -> torch.Tensor:
    """Learnable tokens: each next token is 7·previous + 3 (mod VOCAB), or random one time in ten."""
    x = torch.empty((size, seq + 1), dtype=torch.int64)
    x[:, 0] = torch.randint(0, VOCAB, (size,), generator=generator)
    for t in range(seq):
        noise = torch.randint(0, VOCAB, (size,), generator=generator)
        keep = torch.rand(size, generator=generator) < 0.9
        x[:, t + 1] = torch.where(keep, (7 * x[:, t] + 3) % VOCAB, noise)
    return x


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name: a Python thread's own name, any other
    (gRPC's, Gloo's, OpenMP's) the kernel's `comm`; threads of one name summed."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(int(task.name), comm).rstrip("0123456789-_")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def cpu_by_thread(before: dict[str, float], after: dict[str, float], total_s: float) -> dict[str, float]:
    """Each thread name's CPU seconds between two `thread_cpu_s` readings, and what threads that ended
    meanwhile took ("ended": the process's total less the rest)."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    spent = {name: s for name, s in spent.items() if s > 0}
    spent["ended"] = max(0.0, total_s - sum(spent.values()))
    return spent


def peak_rss_bytes() -> int:
    """This process's own high-water mark (VmHWM): getrusage's ru_maxrss starts a child at its parent's
    peak (Linux keeps it across fork and exec), so every rank would report at least this benchmark's
    process, which holds the syncer's state."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class _Replica:
    """What `ShardedWriter` saves besides the model: the step count, the inner optimizer, a data position."""

    def __init__(self, optimizer: torch.optim.Optimizer, learner: int) -> None:
        self.steps, self.optimizer, self.sampler = 0, optimizer, self
        self.learner = learner

    def state_dict(self) -> dict[str, int]:
        return {"learner": self.learner, "epoch": 0, "index": self.steps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--syncer")
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--sharding", default="fsdp")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoints", action="store_true",
                   help="sharded, syncing: own-progress checkpoints as the built-in learner keeps them")
    p.add_argument("--checkpoint-every", type=int, default=25,
                   help="the longest checkpoint period in steps (failures.checkpoint_every)")
    p.add_argument("--meta-init", action="store_true",
                   help="sharded: build on the meta device, fill own rows only (client/sharded_build.py)")
    args = p.parse_args()
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    rss = {"start": rss_bytes()}
    meta = args.meta_init and distributed and args.sharding != "ddp"

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=VOCAB, context=args.seq, layers=args.layers, width=args.width, heads=4,
                             dropout=0.0))

    # --meta-init: built as the built-in learner builds a sharded model, each rank filling only its rows.
    model = build_sharded(build, args.sharding, world) if meta else build()
    parameters = sum(t.numel() for t in model.parameters())
    model = shard_model(model, args.sharding, world) if distributed and not meta else model
    rss["model"] = rss_bytes()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    began = time.monotonic()
    learner = None if args.no_sync else Learner(model, optimizer, syncer=args.syncer, learner=args.id,
                                                connect_timeout_s=60, tokens_per_step=args.batch * args.seq)
    join_s = time.monotonic() - began
    rss["joined"] = rss_bytes()
    joined_peak = peak_rss_bytes()  # the high-water mark through joining (seeding the shard included)
    generator = torch.Generator().manual_seed(1000 * args.id + rank)
    replica = _Replica(optimizer, args.id)
    sharded = distributed and args.sharding != "ddp"
    writer = ShardedWriter(args.out / f"learner-{args.id}.dcp", None, learner, args.checkpoint_every) \
        if args.checkpoints and learner is not None and sharded else None
    rss_floor, step_times = 0, []
    started, cpu_started, threads_started = time.monotonic(), time.process_time(), thread_cpu_s()
    for step in range(args.steps):
        t0 = time.monotonic()
        x = batch(generator, args.batch, args.seq)
        model(x[:, :-1], x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        replica.steps += 1
        if learner is not None:
            learner.step(tokens=args.batch * args.seq)
            if learner.should_stop:
                break
        if writer is not None:  # every rank, at the same steps (as the built-in learner's loop)
            writer.maybe_save(model, replica, time.monotonic() - t0)
        step_times.append(time.monotonic() - t0)
        if step == 0:
            rss_floor = rss_bytes()  # model, optimizer state and anchors all exist: what grows now is syncing's
    train_s = time.monotonic() - started
    train_cpu_s = time.process_time() - cpu_started  # every thread of this rank: training, link, collectives
    threads = cpu_by_thread(threads_started, thread_cpu_s(), train_cpu_s)
    trained = learner.report() if learner is not None else {}  # pushes and merges of the training steps alone
    if writer is not None:
        writer.wait()  # the last write in flight ends before the learner leaves
    rss["trained"] = rss_bytes()
    report = learner.close() if learner is not None else {}
    rss["closed"] = rss_bytes()
    peak = peak_rss_bytes()  # before this script gathers Θ to save it
    steps = len(step_times)
    core = learner.core if learner is not None else None
    ranks = learner.ranks if learner is not None else None
    anchors = sum(t.numel() * 4 for a in core.anchors for t in a.values()) if core else 0
    fragment = max(f.numel for f in core.fragments) * 4 if core else 0
    result = {"learner": args.id, "rank": rank, "world": world, "sharding": args.sharding, "parameters": parameters,
              "fragments": len(core.fragments) if core else 0, "largest_fragment_bytes": fragment,
              "steps": steps, "tokens": steps * args.batch * args.seq, "train_s": train_s, "train_cpu_s": train_cpu_s,
              "tokens_per_s": steps * args.batch * args.seq * world / train_s if train_s else 0.0,
              "join_s": join_s, "peak_rss_bytes": peak, "peak_rss_joined_bytes": joined_peak, "rss_bytes": rss,
              "meta_init": meta,
              "rss_growth_bytes": max(0, rss_bytes() - rss_floor) if rss_floor else 0,
              "peak_staging_bytes": getattr(ranks, "peak_staging_bytes", 0),
              "peak_gathered_bytes": getattr(ranks, "peak_gathered_bytes", {}),
              "bytes_between_ranks": getattr(ranks, "bytes_between_ranks", 0), "anchor_bytes": anchors,
              "bytes_up": report.get("bytes_up", 0), "bytes_down": report.get("bytes_down", 0),
              "merges": report.get("merges", 0), "pushes": report.get("pushes", 0),
              "train_cpu_s_by_thread": threads, "merges_trained": trained.get("merges", 0), "pushes_trained": trained.get("pushes", 0),
              **({"checkpoints_written": writer.written, "checkpoints_skipped": writer.skipped,
                  "checkpoint_copy_total_s": writer.copy_total_s, "checkpoint_period": writer.pacer.period,
                  "checkpoint_cost_s": writer.pacer.cost_s, "checkpoint_cost_total_s": writer.pacer.cost_total_s}
               if writer is not None else {})}
    module = getattr(model, "module", model)
    whole = {}
    for n, t in module.named_parameters():  # one tensor whole at a time on the ranks that do not keep it
        value = t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
        if rank == 0:
            whole[n] = value
    if rank == 0:
        torch.save(whole, args.out / f"params-{args.id}.pt")
    (args.out / f"learner-{args.id}-rank-{rank}.json").write_text(json.dumps(result))
    if distributed:
        dist.barrier()  # every rank's files are written
        # Not destroy_process_group: a Gloo group's teardown once hung a rank here for minutes after its peers
        # had left; its results are on disk, so the process ends at once.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
