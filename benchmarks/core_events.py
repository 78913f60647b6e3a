"""CPU time per event of the syncer core, 4 vs 64 learners: its per-event cost must not grow with them.

    python benchmarks/core_events.py [--events N] [--json PATH]
    python benchmarks/core_events.py --merge [--numel N] [--rounds R] [--codec int4] [--threads T]
        [--codec-loops torch,compiled] [--json PATH]

With --merge, the merge arithmetic instead: one fragment of --numel parameters (default 10M), 8 learners,
fp32 pushes already decoded, the default config's decoupled wiring at quorum 1, no gRPC or journal; CPU
ns per pushed parameter of `handle`, each push alone (each closes its own round), as groups of 8
(`PushesArrived`: one round per group) and one by one into rounds of 8 (quorum 8: a round that waits for
its learners, as a paced one does), against a roofline measured in the same run (one fused in-place
pass, Θ += w·Δ, over a tensor of the fragment's size), and the wall time of the same calls. One thread
(--threads: the compiled loops' pieces, as `diloco syncer --threads` gives them). With --codec, the pushes
arrive encoded, as a shard takes them off the wire (decoded by the core as it reads them), and the answers
go out in that codec too: the shard's arithmetic without its transport.
--codec-loops torch,compiled measures the codecs' eager torch ops and their compiled loops (numba) in turn,
with their ratio.

Drives `SyncerCore.handle` by hand (no gRPC, no journal), with the core built as both drivers build it:
from the default config's strategy spec (`build_strategy(load_config()).syncer_core`). The model is a few
small tensors, one per fragment, so that what is measured is the core's per-event overhead (checks,
bookkeeping, undo on refusal), not the merge arithmetic. Every learner steps in turn and sends a
progress report, a heartbeat and a push of its next fragment (a round closes whenever the strategy
says so, as in a run); each `handle` call is timed with the process's CPU clock. Prints a table with
the 64/4 ratio per event kind and writes JSON (default benchmarks/results/core_events.json). About
10 s on one core.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import diloco.chunk_threads as chunk_threads
from diloco.config import load_config
from diloco.core.events import HeartbeatArrived, ProgressArrived, PushArrived, PushesArrived
from diloco.codecs import compiled, get_codec
from diloco.core.messages import Progress, Push
from diloco.fragments import Fragment
from diloco.strategies import build_strategy
from diloco.transport.wire_messages import DecodedOnUse
from scale_baselines import roofline_ns_per_param  # benchmarks/scale_baselines.py

SIZES = (4, 64)
NUMEL = 16
"""Elements per fragment: small pushes."""
STEPS_PER_PUSH = 4
TOKENS_PER_STEP = 64
TICK_S = 0.001
"""Time between two events: every learner is heard from well within its allowance."""
KINDS = ("push", "progress", "heartbeat")


def measure(learners: int, events: int) -> dict[str, float]:
    """Mean CPU ns per `handle` call, by event kind, over `events` calls of each kind after a warm-up."""
    spec = build_strategy(load_config())
    fragments = [Fragment(p, (f"w{p}",), NUMEL, False) for p in range(spec.fragments)]
    generator = torch.Generator().manual_seed(0)
    params = {f"w{p}": torch.randn(NUMEL, generator=generator) for p in range(spec.fragments)}
    core = spec.syncer_core(params, fragments, range(learners), embeddings=())
    for m in range(learners):
        core.declare(m, TOKENS_PER_STEP)
        core.rejoin_state(m, after_seq=0)
    step = dict.fromkeys(range(learners), 0)
    seq = dict.fromkeys(range(learners), 0)
    spent = dict.fromkeys(KINDS, 0)
    counted = dict.fromkeys(KINDS, 0)
    now = 0.0
    seen = dict.fromkeys(KINDS, 0)
    warmup = max(events // 4, 2 * learners)
    while min(counted.values()) < events:
        for m in range(learners):
            step[m] += STEPS_PER_PUSH
            seq[m] += 1
            fragment = seq[m] % spec.fragments
            tokens = step[m] * TOKENS_PER_STEP
            delta = {f"w{fragment}": torch.randn(NUMEL, generator=generator) * 1e-3}
            push = Push(m, fragment, core.version(fragment), seq[m], delta, STEPS_PER_PUSH * TOKENS_PER_STEP,
                        STEPS_PER_PUSH, step_time_s=TICK_S, sent_at=now, step=step[m])
            due = tuple(float(STEPS_PER_PUSH * TICK_S) for _ in fragments)
            for kind, event in (("progress", ProgressArrived(Progress(m, step[m], tokens, TICK_S, due))),
                                ("heartbeat", HeartbeatArrived(m, step[m], tokens)),
                                ("push", PushArrived(push))):
                now += TICK_S
                started = time.process_time_ns()
                core.handle(event, now)
                elapsed = time.process_time_ns() - started
                seen[kind] += 1
                if seen[kind] > warmup and counted[kind] < events:
                    spent[kind] += elapsed
                    counted[kind] += 1
    assert not core.budget_spent and core.rounds_closed > 0, "the run ended or never merged: not a fair measure"
    return {kind: spent[kind] / counted[kind] for kind in KINDS}


class LoopsClock:
    """CPU time the calling thread spends in `chunk_threads.run` (the loops that run in pieces), while it is
    installed: on one thread, the share of a merge that more threads can shorten."""

    def __init__(self) -> None:
        self.ns = 0
        self._run = chunk_threads.run

    def __enter__(self) -> LoopsClock:
        def timed(spans, work):
            started = time.thread_time_ns()
            try:
                return self._run(spans, work)
            finally:
                self.ns += time.thread_time_ns() - started

        chunk_threads.run = timed
        return self

    def __exit__(self, *exc: object) -> None:
        chunk_threads.run = self._run


def merge_cost(numel: int, rounds: int, group: int, learners: int = 8, codec: str = "fp32", quorum: int = 1
               ) -> tuple[float, float, float]:
    """CPU and wall ns per pushed parameter of `handle`, and the share of its CPU in the loops that run in
    pieces (`LoopsClock`; meaningful on one thread), over `rounds` rounds of `learners` pushes of one fragment,
    handed as groups of `group` pushes (1: each push alone; with `quorum` = `learners`, one at a time into a
    round that closes as the last comes, as a round that waits for its learners takes them). Every push is a
    tensor of its own, as off the wire (the core remembers a tensor's norm: the same tensor pushed again
    would skip its check's pass)."""
    spec = build_strategy(load_config(overrides=[f"learners.count={learners}", "learners.speeds=[]",
                                                 "outer.fragments=1", f"outer.quorum={quorum}", f"codec.up={codec}",
                                                 f"codec.down={codec}"]))
    generator = torch.Generator().manual_seed(0)
    core = spec.syncer_core({"w": torch.randn(numel, generator=generator) * 0.05},
                            [Fragment(0, ("w",), numel, False)], range(learners), embeddings=())
    deltas = [torch.randn(numel, generator=generator) * 1e-3 for _ in range(learners)]
    encoded = [get_codec(codec).encode(d) for d in deltas] if codec != "fp32" else None
    for m in range(learners):
        core.declare(m, TOKENS_PER_STEP)
        core.rejoin_state(m, after_seq=0)
    spent = waited = pushed = in_loops = 0
    now = 0.0
    for r in range(rounds + 1):  # the first round warms up (weights judged, buffers allocated)
        pushes = [Push(m, 0, core.version(0), r + 1,
                       DecodedOnUse({"w": encoded[m]}) if encoded else {"w": deltas[m].clone()}, STEPS_PER_PUSH * TOKENS_PER_STEP,
                       STEPS_PER_PUSH, step_time_s=TICK_S, sent_at=now, step=(r + 1) * STEPS_PER_PUSH)
                  for m in range(learners)]
        for k in range(0, learners, group):
            now += TICK_S
            event = PushArrived(pushes[k]) if group == 1 else PushesArrived(tuple(pushes[k:k + group]))
            started, began = time.process_time_ns(), time.perf_counter_ns()
            with LoopsClock() as loops:
                core.handle(event, now)
            if r:
                spent += time.process_time_ns() - started
                waited += time.perf_counter_ns() - began
                in_loops += loops.ns
                pushed += numel * min(group, learners - k)
    assert core.rounds_closed >= rounds, "pushes were not merged: not a fair measure"
    return spent / pushed, waited / pushed, in_loops / spent


def main_merge(args: argparse.Namespace) -> None:
    from diloco.shard.serving import huge_pages_for_tensors, merge_threads

    huge_pages_for_tensors()  # as a shard runs its core
    merge_threads(args.threads)  # as `diloco syncer --threads` gives them
    line = roofline_ns_per_param(args.numel)
    result: dict = {"numel": args.numel, "learners": 8, "codec": args.codec, "threads": args.threads,
                    "roofline_ns_per_param": line, "codec_loops": {}}
    for loops in args.codec_loops.split(","):
        compiled.set_enabled(loops == "compiled")
        if loops == "compiled" and not compiled.usable(args.numel, torch.empty(0)):
            raise SystemExit("--codec-loops compiled needs numba: pip install 'diloco[fast]'")
        measured = {"alone": merge_cost(args.numel, args.rounds, 1, codec=args.codec),
                    "group_of_8": merge_cost(args.numel, args.rounds, 8, codec=args.codec),
                    "round_of_8": merge_cost(args.numel, args.rounds, 1, codec=args.codec, quorum=8)}
        ways = {k: cpu for k, (cpu, _, _) in measured.items()}
        walls = {k: wall for k, (_, wall, _) in measured.items()}
        result["codec_loops"][loops] = {"cpu_ns_per_param": ways, "vs_roofline": {k: v / line for k, v in ways.items()},
                                        "wall_ns_per_param": walls}
        if args.threads == 1:
            result["codec_loops"][loops]["loops_share"] = {k: share for k, (_, _, share) in measured.items()}
            print("share of the merge's CPU in loops that run in pieces on --threads: " + ", ".join(
                f"{k} {share:.2f}" for k, (_, _, share) in measured.items()))
        print(f"{args.codec}, {args.threads} thread(s), {loops} codec loops: roofline {line:.3f} ns/param; handle: "
              + ", ".join(f"{label} {ways[k]:.2f} ns/param CPU ({ways[k] / line:.1f}x), {walls[k]:.2f} wall"
                          for k, label in (("alone", "each push alone"), ("group_of_8", "groups of 8"),
                                           ("round_of_8", "one by one into rounds of 8"))))
    result.update(result["codec_loops"][loops])  # the last variant's figures at the top, as before
    if {"torch", "compiled"} <= set(result["codec_loops"]):
        before, after = (result["codec_loops"][k]["cpu_ns_per_param"] for k in ("torch", "compiled"))
        result["compiled_vs_torch"] = {k: after[k] / before[k] for k in before}
        print("compiled / torch codec loops: " + ", ".join(f"{k} {v:.2f}x" for k, v in
                                                          result["compiled_vs_torch"].items()))
    out = Path(args.json or Path(__file__).parent / "results" / "core_merge.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1000, help="timed events of each kind per fleet size")
    parser.add_argument("--json", help="where the JSON goes (default results/core_events.json, with --merge "
                        "results/core_merge.json)")
    parser.add_argument("--merge", action="store_true", help="the merge arithmetic per pushed parameter instead")
    parser.add_argument("--numel", type=int, default=10_000_000, help="--merge: parameters of the fragment")
    parser.add_argument("--rounds", type=int, default=3, help="--merge: timed rounds of 8 pushes")
    parser.add_argument("--codec", default="fp32", help="--merge: codec of the pushes and answers (int4: as a "
                        "run sends them; fp32: already decoded)")
    parser.add_argument("--threads", type=int, default=1, help="--merge: the merge's threads, as `diloco syncer "
                        "--threads` sets them")
    parser.add_argument("--codec-loops", default="compiled" if compiled.usable(1 << 20, torch.empty(0))
                        else "torch", help="--merge: which codec loops decode and encode, a comma list of "
                        "compiled (numba) and torch (eager ops), each measured in turn (default compiled "
                        "where numba is installed)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.merge:
        main_merge(args)
        return
    args.json = args.json or str(Path(__file__).parent / "results" / "core_events.json")
    results = [{"learners": n, "ns_per_event": measure(n, args.events)} for n in SIZES]
    small, large = (r["ns_per_event"] for r in results)
    ratio = {kind: large[kind] / small[kind] for kind in KINDS}
    print(f"{'event':<10}" + "".join(f"{f'{n} learners':>14}" for n in SIZES) + f"{'ratio':>8}")
    for kind in KINDS:
        print(f"{kind:<10}" + "".join(f"{r['ns_per_event'][kind] / 1000:>11.1f} µs" for r in results)
              + f"{ratio[kind]:>8.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"learners": list(SIZES), "ns_per_event": {r["learners"]: r["ns_per_event"]
                                                                         for r in results},
                               "ratio_64_vs_4": ratio}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
