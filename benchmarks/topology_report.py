"""topology.py's settings and targets, and its report: the tables of runs and targets, and the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


SETTINGS: list[tuple[str, list[str]]] = [
    ("flat", ["topology=flat"]),
    ("regional", ["topology=regional", "regional.push_every=1"]),
    ("regional, push_every 2", ["topology=regional", "regional.push_every=2"]),
    ("flat, placement links", ["topology=flat", "placement=links"]),
    ("regional, placement links", ["topology=regional", "regional.push_every=1", "placement=links"]),
]
SPREAD = "placement links"
WAN_TARGET = 2.0
LOSS_TARGET = 1.01
TIME_TARGET = 1.0
GOODPUT_TARGET = 0.97
RUN_TIMEOUT_S = 3600.0


# ---------------------------------------------------------------- tables, plot


def label(r: dict[str, Any]) -> str:
    return r["setting"] + (" + outage" if r["outage"] else "")


def fmt(value: Any, spec: str, missing: str = "–") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def print_tables(rows: list[dict[str, Any]], title: str, console: Console, seeds: bool) -> None:
    main = Table(title=title)
    for col in (["seed"] if seeds else []) + ["run", "final loss", "/ flat", "WAN MB", "flat / this", "LAN MB",
                                              "busiest WAN %", "time s", "/ flat", "dup"]:
        main.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        busiest = r["wan_busiest"] * 100 if r.get("wan_busiest") is not None else None
        main.add_row(*([str(r["seed"])] if seeds else []), label(r), fmt(r["final_eval_loss"], ".4f"),
                     fmt(r["loss_vs_flat"], ".4f"), fmt(r["wan_bytes"] / 1e6, ".2f"),
                     fmt(r["wan_flat_over_this"], ".2f"), fmt(r["lan_bytes"] / 1e6, ".2f"), fmt(busiest, ".2f"),
                     fmt(r["training_time_s"], ".3f"), fmt(r["time_vs_flat"], ".3f"), str(r["duplicates"]))
    console.print(main)

    tokens = Table(title="tokens and the outage (lost: outage region / others; busy: others' mean busy fraction, "
                         "without → with the outage)")
    for col in (["seed"] if seeds else []) + ["run", "trained", "merged", "stale", "lost", "lost: region / others",
                                              "outage region busy", "others busy", "others' goodput", "min"]:
        tokens.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        busy = (f"{r['others_busy_fraction_no_outage']:.3f} → {r['others_busy_fraction']:.3f}"
                if r["others_busy_fraction"] is not None and r["others_busy_fraction_no_outage"] is not None else "–")
        tokens.add_row(*([str(r["seed"])] if seeds else []), label(r), f"{r['tokens']:,}",
                       f"{r['tokens_merged']:,.0f}", f"{r['tokens_stale']:,.0f}", f"{r['tokens_lost']:,.0f}",
                       f"{r['tokens_lost_outage_region']:,.0f} / {r['tokens_lost_others']:,.0f}",
                       fmt(r["outage_region_busy_fraction"], ".3f"), busy, fmt(r["goodput_others"], ".3f"),
                       fmt(r["goodput_others_min"], ".3f"))
    console.print(tokens)

    names = list(dict.fromkeys(n for r in rows for n in r["wan_links"]))
    if names:
        links = Table(title="bytes per WAN link, both directions (MB)")
        for col in (["seed"] if seeds else []) + ["run", *names]:
            links.add_column(col, justify="left" if col == "run" else "right")
        for r in rows:
            links.add_row(*([str(r["seed"])] if seeds else []), label(r),
                          *(fmt(r["wan_links"].get(n, {}).get("bytes", 0) / 1e6, ".2f") for n in names))
        console.print(links)


def print_targets(checks: list[dict[str, Any]], console: Console, seeds: bool) -> None:
    table = Table(title="targets (regional against flat, same seed and outage setting)")
    names = list(dict.fromkeys(k for c in checks for k in c["checks"]))
    for col in (["seed"] if seeds else []) + ["run", *names]:
        table.add_column(col, justify="left" if col == "run" else "right")
    for c in checks:
        cells = []
        for n in names:
            got = c["checks"].get(n)
            if got is None:
                cells.append("")
                continue
            text = fmt(got["value"], ",.0f" if n.startswith("tokens") else ".4f")
            cells.append(f"{text} [green]met[/]" if got["met"] else f"{text} [red]not met[/]")
        table.add_row(*([str(c["seed"])] if seeds else []), c["setting"] + (" + outage" if c["outage"] else ""),
                      *cells)
    console.print(table)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [name for name, _ in SETTINGS]
    fig, axes = plt.subplots(1, 3, figsize=(20, 5.2))
    width = 0.38
    for i, outage in enumerate((False, True)):
        def mean(key: str, setting: str) -> float:
            values = [r[key] for r in rows if r["setting"] == setting and bool(r["outage"]) == outage
                      and r[key] is not None]
            return sum(values) / len(values) if values else float("nan")

        xs = [k + (i - 0.5) * width for k in range(len(settings))]
        name = "with outage" if outage else "no outage"
        color = "tab:red" if outage else "tab:blue"
        wan = [mean("wan_bytes", s) / 1e6 for s in settings]
        axes[0].bar(xs, wan, width, label=name, color=color, alpha=0.8)
        loss = [mean("final_eval_loss", s) for s in settings]
        axes[1].bar(xs, loss, width, label=name, color=color, alpha=0.8)
        for ax, values, spec in ((axes[0], wan, ".1f"), (axes[1], loss, ".4f")):
            for x, v in zip(xs, values):
                if not math.isnan(v):
                    ax.annotate(format(v, spec), (x, v), ha="center", va="bottom", fontsize=7)
        if outage:
            good = [mean("goodput_others", s) for s in settings]
            axes[2].bar(range(len(settings)), good, 0.5, color=color, alpha=0.8, label="mean of others")
            low = [mean("goodput_others_min", s) for s in settings]
            axes[2].scatter(range(len(settings)), low, color="black", zorder=3, label="lowest learner")
            for x, v in enumerate(good):
                if not math.isnan(v):
                    axes[2].annotate(f"{v:.3f}", (x, v), ha="center", va="bottom", fontsize=7)
    axes[0].set_title("WAN bytes (MB, both directions)")
    axes[1].set_title("final held-out loss")
    losses = [r["final_eval_loss"] for r in rows]
    axes[1].set_ylim(min(losses) - 0.05, max(losses) + 0.03)
    axes[2].set_title("others' goodput in the outage run (busy, outage / none)")
    axes[2].axhline(GOODPUT_TARGET, color="gray", ls="--", lw=1, label=f"target {GOODPUT_TARGET:g}")
    axes[2].set_ylim(0.8, 1.05)
    for ax in axes:
        ax.set_xticks(range(len(settings)))
        ax.set_xticklabels([s.replace(", ", ",\n") for s in settings], fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
