"""The plots of one run: loss, per-link bandwidth, round participation, regions, written as PNGs into DIR/plots.

Each figure is drawn only when the run recorded its data (a simulator run without metrics.jsonl still
has its eval curve in summary.json, so it gets loss.png, and with regions topology.png, and nothing else).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.report.figures import draw_eval_loss, finish_loss_panels, new_figure, require_matplotlib, save, time_label
from diloco.report.run_records import AllLearnersTokens, Record, Run, load_run, number
from diloco.report.topology_picture import topology_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SMOOTHING_SPAN = 20
"""Training loss is averaged over about 1/SMOOTHING_SPAN of each learner's records: noisy per step,
its trend is what matters next to Θ's eval loss."""


def write_run_plots(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write the plots ``run_dir`` has data for into ``out`` (default ``run_dir/plots``); return their paths."""
    return plot_run(load_run(Path(run_dir), need_summary=False), out)


def plot_run(run: Run, out: Path | None = None) -> list[Path]:
    """``write_run_plots`` for a run already read."""
    require_matplotlib()
    out = run.folder / "plots" if out is None else Path(out)
    written = []
    for name, draw in PLOTS.items():
        figure = draw(run)
        if figure is not None:
            written.append(save(figure, out / name))
    return written


def loss_figure(run: Run) -> Figure | None:
    """Θ's eval loss and each learner's smoothed training loss, against time and against tokens."""
    points = run.eval_points()
    all_tokens = AllLearnersTokens(run.of_kind("learner"))
    training = {learner: [r for r in records if number(r, "loss") is not None]
                for learner, records in run.by_learner().items()}
    training = {learner: records for learner, records in training.items() if records}
    if not points and not training:
        return None
    figure, (by_time, by_tokens) = new_figure(1, 2, 11, 4.2)
    for index, (learner, records) in enumerate(training.items()):
        losses = smooth([r["loss"] for r in records])
        style = {"color": f"C{index % 10}", "linewidth": 1, "alpha": 0.8}
        label = f"learner {learner} (training, smoothed)"
        by_time.plot([r["time_s"] for r in records], losses, label=label, **style)
        by_tokens.plot([all_tokens.at(r["time_s"]) for r in records], losses, label=label, **style)
    if points:
        draw_eval_loss(by_time, by_tokens, points, "Θ (eval)", color="black", linewidth=2, zorder=3)
    finish_loss_panels(by_time, by_tokens, run.is_virtual_time())
    figure.suptitle(f"{run.name}: loss")
    return figure


def bandwidth_figure(run: Run) -> Figure | None:
    """Bytes per second each learner's link carried up (to the syncer) and down, between its records."""
    rates = {(learner, key): link_rate(records, key)
             for learner, records in run.by_learner().items() for key in ("bytes_up", "bytes_down")}
    if not any(times for times, _ in rates.values()):
        return None
    from matplotlib.ticker import EngFormatter

    figure, (up, down) = new_figure(2, 1, 9, 6)
    up.sharex(down)
    learners = sorted({learner for learner, _ in rates})
    for (learner, key), (times, values) in rates.items():
        if times:
            axes = up if key == "bytes_up" else down
            color = f"C{learners.index(learner) % 10}"
            axes.step(times, values, where="pre", color=color, linewidth=1, label=f"learner {learner}")
    for axes, direction in ((up, "up (learner → syncer)"), (down, "down (syncer → learner)")):
        axes.set_title(direction, fontsize="medium")
        axes.yaxis.set_major_formatter(EngFormatter(unit="B/s"))
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
    down.set_xlabel(time_label(run.is_virtual_time()))
    figure.suptitle(f"{run.name}: bandwidth per link")
    return figure


def participation_figure(run: Run) -> Figure | None:
    """Per round, at the time it closed: how many learners it merged (colored by fragment), and how many
    of their pushes were stale."""
    rounds = [r for r in run.of_kind("round") if isinstance(r.get("participants"), list)]
    if not rounds:
        return None
    from matplotlib.ticker import MaxNLocator

    figure, axes = new_figure(1, 1, 9, 4)
    by_fragment: dict[int | None, list[Record]] = {}
    for record in rounds:
        fragment = record.get("fragment")
        by_fragment.setdefault(fragment if isinstance(fragment, int) else None, []).append(record)
    labelled = len(by_fragment) <= 10
    fragments_in_order = sorted(by_fragment.items(), key=lambda item: -1 if item[0] is None else item[0])
    for index, (fragment, mine) in enumerate(fragments_in_order):
        label = "participants" if fragment is None else f"fragment {fragment}"
        axes.scatter([r["time_s"] for r in mine], [len(r["participants"]) for r in mine], s=18,
                     color=f"C{index % 10}", label=label if labelled else None, zorder=2)
    stale = [(r["time_s"], number(r, "stale")) for r in rounds if number(r, "stale")]
    if stale:
        axes.scatter([t for t, _ in stale], [n for _, n in stale], marker="x", s=24, color="black",
                     label="stale pushes", zorder=3)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    highest = max([len(r["participants"]) for r in rounds] + [n for _, n in stale])
    axes.set_ylim(bottom=0, top=highest + 0.5)
    axes.set_xlabel(f"round close, {time_label(run.is_virtual_time())}")
    axes.set_ylabel("learners merged")
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    axes.set_title(f"{run.name}: participation per round ({len(rounds)} rounds)")
    return figure


PLOTS: dict[str, Callable[[Run], Figure | None]] = {
    "loss.png": loss_figure,
    "bandwidth.png": bandwidth_figure,
    "participation.png": participation_figure,
    "topology.png": topology_figure,
}


def link_rate(records: list[Record], key: str) -> tuple[list[float], list[float]]:
    """(times, bytes/s) from a cumulative byte counter, drawn as steps: each rate holds over the interval
    that ends at its time. A counter that goes down (a restarted learner process) restarts from zero."""
    times: list[float] = []
    rates: list[float] = []
    previous: tuple[float, float] | None = None
    for record in records:
        time_s, total = record["time_s"], number(record, key)
        if total is None:
            continue
        if previous is None:
            previous = (time_s, total)
            continue
        if time_s <= previous[0]:
            continue  # same instant: the next interval counts these bytes
        sent = total - previous[1] if total >= previous[1] else total
        rate = sent / (time_s - previous[0])
        if not times:
            times.append(previous[0])
            rates.append(rate)
        times.append(time_s)
        rates.append(rate)
        previous = (time_s, total)
    return times, rates


def smooth(values: list[float]) -> list[float]:
    """Debiased exponential moving average, its span about len(values)/SMOOTHING_SPAN."""
    weight = min(0.98, max(0.0, 1.0 - SMOOTHING_SPAN / max(len(values), 1)))
    smoothed, average, norm = [], 0.0, 0.0
    for value in values:
        average = weight * average + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        smoothed.append(average / norm)
    return smoothed
