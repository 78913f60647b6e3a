"""How report figures are made and saved: one place for the matplotlib import, the look and the loss panels.

Figures are built as ``matplotlib.figure.Figure`` objects and saved with the Agg renderer, without pyplot:
no global backend switch, no figure left open if a plot fails halfway.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.errors import DilocoError
from diloco.report.run_records import EvalPoint

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 100


def require_matplotlib() -> None:
    """Fail in one line, before anything is written, when matplotlib (the 'plots' extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DilocoError("plots need matplotlib: pip install 'diloco[plots]'") from None


def new_figure(rows: int, columns: int, width: float, height: float) -> tuple[Figure, Any]:
    """A figure and its axes: one Axes for 1x1, else an array of them (squeezed like pyplot's subplots)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    return figure, figure.subplots(rows, columns)


def save(figure: Figure, path: Path) -> Path:
    """Write ``figure`` as a PNG at ``path`` (folders made as needed) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI, format="png")
    return path


def time_label(virtual: bool) -> str:
    return "virtual time since start (s)" if virtual else "time since start (s)"


def draw_eval_loss(by_time: Axes, by_tokens: Axes, points: list[EvalPoint], label: str, **style: Any) -> None:
    """Θ's eval loss against time on one panel and against tokens on the other, in the same style."""
    if len(points) <= 30:
        style.setdefault("marker", "o")
        style.setdefault("markersize", 3)
    by_time.plot([p.time_s for p in points], [p.loss for p in points], label=label, **style)
    by_tokens.plot([p.tokens for p in points], [p.loss for p in points], label=label, **style)


def finish_loss_panels(by_time: Axes, by_tokens: Axes, virtual: bool) -> None:
    """Axis labels, grid and legend shared by every loss figure."""
    by_time.set_xlabel(time_label(virtual))
    by_tokens.set_xlabel("tokens (all learners)")
    for axes in (by_time, by_tokens):
        axes.set_ylabel("loss")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
