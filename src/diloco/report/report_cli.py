"""`diloco report`: argparse wiring for run plots and comparisons (the lead's cli.py calls these two)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diloco.report.compare import compare_runs
from diloco.report.plots import plot_run
from diloco.report.link_figures import links_table
from diloco.report.run_records import Run, load_run
from diloco.report.table import markdown_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the report options to ``parser`` (the ``report`` subparser)."""
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                        help="run folder(s) written by `diloco sim` or `diloco run` (summary.json, metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, metavar="OUT",
                        help="one DIR: where its plots go (default DIR/plots); several: where report.md and "
                             "compare-loss.png go (default: the first DIR's parent folder / report)")


def run(args: argparse.Namespace) -> int:
    """Plot one run or compare several; print the markdown table(s), then the paths written."""
    quiet = getattr(args, "quiet", False)
    dirs: list[Path] = args.dirs
    if len(dirs) == 1:
        run_data = load_run(dirs[0], need_summary=False)
        written = plot_run(run_data, args.out)
        table = single_run_tables(run_data)
        if table is None:
            print(f"{dirs[0]} has no summary.json (the run did not finish?): plots only", file=sys.stderr)
        if not written:
            print(f"{dirs[0]}: nothing to plot (no eval curve, learner or round records)", file=sys.stderr)
    else:
        out = args.out if args.out is not None else default_compare_out(dirs)
        table, written = compare_runs(dirs, out)
    if table is not None and not quiet:
        print(table)
        print()
    for path in written:
        print(f"wrote {path}")
    return 0


def single_run_tables(run_data: Run) -> str | None:
    """The run's row and, for a run with regions, its links: what each WAN and LAN link carried. None for
    a run without summary.json."""
    if run_data.summary is None:
        return None
    return "\n\n".join(filter(None, [markdown_table([run_data]), links_table(run_data.summary)]))


def default_compare_out(dirs: list[Path]) -> Path:
    """Next to the runs, not inside one of them: runs/a runs/b -> runs/report."""
    return dirs[0].resolve().parent / "report"
