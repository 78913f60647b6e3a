"""One markdown row per finished run: the numbers people compare runs by, the first run as baseline."""

from __future__ import annotations

from typing import Any

from diloco.report.run_records import Run, clock_of, number
from diloco.results import human_bytes

COLUMNS = ("run", "strategy", "learners", "tokens", "final eval loss", "loss vs first", "wall clock", "goodput",
           "bytes up+down", "rounds")
MISSING = "n/a"


def markdown_table(runs: list[Run]) -> str:
    """The table, header included; every run must have a summary."""
    baseline = number(_summary(runs[0]), "final_eval_loss") if runs else None
    lines = [markdown_row(COLUMNS), markdown_row(["---", "---"] + ["---:"] * (len(COLUMNS) - 2))]
    for index, run in enumerate(runs):
        summary = _summary(run)
        loss = number(summary, "final_eval_loss")
        if index == 0:
            versus = "baseline"
        elif loss is None or not baseline:
            versus = MISSING
        else:
            versus = f"{100 * (loss / baseline - 1):+.2f}%"
        up, down = number(summary, "wire_bytes_up"), number(summary, "wire_bytes_down")
        lines.append(markdown_row([
            run.name,
            str(summary.get("strategy", MISSING)),
            _integer(summary, "learners"),
            _integer(summary, "tokens"),
            MISSING if loss is None else f"{loss:.4f}",
            versus,
            wall_clock(summary),
            _fixed(summary, "goodput", 3),
            MISSING if up is None or down is None else human_bytes(up + down),
            _integer(summary, "rounds"),
        ]))
    return "\n".join(lines)


def wall_clock(summary: dict[str, Any]) -> str:
    """The real run's whole-command time, else the simulator's virtual one, saying which it is."""
    if clock_of(summary) == "real":
        real = number(summary, "wall_clock_s")
        return MISSING if real is None else f"{duration(real)} (real)"
    virtual = number(summary, "training_time_s")
    return MISSING if virtual is None else f"{duration(virtual)} (virtual)"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _summary(run: Run) -> dict[str, Any]:
    if run.summary is None:
        raise ValueError(f"{run.folder}: a table row needs summary.json")  # load_run(need_summary=True) prevents it
    return run.summary


def _integer(summary: dict[str, Any], key: str) -> str:
    value = number(summary, key)
    return MISSING if value is None else f"{value:,.0f}"


def _fixed(summary: dict[str, Any], key: str, digits: int) -> str:
    value = number(summary, key)
    return MISSING if value is None else f"{value:.{digits}f}"


def markdown_row(cells: Any) -> str:
    """One table line; a `|` inside a cell is escaped so that it stays one cell."""
    return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"
