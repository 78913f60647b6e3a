"""Whether `diloco syncer --threads N` pays on this host: a round's compiled loops over one fragment on 1..N
threads, CPU and wall time each, taking turns.

    python benchmarks/merge_threads.py [--numel 5000000] [--threads 1,2] [--repeats 9] [--json PATH]

The loops are those `chunk_threads` runs in pieces: the outer step (`compiled_step.plain_step` over the
step's cache-sized chunks), the downlink's encode of Θ's difference onto the published copy (int4), and a
group of 8 int4 pushes folded into a round's two sums. Each is timed `--repeats` times per thread count,
the counts taking turns, and the best kept: CPU ns (the process's, every thread's) and wall ns per
element, and the speed-up and CPU ratio against one thread. A loop that reads and writes several
fragment-sized tensors is bound by memory bandwidth, which more threads may not have; one that computes
(the encode) scales with cores. Writes JSON (default benchmarks/results/merge_threads.json). Needs numba.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import diloco.chunk_threads as chunk_threads
import diloco.codecs.compiled_sums as compiled_sums
import diloco.outer.compiled_step as compiled_step
from diloco.cache_chunks import chunks
from diloco.codecs import get_codec


def loops(numel: int) -> dict[str, Callable[[], None]]:
    generator = torch.Generator().manual_seed(0)
    theta, source, old, total, target = (torch.randn(numel, generator=generator) for _ in range(5))
    codec = get_codec("int4", 64)
    published = theta + 1e-2 * torch.randn(numel, generator=generator)
    pushes = [codec.encode(torch.randn(numel, generator=generator) * 1e-3) for _ in range(8)]
    payloads = [np.frombuffer(p.payload, np.uint8) for p in pushes]
    scales = [np.frombuffer(p.scales, np.float32) for p in pushes]
    alphas = np.full((8, 2), 0.125, np.float32)
    sums = (torch.zeros(numel), torch.zeros(numel))

    def step() -> None:
        chunk_threads.run(list(chunks(numel, theta.device)), lambda a, b: compiled_step.plain_step(
            theta[a:b], source[a:b], 0.5, False, old[a:b], 0.25, 0.7 * 0.25, total[a:b], target[a:b]))

    return {"outer step": step,
            "downlink encode": lambda: codec.encode_difference_onto(theta, published),
            "fold of 8 pushes": lambda: compiled_sums.fold_group(payloads, scales, 64, 7.0, sums, sums, alphas)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=5_000_000, help="elements of the fragment")
    parser.add_argument("--threads", default="1,2", help="thread counts, a comma list")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per loop and thread count")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "merge_threads.json")
    args = parser.parse_args()
    if not compiled_sums.folds_like_torch() or not compiled_step.steps_like_torch():
        raise SystemExit("needs numba: pip install 'diloco[fast]'")
    torch.set_num_threads(1)
    counts = [int(t) for t in args.threads.split(",")]
    work = loops(args.numel)
    best: dict[str, dict[int, list[float]]] = {name: {t: [float("inf")] * 2 for t in counts} for name in work}
    for _ in range(args.repeats):
        for threads in counts:  # the counts take turns
            chunk_threads.set_threads(threads)
            for name, loop in work.items():
                loop()  # pieces and pages warm
                cpu, wall = time.process_time_ns(), time.perf_counter_ns()
                loop()
                took = [(time.process_time_ns() - cpu) / args.numel, (time.perf_counter_ns() - wall) / args.numel]
                best[name][threads] = [min(a, b) for a, b in zip(best[name][threads], took)]
    chunk_threads.set_threads(1)
    result: dict = {"numel": args.numel, "threads": counts, "loops": {}}
    print(f"{'loop':<18}{'threads':>8}{'CPU ns/elem':>13}{'wall ns/elem':>14}{'speed-up':>10}{'CPU ratio':>11}")
    for name, by_count in best.items():
        one_cpu, one_wall = by_count[counts[0]]
        rows = {}
        for threads, (cpu, wall) in by_count.items():
            rows[threads] = {"cpu_ns_per_element": cpu, "wall_ns_per_element": wall,
                             "speedup": one_wall / wall, "cpu_ratio": cpu / one_cpu}
            print(f"{name:<18}{threads:>8}{cpu:>13.3f}{wall:>14.3f}{one_wall / wall:>9.2f}x{cpu / one_cpu:>10.2f}x")
        result["loops"][name] = rows
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
