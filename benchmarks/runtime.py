"""The real runtime's overheads on this machine: learner goodput, what syncing costs, transport speed.

    python benchmarks/runtime.py [--tokens N] [--repeats R] [--transport-mib M] [--fragment-mib F]
                                 [--set key=value ...] [--out FILE] [--keep DIR]

About 3 minutes per repeat with the defaults on 2 cores. Three measurements, all in one invocation:
  a  learner goodput in the default `diloco run` scenario (4 learners, speeds 1, 1, 0.5, 0.25, each link
     shaped to 100 Mbit/s and 50 ms): time inside inner steps over wall time, per learner and overall
     (sum of busy seconds / sum of each learner process's own wall seconds: what syncing costs a learner's
     process, not the run's goodput, which summary.json counts over the whole training time). Target ≥ 0.98.
  b  tokens/s of those 4 learners with syncing (a `diloco run` subprocess) against the same 4 learners
     without it (4 `diloco learner --no-sync --id M` subprocesses started together, same config), the two
     variants run in alternation --repeats times. Each learner's rate is its tokens / its own wall_s
     (from learners/learner-M.json); the total is the SUM of the 4 learners' rates (a learner's wall
     starts after its model is built and it joined, so starts that differ by a few seconds do not count).
     Total tokens / the longest wall is reported next to it. Target: synced/unsynced total ≥ 0.95.
     Both variants run with train.eval_points=1: the launcher's evaluations of Θ share this machine's
     cores with the learners and are no part of syncing.
  c  transport throughput on loopback, no shaping: --transport-mib MiB as pushes of one fp32 fragment of
     --fragment-mib MiB through the gRPC Push RPC to a `diloco syncer` subprocess (strategy decoupled,
     one fragment, quorum 0 so rounds stay open and the shard only receives, checks, decodes and
     accumulates), against the same bytes as messages of the same size over a plain TCP socket to a
     Python subprocess that reads them into a buffer, discards them and acks each with one byte. Both are
     request/response: the next message goes once the previous one is answered. MB = 10^6 bytes of
     tensor payload.

Prints the tables and writes JSON (default benchmarks/results/runtime.json). Every subprocess runs in a
session of its own and is stopped (SIGINT, then SIGKILL) on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from children import Processes, diloco, tail  # benchmarks/children.py
from runtime_transport import transport


GOODPUT_TARGET = 0.98
TOKENS_RATIO_TARGET = 0.95
RUN_TIMEOUT_S = 1800.0
LEARNER_ENV = {"OMP_NUM_THREADS": "1"}
"""As the launcher starts its learners: one thread each, several share this machine's cores."""


# ---------------------------------------------------------------- child processes


def wait_all(procs: dict[str, tuple[subprocess.Popen, Path]], timeout_s: float) -> None:
    """Wait for every child; the first that fails (or the timeout) raises with its log's last lines."""
    deadline = time.monotonic() + timeout_s
    while True:
        pending = False
        for name, (proc, log) in procs.items():
            code = proc.poll()
            if code is None:
                pending = True
            elif code != 0:
                raise RuntimeError(f"{name} exited with code {code} (--keep DIR keeps the logs); {log} ends:\n"
                                   f"{tail(log)}")
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(procs)} still running after {timeout_s:g} s")
        time.sleep(0.2)


# ---------------------------------------------------------------- (a) and (b): synced against unsynced


def learner_reports(out: Path, count: int) -> list[dict[str, Any]]:
    reports = []
    for m in range(count):
        path = out / "learners" / f"learner-{m}.json"
        if not path.is_file():
            raise RuntimeError(f"learner {m} left no report at {path}")
        r = json.loads(path.read_text())
        reports.append({k: r[k] for k in ("learner", "speed", "tokens", "steps", "planned_steps", "busy_s",
                                          "wall_s", "busy_fraction", "tokens_per_s", "bytes_up", "bytes_down")})
    return reports


def totals(learners: list[dict[str, Any]]) -> dict[str, float]:
    return {"tokens": sum(r["tokens"] for r in learners),
            "tokens_per_s": sum(r["tokens"] / r["wall_s"] for r in learners),
            "tokens_per_s_span": sum(r["tokens"] for r in learners) / max(r["wall_s"] for r in learners),
            "goodput": sum(r["busy_s"] for r in learners) / sum(r["wall_s"] for r in learners)}


def run_synced(procs: Processes, config_args: list[str], work: Path, count: int) -> dict[str, Any]:
    out = work / "run"
    log = work / "run.log"
    started = time.monotonic()
    proc = procs.start(diloco("run", *config_args, "--out", str(out), "-q"), log)
    try:
        wait_all({"diloco run": (proc, log)}, RUN_TIMEOUT_S)
    finally:
        procs.stop([proc], grace_s=30.0)
    summary = json.loads((out / "summary.json").read_text())
    learners = learner_reports(out, count)
    return {"learners": learners, **totals(learners), "command_s": time.monotonic() - started,
            "summary": {k: summary[k] for k in ("final_eval_loss", "wall_clock_s", "training_time_s",
                                                "goodput", "tokens", "rounds", "wire_bytes_up", "wire_bytes_down")}}


