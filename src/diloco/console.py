"""What the commands show a user: result tables, live progress bars, and the run's plots.

Shared by `diloco sim` (cli.py) and the runtime's commands, so that neither imports the other; it
loads neither torch nor gRPC.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diloco.errors import DilocoError
from diloco.results import RunResult, human_bytes


def results_table(result: RunResult, title: str | None = None) -> Table:
    """The run as a whole: tokens, loss, time, bytes, rounds and where the tokens went."""
    table = Table(title=title or f"diloco sim: {result.strategy}, {result.learners} learners")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("tokens", f"{result.tokens:,}"),
        ("final eval loss", f"{result.final_eval_loss:.4f}"),
        (f"training time ({result.clock})", f"{result.training_time_s:.1f} s"),
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


def _round_rows(result: RunResult) -> list[tuple[str, str]]:
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


def learners_table(result: RunResult) -> Table:
    """One row per learner: what it trained, how busy it was, what it sent."""
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


def print_table(console: Console, table: Table) -> None:
    """A table whole. On a terminal rich fits it to the window; elsewhere (a CI log, `| tee`) it would cut
    it to 80 columns ("lea…", "spe…"), so it is printed as wide as it needs."""
    if console.is_terminal:
        console.print(table)
        return
    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    width = console.width
    console.width = max(width, needed)
    try:
        console.print(table)
    finally:
        console.width = width


def progress_bars(label: str, detail: str) -> Progress:
    """Live bars on stderr, so that stdout keeps only the tables; they vanish when the run ends.
    `label` and `detail` are rich column templates (e.g. "{task.description}")."""
    return Progress(TextColumn(label), BarColumn(), TextColumn(detail), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


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


def show_outputs(console: Console, out: Path) -> None:
    """Plot the finished run in `out`, then say where its summary and plots are."""
    plots = write_plots(out)
    console.print(f"summary: {out / 'summary.json'}" + (f"; plots in {plots}" if plots else ""))
