"""How the syncer scales: synthetic learners against real `diloco syncer` shard processes on this machine.

    python benchmarks/scale.py [--params 100M[,1B]] [--learners 1,16] [--shards 1[,2]] [--codec int4]
                               [--fragments F] [--seconds S] [--warmup W] [--json PATH] [--keep DIR]

With no arguments, a quick sweep (20M parameters, 1, 4, 8 and 16 learners, one shard, int4; about 2 to
3 minutes on 2 cores). For every combination of --params x --shards x --codec x --learners:

  shards    fresh `diloco syncer` processes, one per shard (`--shard i/N`, the shard map, a shared
            secret in a file, as `diloco run` starts them; no state folder unless --journal), Decoupled
            DiLoCo with quorum 1 and no pacing or grace: each push closes its own round at once, is
            merged and answered. Liveness allowances are set far above the run so that no synthetic
            learner is ever found dead. Θ is seeded by this script over the run secret (an Init that
            streams one tensor at a time: uniform values in ±0.05), in a layout of --fragments
            fragments (default max(4, 2 x shards)), each split into tensors of at most --max-tensor
            elements, fragment p on shard p mod N as the launcher's ShardPlan has it.
  learners  separate processes (this script with --worker), each joining every shard as learner m with
            its own credential derived from the run secret. No training: one outer gradient per
            fragment (N(0, 1e-3²), small against Θ so the outlier bounds never clip or refuse it) is
            encoded ONCE with --codec by this script and written to a file; every learner maps those
            files (mmap) and pushes the same bytes, so 16 learners hold one copy between them (page
            cache) and their CPU goes to the wire, not to encoding. Per shard, a learner has one push
            in flight at a time, cycling over the shard's fragments, as fast as the shard takes them
            (or, with --push-rate R, R pushes a second, so that a shard below saturation shows what a
            push costs it):
            valid headers (seq +1, base_version = the newest version it was answered, 4 steps of
            --tokens-per-step tokens per push as declared at join, heartbeats every second with the same
            counters). Answers are read off the Updates stream frame by frame and counted, not
            assembled or decoded (so 16 learners' answers of a 1B model do not need 16 copies here).
  timing    all learners start together; --warmup seconds, then a window of at least --seconds that
            also lasts until --min-pushes pushes per shard were taken in it (at most --max-seconds: a
            100M-parameter push takes seconds to merge here), in which
            push MB/s   tensor bytes (payload + scales) of pushes taken, over the window (a push counts
                        by the share of its time, sent to taken, inside the window), over learners;
            pull MB/s   tensor bytes of answers received in the window;
            latency     per push sent in the window, push sent -> its answer (ack_seq >= its seq)
                        fully received (the learners wait for these after the window): median, p95;
            rounds/s    distinct versions answered in the window (a learner may skip a version that a
                        newer answer covers); pushes/round (`pushes_per_round`), the pushed parameters of
                        the window in fragments' worth over the rounds the shards closed in it (their
                        Status at both ends, `rounds_closed`): at quorum 1 one push closes its round unless
                        others arrived while it was merged (group commit).
  memory    per shard, VmRSS and VmHWM from /proc/PID/status every 0.2 s: `rss_bytes` is the largest
            VmRSS from the learners' start to the window's end (under load, after Θ was seeded);
            `hwm_bytes` the kernel's peak, the seeding included. Θ bytes held: the Status report's
            `memory` dict where the shard reports one ("n/a" otherwise).
  CPU       the shards' CPU-seconds over the window (/proc/PID/stat, every thread) ÷ the parameters of
            the pushes taken in it: `cpu_ns_per_param`, against `roofline_ns_per_param`, one fused in-place
            pass (Θ += w·Δ, one thread) over a tensor of the largest fragment's size, measured by this
            script in the same run (target: at most 4x, with 8 learners).
  join      after the window, an observer's pull of Θ (fp32) from every shard, timed, as a join pulls
            it: each fragment on its own stream, PULL_STREAMS at once over all shards; --joins times (default
            3; `join_seconds` each), the median kept. `join_vs_socket` is that time over the plain socket's
            time for the same bytes (target: at most 2x). --bulk-port: over the shards' bulk ports.
  --sink    the shards take pushes off the wire and answer them without merging, each answer one encoded
            difference the size of a push, as after a round (the transport alone; target: push and pull
            at least 0.5x the socket).
  --paced   the default config's pacing and grace, and learners that follow it: each pushes a fragment at
            the time its last answer named (the pacing grid: one period, H steps of its claimed step time,
            apart) and reports after each push when every fragment is due, so rounds gather the learners
            as they do in a paced run. Without it every round closes at once and learners push flat out.
  --profile each shard samples where its CPU goes by Python frame (`diloco.cpu_profile`: each thread's
            own CPU clock, charged to its stack every 2 ms); the window's shares go in `cpu_profile`
            per shard, and the largest are printed.
  socket    after the shards are stopped: a plain TCP socket on loopback to a Python subprocess that
            reads each message into a buffer and acks it with one byte, messages of one fragment's
            encoded push, request/response, for --socket-seconds (default 3): `socket_mb_s`.

Memory: before a combination starts, its peak is predicted per shard as base + P_shard x (a + b x
learners) bytes, a and b fitted on the runs already done in this invocation with the same codecs and
shard count (at first, what the syncer measured here needed: see DEFAULT_BYTES_PER_PARAM); a
combination that would leave less than --min-free-gib of MemAvailable is skipped with its reason
(--force runs it anyway). While it runs, a watchdog kills it if MemAvailable falls below --min-free-gib.

Prints a table of runs, one of shards and one of targets (measured against target, met or not); with
--json PATH writes the list of runs. Every process started is stopped at the end, on errors and on
Ctrl-C (SIGINT to its session, then SIGKILL); each child also dies with this script (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from children import Processes  # benchmarks/children.py
from scale_combo import Combo, run_combo
from scale_memory import MemoryModel
from scale_profile import print_profiles
from scale_report import fmt, gib, human, ms, print_report
from scale_worker import worker



def count(text: str) -> int:
    """20000000, 20M, 1B, 1e9, 1_000_000."""
    t = text.strip().replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}.get(t[-1:].lower())
    value = float(t[:-1]) * scale if scale else float(t)
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole count: {text!r}")
    return int(value)


def counts(text: str) -> list[int]:
    try:
        return [count(x) for x in text.split(",") if x.strip()]
    except (argparse.ArgumentTypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of counts, got {text!r}") from None


def interrupted(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=counts, default=[20_000_000], help="parameter counts (20M, 1B, ...)")
    parser.add_argument("--learners", type=counts, default=[1, 4, 8, 16], help="learner counts")
    parser.add_argument("--shards", type=counts, default=[1], help="shard counts")
    parser.add_argument("--codec", default="int4", help="codecs of the pushes (fp32, bf16, int8, int4, fp4)")
    parser.add_argument("--down-codec", help="codec of the answers (default: the push codec)")
    parser.add_argument("--block", type=int, default=64, help="elements per scale of int8, int4, fp4")
    parser.add_argument("--fragments", type=int, help="fragments of the model (default max(4, 2 x shards))")
    parser.add_argument("--max-tensor", type=count, default=16 * 2**20, help="most elements per tensor")
    parser.add_argument("--seconds", type=float, default=10.0, help="shortest measurement window")
    parser.add_argument("--min-pushes", type=int, default=8, help="the window also lasts until this many pushes "
                        "per shard were taken in it ...")
    parser.add_argument("--max-seconds", type=float, default=180.0, help="... or this long")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of pushing before the window")
    parser.add_argument("--socket-seconds", type=float, default=3.0, help="plain-socket baseline per run")
    parser.add_argument("--joins", type=int, default=3, help="timed joins per run (the median is kept)")
    parser.add_argument("--bulk-port", "--bulk-pulls", dest="bulk_port", action="store_true",
                        help="the shards serve a bulk port (`diloco syncer --bulk-port`): the join's values and "
                        "the pushes' data over plain TCP, not gRPC")
    parser.add_argument("--shard-threads", type=int, default=1, help="each shard's `diloco syncer --threads`")
    parser.add_argument("--quorum", type=int, default=1, help="outer.quorum (1: each push closes its round)")
    parser.add_argument("--paced", action="store_true", help="keep the default config's pacing and grace "
                        "(the default paced decoupled config), learners pushing on its grid, instead of closing "
                        "each round at once")
    parser.add_argument("--sink", action="store_true", help="transport alone: the shards take pushes off the "
                        "wire and answer them without merging (push_vs_socket, pull_vs_socket of the transport)")
    parser.add_argument("--push-rate", type=float, default=0.0, help="pushes per second each learner sends to "
                        "each shard (0: as fast as the shard takes them); below saturation the shard's CPU per "
                        "pushed parameter is the work a push costs, not what a saturated shard's scheduling makes it")
    parser.add_argument("--profile", action="store_true", help="each shard samples where its CPU goes by Python "
                        "frame (`diloco.cpu_profile`): the window's shares printed and in the JSON (`cpu_profile`)")
    parser.add_argument("--tokens-per-step", type=int, default=4096, help="declared at join")
    parser.add_argument("--journal", action="store_true", help="give the shards a state folder (--out): they "
                        "journal every push and save their state every 10 s, as under `diloco run`")
    parser.add_argument("--plaintext", action="store_true", help="no shared secret (identity not enforced)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more syncer config")
    parser.add_argument("--min-free-gib", type=float, default=2.0,
                        help="skip a run predicted to leave less MemAvailable; stop one that does")
    parser.add_argument("--force", action="store_true", help="run combinations predicted not to fit (the "
                        "watchdog still stops them)")
    parser.add_argument("--json", type=Path, help="write the list of runs here")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep logs and payload files in DIR")
    args = parser.parse_args(argv)
    from diloco.codecs import CODEC_NAMES

    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    for c in codecs + ([args.down_codec] if args.down_codec else []):
        if c not in CODEC_NAMES:
            parser.error(f"unknown codec {c!r}: one of {', '.join(CODEC_NAMES)}")
    if args.seconds <= 0 or args.warmup < 0 or args.max_seconds < args.seconds:
        parser.error("--seconds must be positive, --warmup not negative, --max-seconds at least --seconds")
    combos = []
    for params, shards, codec in itertools.product(sorted(args.params), sorted(args.shards), codecs):
        fragments = args.fragments or max(4, 2 * shards)
        if shards > fragments:
            parser.error(f"{shards} shards but {fragments} fragments: every shard needs one")
        if params < fragments:
            parser.error(f"{params} parameters cannot make {fragments} fragments")
        for learners in sorted(args.learners):
            combos.append(Combo(params, learners, shards, codec, args.down_codec or codec, fragments))

    from rich.console import Console

    console = Console(width=max(Console().width, 160))
    procs = Processes()
    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    # (SIGINT too: a script started in the background finds it ignored)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        root_dir = argparse.Namespace(name=tempfile.mkdtemp(prefix="diloco-scale-", dir=args.keep), cleanup=lambda: 0)
    else:
        root_dir = tempfile.TemporaryDirectory(prefix="diloco-scale-", ignore_cleanup_errors=True)
    root = Path(root_dir.name)
    model = MemoryModel()
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    interrupted_by = None
    try:
        for k, combo in enumerate(combos):
            console.print(f"[{k + 1}/{len(combos)}] {human(combo.params)} params, {combo.learners} learners, "
                          f"{combo.shards} shard(s), {combo.codec}/{combo.down}, {combo.fragments} fragments ...")
            record = run_combo(procs, root, combo, args, model, console)
            runs.append(record)
            if record["status"] == "ok":
                console.print(f"    push {record['push_mb_s']:.0f} MB/s, pull {record['pull_mb_s']:.0f} MB/s, "
                              f"socket {fmt(record['socket_mb_s'])} MB/s, RSS {gib(record['rss_bytes'])} GiB, "
                              f"p50 {ms(record['latency_median_s'])} ms, "
                              f"shard CPU {fmt(record['cpu_ns_per_param'], '.2f')} ns/param "
                              f"(roofline {fmt(record['roofline_ns_per_param'], '.3f')})"
                              + (f" [yellow]({'; '.join(record['problems'])})[/]" if record["problems"] else ""))
                print_profiles(console, record)
            else:
                console.print(f"    [yellow]{record['status']}: {record['reason']}[/]")
    except KeyboardInterrupt:
        console.print("interrupted: stopping every child")
        interrupted_by = 130
    finally:
        procs.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if args.keep:
            console.print(f"logs and payloads kept in {root}")
        else:
            root_dir.cleanup()
    for r in runs:
        r["key"] = list(r["key"])
    if runs:
        print_report(console, runs)
    if args.json and runs:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
        console.print(f"wrote {args.json}" + (" (the runs done before the interruption)" if interrupted_by else ""))
    console.print(f"{time.monotonic() - started:.0f} s on {os.cpu_count()} CPUs")
    return interrupted_by or 0


if __name__ == "__main__":
    sys.exit(main())