def run_unsynced(procs: Processes, config_args: list[str], work: Path, count: int) -> dict[str, Any]:
    out = work / "nosync"
    started = time.monotonic()
    children = {}
    for m in range(count):
        log = work / f"nosync-learner-{m}.log"
        children[f"learner {m} --no-sync"] = (
            procs.start(diloco("learner", *config_args, "--no-sync", "--id", str(m), "--out", str(out), "-q"),
                        log, env=LEARNER_ENV), log)
    try:
        wait_all(children, RUN_TIMEOUT_S)
    finally:
        for proc, _ in children.values():
            procs.stop([proc], grace_s=30.0)
    learners = learner_reports(out, count)
    return {"learners": learners, **totals(learners), "command_s": time.monotonic() - started}


def compare(synced: dict[str, Any], unsynced: dict[str, Any]) -> dict[str, Any]:
    return {"tokens_per_s": synced["tokens_per_s"] / unsynced["tokens_per_s"],
            "tokens_per_s_span": synced["tokens_per_s_span"] / unsynced["tokens_per_s_span"],
            "per_learner": [s["tokens_per_s"] / u["tokens_per_s"]
                            for s, u in zip(synced["learners"], unsynced["learners"])]}


# ---------------------------------------------------------------- report


def met(ok: bool) -> str:
    return "[green]met[/]" if ok else "[red]not met[/]"


