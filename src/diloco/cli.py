"""The `diloco` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from diloco import __version__
from diloco.config import load_config
from diloco.console import learners_table, print_table, progress_bars, results_table, show_outputs
from diloco.errors import DilocoError, print_error
from diloco.goodput.goodput_cli import add_arguments as add_goodput_arguments
from diloco.outputs import output_folder, write_output, writing
from diloco.plan.plan_cli import add_arguments as add_plan_arguments
from diloco.report.report_cli import add_arguments as add_report_arguments
from diloco.transport.token_cli import add_arguments as add_token_arguments
from diloco.launch.runtime_cli import (add_chaos_arguments, add_config_arguments, add_learner_arguments,
                                     add_run_arguments, cmd_chaos, cmd_learner, cmd_run)
from diloco.launch.syncer_cli import add_syncer_arguments, cmd_syncer


def cmd_sim(args: argparse.Namespace, console: Console) -> int:
    from diloco.metrics import open_metrics

    config = load_config(args.config, args.set or [])
    if any(f != "torch" for f in config.learners.frameworks):
        print("diloco: warning: learners.frameworks is ignored by `diloco sim`: every simulated learner trains "
              "the torch model (a JAX learner trains the same one; `diloco run` starts them)", file=sys.stderr)
    if any(n != 1 for n in config.learners.ranks) or config.learners.sharding:
        print("diloco: warning: learners.ranks and learners.sharding are ignored by `diloco sim`: every simulated "
              "learner is one process (`diloco run` starts rank groups)", file=sys.stderr)
    out = output_folder(Path(args.out) if args.out else
                        Path("runs") / f"sim-{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    with writing(out / "metrics.jsonl"):
        (out / "metrics.jsonl").unlink(missing_ok=True)
    metrics = open_metrics(out, tensorboard=config.metrics.tensorboard, wandb=config.metrics.wandb, origin=0.0)
    try:
        result = _simulate(config, metrics, args.quiet)
    finally:
        metrics.close()
    write_output(out / "summary.json", json.dumps(result.summary(), indent=2) + "\n")
    if not args.quiet:
        print_table(console, results_table(result))
        print_table(console, learners_table(result))
    show_outputs(console, out)
    return 0


def _simulate(config, metrics, quiet: bool):
    from diloco.sim import simulate  # torch loads here, not for `--help`

    if quiet:
        return simulate(config, metrics=metrics)
    else:
        with progress_bars(f"[bold]{config.strategy}[/]", "{task.completed:,}/{task.total:,} tokens") as bar:
            task = bar.add_task("train", total=config.train.tokens)
            return simulate(config, metrics=metrics,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))


def cmd_token(args: argparse.Namespace, console: Console) -> int:
    from diloco.transport.token_cli import run

    return run(args)


def cmd_goodput(args: argparse.Namespace, console: Console) -> int:
    from diloco.goodput.goodput_cli import run

    return run(args)


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from diloco.plan.plan_cli import run

    return run(args)


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from diloco.report.report_cli import run

    return run(args)


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments are refused as every other bad input is: one line saying why (no usage block), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="diloco", description=__doc__)
    parser.add_argument("--version", action="version", version=f"diloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)

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
        ("token", "print a learner's own credential, derived from the run secret", add_token_arguments, cmd_token),
        ("report", "plots of a run folder, or a table and plots comparing several", add_report_arguments,
         cmd_report),
        ("goodput", "goodput of a job of many chips under failures, by policy", add_goodput_arguments, cmd_goodput),
        ("plan", "capacity plan of a deployment: bytes, links, shards; what H, τ or codec fits", add_plan_arguments,
         cmd_plan),
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
        print_error(exc)
        return 2
    except OSError as exc:  # a file or folder the system refused: the path and why; other errors are bugs
        if args.verbose:
            traceback.print_exc()
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"diloco: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
