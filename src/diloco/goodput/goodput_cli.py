"""`diloco goodput`: argparse wiring for the goodput model (the lead's cli.py calls these two)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from diloco.errors import DilocoError
from diloco.goodput.calibrate import Calibration, calibrate
from diloco.goodput.model import sweep
from diloco.goodput.params import GoodputParams
from diloco.goodput.policies import Policy
from diloco.goodput.published import PUBLISHED_CHIPS
from diloco.goodput.report import payload, print_report, require_matplotlib, write_outputs

_DEFAULTS = GoodputParams()
_DEFAULT_LEARNERS = "2,4,8,16"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every goodput option to ``parser`` (the ``goodput`` subparser)."""
    d = _DEFAULTS
    run = parser.add_argument_group("what to run")
    run.add_argument("--chips", default=",".join(str(n) for n in PUBLISHED_CHIPS), metavar="N,N,...",
                     help="job sizes in chips (default: the paper's 150k..2.4M)")
    run.add_argument("--learners", default=_DEFAULT_LEARNERS, metavar="M,M,...",
                     help=f"decoupled learner counts, each must divide every size (default {_DEFAULT_LEARNERS})")
    run.add_argument("--quorum", type=int, default=d.quorum, metavar="K",
                     help="decoupled: progress needs at least K learners up (default %(default)s)")
    run.add_argument("--hours", type=float, default=d.hours, metavar="H",
                     help="simulated wall-clock hours per cell (default %(default)s)")
    run.add_argument("--seed", type=int, default=d.seed, metavar="S", help="random seed (default %(default)s)")
    run.add_argument("--calibrate", action="store_true",
                     help="first fit --restart so data-parallel matches the paper's row, then run with it")
    run.add_argument("--compare", action="store_true", help="also print ours against the paper's goodput, every cell")
    run.add_argument("--json", action="store_true", help="print JSON to stdout instead of tables")
    run.add_argument("--out", type=Path, default=None, metavar="DIR",
                     help="write DIR/goodput.json and the plot DIR/goodput.png (needs the 'plots' extra)")

    model = parser.add_argument_group("failure model (defaults: calibrated, see docs/goodput.md)")
    model.add_argument("--mtbi-hours", type=float, default=d.mtbi_hours, metavar="H",
                       help="chip mean time between interruptions (default one year: %(default)s)")
    model.add_argument("--detect", type=float, default=d.detect_s, metavar="SECONDS",
                       help="failure detection time (default %(default)s)")
    model.add_argument("--restart", type=float, default=d.restart_s, metavar="SECONDS",
                       help="restart of the failed job / slice / learner on healthy chips (default %(default)s)")
    model.add_argument("--checkpoint-interval", type=_seconds_or_auto, default=None, metavar="SECONDS|auto",
                       help="data-parallel running time between checkpoints (default auto: Young's sqrt(2 C MTBF))")
    model.add_argument("--checkpoint-cost", type=float, default=d.checkpoint_cost_s, metavar="SECONDS",
                       help="stall per data-parallel checkpoint (default %(default)s)")
    model.add_argument("--reconfigure", type=float, default=None, metavar="SECONDS",
                       help="elastic: every chip pauses this long after detection to drop a slice (default: --restart)")
    model.add_argument("--step", type=float, default=d.step_s, metavar="SECONDS",
                       help="elastic: synchronous step time; a failure loses the in-flight step (default %(default)s)")
    model.add_argument("--sync-interval", type=float, default=d.sync_interval_s, metavar="SECONDS",
                       help="decoupled: a learner's work reaches the syncer this often (default %(default)s)")
    model.add_argument("--slice-chips", type=int, default=d.slice_chips, metavar="N",
                       help="elastic: chips per slice (default %(default)s)")
    model.add_argument("--spares", type=float, default=d.spare_fraction, metavar="FRACTION",
                       help="hot spare chips as a fraction of the job (default %(default)s)")
    model.add_argument("--swap", type=float, default=d.swap_s, metavar="SECONDS",
                       help="time to swap in a free spare (default %(default)s)")
    model.add_argument("--repair", type=float, default=d.repair_s, metavar="SECONDS",
                       help="time before a failed chip is a spare again (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Simulate, print (table or JSON), optionally write files; DilocoError for user errors."""
    params = params_from_args(args).validate()
    chips = _int_list("--chips", args.chips)
    learners = _int_list("--learners", args.learners)
    policies = Policy.standard(learners)
    if args.out is not None:
        require_matplotlib()
    calibration: Calibration | None = None
    if args.calibrate:
        calibration = calibrate(params)
        params = calibration.params
    results = sweep(chips, policies, params)
    data = payload(params, results, calibration)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_report(Console(), params, results, calibration, show_comparison=args.compare or args.calibrate)
    if args.out is not None:
        write_outputs(args.out, data, results, with_paper=args.compare or args.calibrate)
    return 0


def params_from_args(args: argparse.Namespace) -> GoodputParams:
    """The model parameters the options describe (not yet validated)."""
    return replace(
        _DEFAULTS,
        mtbi_hours=args.mtbi_hours,
        detect_s=args.detect,
        restart_s=args.restart,
        checkpoint_interval_s=args.checkpoint_interval,
        checkpoint_cost_s=args.checkpoint_cost,
        reconfigure_s=args.reconfigure,
        step_s=args.step,
        sync_interval_s=args.sync_interval,
        slice_chips=args.slice_chips,
        spare_fraction=args.spares,
        swap_s=args.swap,
        repair_s=args.repair,
        quorum=args.quorum,
        hours=args.hours,
        seed=args.seed,
    )


def _int_list(option: str, text: str) -> list[int]:
    """Parse '150000,300000' into positive integers, or say which option is wrong and why."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        try:
            value = int(part)
        except ValueError:
            raise DilocoError(f"{option} expects comma-separated positive integers, got {text!r}") from None
        if value < 1:
            raise DilocoError(f"{option} must be positive integers, got {value}")
        values.append(value)
    return values


def _seconds_or_auto(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    return float(text)
