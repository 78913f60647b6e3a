"""What a plan costs beyond the links: the syncer's CPU, the time a joining learner takes to pull Θ, and
the step time of a model that does not exist yet. Each figure rests on a measured constant, named here
with the command that measures it, so a faster syncer or another accelerator is one edit away.

- Syncer cores: a shard spends `SHARD_CPU_NS_PER_PARAM` CPU-nanoseconds per parameter it is pushed
  (decode, accumulate, close the round, answer), so it needs pushed parameters/s × that many cores.
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


def shards_for_cores(pushed_params_per_s: float, fragment_numels: Sequence[int], limit_cores: float) -> int | None:
    """The fewest shards (fragment p on shard p mod S) none of which needs more than `limit_cores`; None
    if one fragment alone needs more."""
    total = sum(fragment_numels)
    for shards in range(max(1, math.ceil(cores(pushed_params_per_s) / limit_cores)), len(fragment_numels) + 1):
        largest = max(sum(fragment_numels[p::shards]) for p in range(shards))
        if cores(pushed_params_per_s * largest / total) <= limit_cores:
            return shards
    return None
