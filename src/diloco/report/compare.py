"""Several runs side by side: one markdown table, Θ's eval loss overlaid, written to OUT/report.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.errors import DilocoError
from diloco.report.figures import draw_eval_loss, finish_loss_panels, new_figure, require_matplotlib, save
from diloco.report.run_records import SUMMARY, Run, load_run
from diloco.report.table import markdown_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LOSS_PLOT = "compare-loss.png"
REPORT = "report.md"


def compare_runs(run_dirs: list[Path], out: Path) -> tuple[str, list[Path]]:
    """Write ``out/compare-loss.png`` (when any run has an eval curve) and ``out/report.md``; return the
    markdown table and the paths written. Every folder is read first, so a bad one writes nothing."""
    if not run_dirs:
        raise DilocoError("nothing to compare: give at least one run folder")
    runs = [load_run(Path(folder)) for folder in run_dirs]
    require_matplotlib()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(runs)
    written = []
    figure = compare_loss_figure(runs)
    if figure is not None:
        written.append(save(figure, out / LOSS_PLOT))
    report = out / REPORT
    report.write_text(report_markdown(runs, table, [path.name for path in written], out), encoding="utf-8")
    written.append(report)
    return table, written


def compare_loss_figure(runs: list[Run]) -> Figure | None:
    """Θ's eval loss of every run, one line each, against time and against tokens."""
    curves = [(run, run.eval_points()) for run in runs]
    if not any(points for _, points in curves):
        return None
    figure, (by_time, by_tokens) = new_figure(1, 2, 11, 4.2)
    virtual = [run.is_virtual_time() for run, _ in curves]
    for index, (run, points) in enumerate(curves):
        if points:
            mixed_clocks = any(virtual) and not all(virtual)
            label = run.name + (" (virtual time)" if mixed_clocks and run.is_virtual_time() else "")
            draw_eval_loss(by_time, by_tokens, points, label, color=f"C{index % 10}", linewidth=1.5)
    finish_loss_panels(by_time, by_tokens, virtual=all(virtual))
    figure.suptitle("eval loss of Θ")
    return figure


def report_markdown(runs: list[Run], table: str, images: list[str], out: Path) -> str:
    """The report: the table, the plots, and a link to each run's folder (relative, so OUT can move along)."""
    lines = [
        "# diloco report", "",
        (f"{len(runs)} run(s); \"loss vs first\" is relative to `{runs[0].name}`. Wall clock: the whole command "
         "for `diloco run` (real), the simulated clock for `diloco sim` (virtual)."), "",
        table, "",
    ]
    for image in images:
        lines += [f"![{image}]({image})", ""]
    lines += ["## Runs", ""]
    for run in runs:
        folder = Path(os.path.relpath(run.folder.resolve(), out.resolve())).as_posix()
        plots = sorted((run.folder / "plots").glob("*.png"))
        links = ", ".join(f"[{p.stem}]({folder}/plots/{p.name})" for p in plots)
        lines.append(f"- [{run.name}]({folder}/{SUMMARY})" + (f": plots {links}" if links else ""))
    return "\n".join(lines) + "\n"
