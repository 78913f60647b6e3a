"""The `diloco` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diloco import __version__
from diloco.config import load_config
from diloco.errors import DilocoError
from diloco.goodput.command import add_arguments as add_goodput_arguments
from diloco.report.command import add_arguments as add_report_arguments
from diloco.results import human_bytes
from diloco.runtime.commands import (add_chaos_arguments, add_config_arguments, add_learner_arguments,
                                     add_run_arguments, add_syncer_arguments, cmd_chaos, cmd_learner, cmd_run,
                                     cmd_syncer)


def results_table(result) -> Table:
    table = Table(title=f"diloco sim: {result.strategy}, {result.learners} learners")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("tokens", f"{result.tokens:,}"),
        ("final eval loss", f"{result.final_eval_loss:.4f}"),
        ("virtual wall-clock", f"{result.training_time_s:.1f} s"),
        ("goodput", f"{result.goodput:.3f}"),
        ("wire bytes up", human_bytes(result.wire_bytes_up)),
        ("wire bytes down", human_bytes(result.wire_bytes_down)),
        ("peak bytes per sync", human_bytes(result.peak_sync_bytes)),
        ("rounds", str(result.rounds)),
        ("tokens merged / stale / lost", f"{result.tokens_merged:,.0f} / {result.tokens_stale:,.0f} / "
                                         f"{result.tokens_lost:,.0f}"),
        *_round_rows(result),
        ("parameters", f"{result.parameters:,}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _round_rows(result) -> list[tuple[str, str]]:
    stats = result.round_stats
    if not stats:
        return []
    histogram = " ".join(f"{k}:{v}" for k, v in stats["participants_histogram"].items())
    staleness = " ".join(f"{k}:{v}" for k, v in stats["staleness_histogram"].items())
    rows = [("participants per round", f"{stats['participants_mean']:.2f} ({histogram})"),
            ("staleness, versions", staleness or "-"),
            ("rounds held open", f"{stats['held_s_total']:.2f} s ({stats['held_s_mean'] * 1000:.0f} ms each)")]
    if result.learners_eval_loss_mean is not None:
        rows.append(("learners' own eval loss, mean", f"{result.learners_eval_loss_mean:.4f}"))
    return rows


def learners_table(result) -> Table:
    table = Table(title="per learner")
    for col in ("learner", "speed", "tokens", "steps", "busy fraction", "waited", "rounds", "stale", "eval loss",
                "crashes", "bytes up", "bytes down"):
        table.add_column(col, justify="right")
    for r in result.per_learner:
        stale = sum(v for k, v in r.rounds.get("staleness_histogram", {}).items() if k != "0")
        table.add_row(str(r.learner), f"{r.speed:g}", f"{r.tokens:,}", str(r.steps), f"{r.busy_fraction:.3f}",
                      f"{r.waiting_s:.1f} s", str(r.rounds.get("rounds", "-")), str(stale) if r.rounds else "-",
                      f"{r.eval_loss:.4f}" if r.eval_loss is not None else "-", str(r.crashes),
                      human_bytes(r.bytes_up), human_bytes(r.bytes_down))
    return table


def cmd_sim(args: argparse.Namespace, console: Console) -> int:
    from diloco.metrics import open_metrics

    config = load_config(args.config, args.set or [])
    out = Path(args.out) if args.out else Path("runs") / f"sim-{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    metrics = open_metrics(out, tensorboard=config.metrics.tensorboard, wandb=config.metrics.wandb, origin=0.0)
    try:
        result = _simulate(config, metrics, args.quiet)
    finally:
        metrics.close()
    (out / "summary.json").write_text(json.dumps(result.summary(), indent=2) + "\n")
    plots = write_plots(out)
    if not args.quiet:
        console.print(results_table(result))
        console.print(learners_table(result))
    console.print(f"summary: {out / 'summary.json'}" + (f"; plots in {plots}" if plots else ""))
    return 0


def _simulate(config, metrics, quiet: bool):
    from diloco.sim import simulate  # torch loads here, not for `--help`

    if quiet:
        return simulate(config, metrics=metrics)
    else:
        columns = [TextColumn(f"[bold]{config.strategy}[/]"), BarColumn(),
                   TextColumn("{task.completed:,}/{task.total:,} tokens"),
                   TimeElapsedColumn()]
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("train", total=config.train.tokens)
            return simulate(config, metrics=metrics,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))


def write_plots(out: Path) -> Path | None:
    """The run's PNG plots, when matplotlib is installed (the `plots` extra)."""
    try:
        from diloco.report.plots import write_run_plots
    except ImportError:
        return None
    try:
        return out / "plots" if write_run_plots(out) else None
    except DilocoError:
        return None


def cmd_goodput(args: argparse.Namespace, console: Console) -> int:
    from diloco.goodput.command import run

    return run(args)


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from diloco.report.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco", description=__doc__)
    parser.add_argument("--version", action="version", version=f"diloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and more detail")
        p.add_argument("-q", "--quiet", action="store_true", help="print only the summary path")

    def add_sim_arguments(p: argparse.ArgumentParser) -> None:
        add_config_arguments(p)
        p.add_argument("--out", metavar="DIR", help="output folder for summary.json (default: runs/sim-...)")

    commands = [
        ("sim", "compare strategies in the simulator (virtual clock, real training)", add_sim_arguments, cmd_sim),
        ("run", "train for real: syncer shard(s) and learners as processes on this machine", add_run_arguments,
         cmd_run),
        ("chaos", "the real runtime with learners and syncers SIGKILLed, against a clean run", add_chaos_arguments,
         cmd_chaos),
        ("syncer", "serve one syncer shard (CPU only) for learners on any hosts", add_syncer_arguments, cmd_syncer),
        ("learner", "train the configured model as one learner of a run", add_learner_arguments, cmd_learner),
        ("report", "plots of a run folder, or a table and plots comparing several", add_report_arguments,
         cmd_report),
        ("goodput", "goodput of a job of many chips under failures, by policy", add_goodput_arguments, cmd_goodput),
    ]
    for name, help_text, add_arguments, handler in commands:
        command = sub.add_parser(name, help=help_text)
        add_arguments(command)
        common(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        return args.handler(args, console)
    except DilocoError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"diloco: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
