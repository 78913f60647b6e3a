"""Turning results into what people read: a rich table, a JSON payload, a comparison, a plot."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from diloco.errors import DilocoError
from diloco.goodput.calibrate import Calibration
from diloco.goodput.model import GoodputResult
from diloco.goodput.params import GoodputParams
from diloco.goodput.published import published


@dataclass(frozen=True)
class Comparison:
    """One cell where the paper has a number: ours against theirs, in percent."""

    policy: str
    chips: int
    ours: float
    paper: float

    @property
    def delta(self) -> float:
        return self.ours - self.paper

    def as_dict(self) -> dict[str, str | int | float]:
        return {"policy": self.policy, "chips": self.chips, "ours": round(self.ours, 3), "paper": self.paper}


def compare(results: list[GoodputResult]) -> list[Comparison]:
    """Every result the paper also reports."""
    cells = []
    for r in results:
        paper = published(r.policy, r.chips)
        if paper is not None:
            cells.append(Comparison(r.policy, r.chips, 100.0 * r.goodput, paper))
    return cells


def rmse_by_policy(cells: list[Comparison]) -> dict[str, float]:
    """Root-mean-square gap in percentage points, per policy row."""
    rows: dict[str, list[float]] = {}
    for c in cells:
        rows.setdefault(c.policy, []).append(c.delta)
    return {p: math.sqrt(sum(d * d for d in ds) / len(ds)) for p, ds in rows.items()}


def payload(
    params: GoodputParams, results: list[GoodputResult], calibration: Calibration | None
) -> dict[str, object]:
    """Everything a run computed, as plain JSON types."""
    cells = compare(results)
    data: dict[str, object] = {
        "params": params.as_dict(),
        "results": [r.as_dict() for r in results],
        "comparison": [c.as_dict() for c in cells],
        "comparison_rmse_points": {p: round(v, 3) for p, v in rmse_by_policy(cells).items()},
    }
    if calibration is not None:
        data["calibration"] = calibration.as_dict()
    return data


def _chip_label(chips: int) -> str:
    if chips >= 1_000_000 and chips % 100_000 == 0:
        return f"{chips / 1_000_000:g}M"
    if chips >= 1000 and chips % 1000 == 0:
        return f"{chips // 1000}k"
    return str(chips)


def _by_policy(results: list[GoodputResult]) -> tuple[list[int], dict[str, dict[int, GoodputResult]]]:
    chips: list[int] = []
    rows: dict[str, dict[int, GoodputResult]] = {}
    for r in results:
        if r.chips not in chips:
            chips.append(r.chips)
        rows.setdefault(r.policy, {})[r.chips] = r
    return chips, rows


def results_table(results: list[GoodputResult], hours: float) -> Table:
    """Goodput and uptime, one row per policy, one column per job size."""
    chips, rows = _by_policy(results)
    table = Table(title=f"Goodput / uptime (%), {hours:g} simulated hours per cell")
    table.add_column("policy", no_wrap=True)
    for n in chips:
        table.add_column(_chip_label(n), justify="right")
    for policy, cells in rows.items():
        table.add_row(policy, *(f"{100 * cells[n].goodput:.1f} / {100 * cells[n].uptime:.1f}" for n in chips))
    return table


def comparison_table(cells: list[Comparison]) -> Table:
    """Ours against the paper's goodput for every cell it reports, with the gap."""
    chips = sorted({c.chips for c in cells})
    table = Table(title="Goodput (%): ours / paper (ours - paper)")
    table.add_column("policy", no_wrap=True)
    for n in chips:
        table.add_column(_chip_label(n), justify="right")
    table.add_column("RMSE", justify="right")
    rmse = rmse_by_policy(cells)
    rows: dict[str, dict[int, Comparison]] = {}
    for c in cells:
        rows.setdefault(c.policy, {})[c.chips] = c
    for policy, row in rows.items():
        values = [f"{row[n].ours:.1f} / {row[n].paper:g} ({row[n].delta:+.1f})" if n in row else "" for n in chips]
        table.add_row(policy, *values, f"{rmse[policy]:.1f}")
    return table


def print_report(
    console: Console,
    params: GoodputParams,
    results: list[GoodputResult],
    calibration: Calibration | None,
    show_comparison: bool,
) -> None:
    """The human-readable output of ``diloco goodput``."""
    if calibration is not None:
        pairs = zip(calibration.chips, calibration.fitted, calibration.target)
        fitted = ", ".join(f"{_chip_label(n)} {v:.1f}/{t:g}" for n, v, t in pairs)
        console.print(
            f"calibrated restart_s = {calibration.params.restart_s:g} s "
            f"(data-parallel RMSE {calibration.rmse:.2f} points; ours/paper: {fitted})"
        )
    console.print(results_table(results, params.hours))
    if show_comparison:
        cells = compare(results)
        if cells:
            console.print(comparison_table(cells))
        else:
            console.print("no cell of this run is in the paper's table (its sizes: 150k..2.4M chips)")


def require_matplotlib() -> None:
    """Fail early, in one line, when a plot is asked for and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DilocoError(
            "--out draws goodput.png with matplotlib, which is missing: pip install 'diloco[plots]'"
        ) from None


def write_outputs(out: Path, data: dict[str, object], results: list[GoodputResult], with_paper: bool) -> None:
    """Write ``goodput.json`` and ``goodput.png`` (goodput against chips, log-x) into ``out``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "goodput.json").write_text(json.dumps(data, indent=2) + "\n")
    chips, rows = _by_policy(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, cells in rows.items():
        (line,) = ax.plot(chips, [100 * cells[n].goodput for n in chips], marker="o", label=policy)
        if with_paper:
            paper = [(n, published(policy, n)) for n in chips]
            xs = [n for n, p in paper if p is not None]
            ys = [p for _, p in paper if p is not None]
            if xs:
                ax.plot(xs, ys, linestyle=":", marker="x", color=line.get_color())
    ax.set_xscale("log")
    ax.set_xticks(chips, [_chip_label(n) for n in chips])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    title = "Goodput under chip failures" + (" (dotted: paper)" if with_paper else "")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=120)
    plt.close(fig)
