"""What a plan costs beyond the links: the syncer's CPU, the time a joining learner takes to pull Θ, and
the step time of a model that does not exist yet. Each figure rests on a measured constant, named here
with the command that measures it, so a faster syncer or another accelerator is one edit away.

- Syncer cores: a shard spends `SHARD_CPU_NS_PER_PARAM` CPU-nanoseconds per parameter it is pushed
  (decode, accumulate, close the round, answer), so it needs pushed parameters/s × that many cores.
- Threads: `diloco syncer --threads T` runs a round's compiled loops in pieces on T threads; the rest of
  the merge (each push's checks, the core's bookkeeping: `SHARD_SERIAL_SHARE` of it) stays on one, so a
  shard gets through at most 1 / (s + (1 − s) / T) cores' worth of one thread's merging (Amdahl).
- Join time: a joining learner pulls Θ whole (fp32) from every shard at once; each shard serves its part
  at `SHARD_BULK_PULL_BYTES_PER_S` (over its bulk port, as `diloco run` starts shards), and all of Θ
  crosses the learner's own link: the join lasts as long as the slower of the largest shard's part and
  Θ over the slowest learner's link.
- Step time of a `--params` plan: 6·N FLOPs per token (forward and backward) × the tokens of one inner
  step ÷ one learner's effective FLOP/s (`LEARNER_FLOPS`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SHARD_CPU_NS_PER_PARAM = 3.03
"""CPU-ns of a shard per pushed parameter: `cpu_ns_per_param` of
`python benchmarks/scale.py --params 20M --learners 8 --codec int4 --quorum 1 --seconds 8 --min-pushes 8
--socket-seconds 2 --bulk-port --json benchmarks/results/scale-q1-plan-s61-2.json` (one shard, 8 learners,
int4 pushes, each closing its own round unless pushes wait for it: CPU-seconds of the shard process ÷
parameters pushed in the window; 2.90, 3.03 and 3.44 in three runs of the same code, `-s61-{1,2,3}`, the
median kept; the code before s61's momentum loop gave a median 3.22 the same morning, so part of the drop
from s60 is the host). Earlier: 7.71 (s39, without the bulk port, the compiled loops or a group folded
together), 7.54 (the median at s51), 4.93 (s59), 3.66 (s60, before the full round's momentum step was one
compiled loop)."""
SHARD_SERIAL_SHARE = 0.42
"""Share of a shard's merge CPU that stays on one thread whatever `--threads` says: 1 − `loops_share` of
`python benchmarks/core_events.py --merge --numel 5000000 --codec int4 --rounds 6 --threads 1`, the larger
of its two grouped ways (`benchmarks/results/core_merge-threads-s63-{2,5}-after-t1.json`: groups of 8 0.58
and 0.57 in the loops, pushes one by one into rounds of 8 0.60 and 0.59, each push alone 0.69 and 0.70).
Conservative for the whole shard: its transport runs on threads of its own."""
SHARD_PULL_BYTES_PER_S = 408e6
"""Bytes/s of Θ one shard serves a joining learner over gRPC (a shard without `--bulk-port`):
`join_bytes ÷ join_s` of the same run (80 MB of fp32 Θ from one shard in 0.196 s, 4 fragments on 4
streams, while 8 learners were pushing)."""
SHARD_BULK_PULL_BYTES_PER_S = 1.59e9
"""The same over a shard's bulk port: `join_bytes ÷ join_s` of `python benchmarks/scale.py --params 100M
--learners 1 --seconds 5 --min-pushes 4 --socket-seconds 3 --sink --joins 7 --bulk-port --json
benchmarks/results/scale-join100m-bulk-s47.json` (400 MB in 0.252 s, the median of 7 joins; 0.249 s in a
second run)."""
FLOPS_PER_PARAM_TOKEN = 6
"""Forward and backward of a dense transformer: 6 FLOPs per parameter per token."""
LEARNER_FLOPS = 64 * 989e12 * 0.4
"""One learner's effective FLOP/s when `--params` is planned without `--step-time`: 64 accelerators
(8 nodes of 8) at 40% of an H100's 989 dense bf16 TFLOP/s, about 25 PFLOP/s (`--learner-flops`)."""
PLAN_STEP_TOKENS = 524_288
"""Tokens per inner step per learner of a `--params` plan without `--step-tokens` (2^19, a usual batch)."""
FP32 = 4


def step_time_s(parameters: int, tokens_per_step: int, flops: float = LEARNER_FLOPS) -> float:
    """One inner step of a model of `parameters` on a learner of `flops` effective FLOP/s."""
    return FLOPS_PER_PARAM_TOKEN * parameters * tokens_per_step / flops


def cores(pushed_params_per_s: float, ns_per_param: float = SHARD_CPU_NS_PER_PARAM) -> float:
    """Cores a shard keeps busy merging `pushed_params_per_s`."""
    return pushed_params_per_s * ns_per_param * 1e-9


def join_s(shard_parameters: Sequence[int], link_bps: float | None = None,
           pull_bytes_per_s: float = SHARD_BULK_PULL_BYTES_PER_S) -> float:
    """A joining learner's pull of Θ (fp32) from every shard in parallel: the largest shard's part, or all
    of Θ over the learner's link of `link_bps` bits/s (where given), whichever takes longer."""
    serving = max((FP32 * n for n in shard_parameters), default=0) / pull_bytes_per_s
    crossing = FP32 * sum(shard_parameters) * 8 / link_bps if link_bps else 0.0
    return max(serving, crossing)


def shard_capacity(threads: int, serial: float = SHARD_SERIAL_SHARE) -> float:
    """Cores' worth of one thread's merging that a shard on `threads` threads gets through."""
    return 1.0 / (serial + (1.0 - serial) / threads)


PLAN_MAX_THREADS = 64
"""The most `--threads` a plan proposes: past a few dozen, each thread adds almost nothing (Amdahl)."""


def threads_for(shard_cores: float, serial: float = SHARD_SERIAL_SHARE) -> int | None:
    """The fewest `--threads` (at most PLAN_MAX_THREADS) for a shard that needs `shard_cores`; None if
    none is enough."""
    if shard_cores <= 1:
        return 1
    if shard_cores * serial >= 1:
        return None
    threads = math.ceil((1.0 - serial) / (1.0 / shard_cores - serial) - 1e-9)
    return threads if threads <= PLAN_MAX_THREADS else None


def shards_for_cores(pushed_params_per_s: float, fragment_numels: Sequence[int], limit_cores: float) -> int | None:
    """The fewest shards (fragment p on shard p mod S), each on `limit_cores` cores and as many threads,
    none of which needs more than it gets through (`shard_capacity`); None if one fragment alone needs more."""
    usable = min(limit_cores, shard_capacity(max(1, math.floor(limit_cores))))
    total = sum(fragment_numels)
    for shards in range(max(1, math.ceil(cores(pushed_params_per_s) / usable)), len(fragment_numels) + 1):
        largest = max(sum(fragment_numels[p::shards]) for p in range(shards))
        if cores(pushed_params_per_s * largest / total) <= usable:
            return shards
    return None