def print_tables(console: Console, results: dict[str, Any]) -> None:
    runs, speeds = results["runs"], results["speeds"]
    table = Table(title="learner tokens/s: synced (`diloco run`) vs unsynced (`diloco learner --no-sync`)")
    for col in ("rep", "learner", "speed", "tok/s synced", "tok/s unsynced", "ratio", "goodput synced",
                "goodput unsynced", "wall s synced", "wall s unsynced"):
        table.add_column(col, justify="right")
    for run in runs:
        s, u = run["synced"], run["unsynced"]
        for m, (ls, lu) in enumerate(zip(s["learners"], u["learners"])):
            table.add_row(str(run["repeat"]) if m == 0 else "", str(m), f"{speeds[m]:g}", f"{ls['tokens_per_s']:,.0f}",
                          f"{lu['tokens_per_s']:,.0f}", f"{run['ratio']['per_learner'][m]:.3f}",
                          f"{ls['busy_fraction']:.4f}", f"{lu['busy_fraction']:.4f}", f"{ls['wall_s']:.1f}",
                          f"{lu['wall_s']:.1f}")
        table.add_row("", "[bold]Σ[/]", "", f"{s['tokens_per_s']:,.0f}", f"{u['tokens_per_s']:,.0f}",
                      f"[bold]{run['ratio']['tokens_per_s']:.3f}[/]", f"[bold]{s['goodput']:.4f}[/]",
                      f"{u['goodput']:.4f}", "", "", end_section=True)
    console.print(table)

    tr = results["transport"]
    table = Table(title=f"transport on loopback: {tr['messages']} messages of {tr['message_bytes'] / 2**20:g} MiB")
    for col in ("repeat", "gRPC Push MB/s", "plain TCP MB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in tr["runs"]:
        table.add_row(str(r["repeat"]), f"{r['grpc']['mb_per_s']:.0f}", f"{r['tcp']['mb_per_s']:.0f}",
                      f"{r['ratio']:.3f}")
    table.add_row("median", f"{tr['grpc_mb_per_s']:.0f}", f"{tr['tcp_mb_per_s']:.0f}", f"{tr['ratio']:.3f}")
    console.print(table)

    m = results["median"]
    table = Table(title=f"runtime targets (median of {len(runs)} repeat(s), {results['tokens']:,} tokens)")
    for col in ("measure", "value", "target", ""):
        table.add_column(col, justify="right")
    table.add_row("(a) goodput, all (Σ busy / Σ wall)", f"{m['goodput']:.4f}", f"≥ {GOODPUT_TARGET}",
                  met(m["goodput"] >= GOODPUT_TARGET))
    for k, g in enumerate(m["goodput_per_learner"]):
        table.add_row(f"(a) goodput, learner {k} (speed {speeds[k]:g})", f"{g:.4f}", f"≥ {GOODPUT_TARGET}",
                      met(g >= GOODPUT_TARGET))
    table.add_row("(b) tok/s synced / unsynced (Σ rates)", f"{m['ratio']:.3f}",
                  f"≥ {TOKENS_RATIO_TARGET}", met(m["ratio"] >= TOKENS_RATIO_TARGET))
    table.add_row("(b) same, Σ tokens / longest wall", f"{m['ratio_span']:.3f}", "", "")
    for k, r in enumerate(m["ratio_per_learner"]):
        table.add_row(f"(b) same, learner {k}", f"{r:.3f}", "", "")
    table.add_row("(c) MB/s gRPC Push / plain TCP", f"{tr['ratio']:.3f}", "", "")
    console.print(table)


def interrupted(*_) -> None:
    """SIGTERM goes the way of Ctrl-C, through the `finally` that stops every child."""
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, help="total token budget of each run (default: the built-in default)")
    parser.add_argument("--repeats", type=int, default=1, help="synced/unsynced pairs, run in alternation")
    parser.add_argument("--transport-mib", type=int, default=256, help="MiB pushed per transport measurement")
    parser.add_argument("--fragment-mib", type=int, default=16, help="MiB per push (one fp32 tensor)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the runs of (a) and (b)")
    parser.add_argument("--out", default="benchmarks/results/runtime.json", help="JSON file to write")
    parser.add_argument("--keep", metavar="DIR", help="keep the runs' outputs and logs in DIR")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    from diloco.config import load_config
    from diloco.errors import DilocoError

    # Θ is evaluated once, at the end: evaluations run in the launcher, on the cores the learners share
    # here, and are no part of syncing; the unsynced baseline has none.
    overrides = ["train.eval_points=1", *([f"train.tokens={args.tokens}"] if args.tokens else []), *args.set]
    try:
        config = load_config(None, overrides)
    except DilocoError as exc:
        parser.error(str(exc))
    count, speeds = config.learners.count, config.speeds()
    config_args = [x for o in overrides for x in ("--set", o)]
    console = Console(width=max(Console().width, 120))
    procs = Processes()
    signal.signal(signal.SIGTERM, interrupted)
    started = time.monotonic()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    work_dir = (tempfile.TemporaryDirectory(prefix="diloco-runtime-", ignore_cleanup_errors=True) if not args.keep
                else argparse.Namespace(name=tempfile.mkdtemp(prefix="diloco-runtime-", dir=args.keep)))
    runs = []
    try:
        for r in range(args.repeats):
            work = Path(work_dir.name) / f"repeat-{r + 1}"
            work.mkdir()
            synced = run_synced(procs, config_args, work, count)
            console.print(f"repeat {r + 1}/{args.repeats} synced: {synced['tokens_per_s']:,.0f} tok/s, goodput "
                          f"{synced['goodput']:.4f}, eval loss {synced['summary']['final_eval_loss']:.4f} "
                          f"({synced['command_s']:.0f} s)")
            unsynced = run_unsynced(procs, config_args, work, count)
            console.print(f"repeat {r + 1}/{args.repeats} unsynced: {unsynced['tokens_per_s']:,.0f} tok/s "
                          f"({unsynced['command_s']:.0f} s)")
            runs.append({"repeat": r + 1, "synced": synced, "unsynced": unsynced, "ratio": compare(synced, unsynced)})
        transport_result = transport(procs, Path(work_dir.name), args.transport_mib, args.fragment_mib,
                                     args.repeats, console)
    except KeyboardInterrupt:
        console.print("interrupted: stopping every child")
        raise SystemExit(130)
    finally:
        procs.stop_all()
        if args.keep:
            console.print(f"runs and logs kept in {work_dir.name}")
        else:
            work_dir.cleanup()

    median = {
        "goodput": statistics.median(r["synced"]["goodput"] for r in runs),
        "goodput_per_learner": [statistics.median(r["synced"]["learners"][m]["busy_fraction"] for r in runs)
                                for m in range(count)],
        "synced_tokens_per_s": statistics.median(r["synced"]["tokens_per_s"] for r in runs),
        "unsynced_tokens_per_s": statistics.median(r["unsynced"]["tokens_per_s"] for r in runs),
        "ratio": statistics.median(r["ratio"]["tokens_per_s"] for r in runs),
        "ratio_span": statistics.median(r["ratio"]["tokens_per_s_span"] for r in runs),
        "ratio_per_learner": [statistics.median(r["ratio"]["per_learner"][m] for r in runs) for m in range(count)],
    }
    results = {
        "tokens": config.token_budget(), "overrides": overrides, "speeds": speeds, "repeats": args.repeats,
        "definitions": {
            "goodput": "sum over learners of busy_s / sum of wall_s, in the synced run (busy includes the sleep "
                       "that emulates a slower chip)",
            "tokens_per_s": "sum over learners of tokens / wall_s (each learner's own wall, from its report)",
            "tokens_per_s_span": "total tokens / the longest learner wall_s",
            "transport": "MB/s = 1e6 bytes of fp32 payload per second; request/response, one message in flight",
        },
        "targets": {"goodput": GOODPUT_TARGET, "tokens_ratio": TOKENS_RATIO_TARGET},
        "met": {"goodput": median["goodput"] >= GOODPUT_TARGET, "tokens_ratio": median["ratio"] >= TOKENS_RATIO_TARGET},
        "median": median, "runs": runs, "transport": transport_result,
        "host_seconds": time.monotonic() - started, "cpus": os.cpu_count(),
    }
    print_tables(console, results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {out} ({results['host_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
