"""Mixed hardware, with and without a crash: every strategy at equal total tokens, in the simulator.

    python benchmarks/heterogeneous.py [--tokens N] [--set key=value ...] [--out DIR]

Four learners with speeds 1, 1, 0.5 and 0.25 and 10% jitter per step. Strategies: ddp, diloco, async,
async-dn, and decoupled with K = 1 and grace, K = 1 without grace, and K = 4. Then the same again with
learner 1 (a fast one) crashing at half of that strategy's own failure-free run and coming back
`--recovery` seconds later. Writes DIR/heterogeneous.json, DIR/heterogeneous.md (a markdown table) and
DIR/heterogeneous.png (eval loss against virtual time), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from diloco.config import load_config
from diloco.sim import simulate

VARIANTS: list[tuple[str, list[str]]] = [
    ("ddp", ["strategy=ddp"]),
    ("diloco", ["strategy=diloco"]),
    ("async", ["strategy=async"]),
    ("async-dn", ["strategy=async-dn"]),
    ("decoupled K=1 + grace", ["strategy=decoupled", "outer.quorum=1"]),
    ("decoupled K=1, no grace", ["strategy=decoupled", "outer.quorum=1", "outer.grace=0"]),
    ("decoupled K=4", ["strategy=decoupled", "outer.quorum=4"]),
]
HARDWARE = ["learners.speeds=[1, 1, 0.5, 0.25]", "learners.jitter=0.1"]
COLUMNS = ("run", "eval loss", "vs diloco", "virtual time", "speed-up vs diloco", "goodput", "min goodput (others)",
           "wire MB", "tokens lost", "stale share")


def run_one(name: str, overrides: list[str], console: Console) -> dict:
    started = time.perf_counter()
    result = simulate(load_config(None, overrides))
    row = result.summary()
    row.pop("config")
    row["name"] = name
    row["host_seconds"] = time.perf_counter() - started
    console.print(f"{name}: eval loss {result.final_eval_loss:.4f}, virtual {result.training_time_s:.0f} s, "
                  f"goodput {result.goodput:.3f} ({row['host_seconds']:.0f} s)")
    return row


def add_ratios(rows: list[dict], crashed: int | None) -> None:
    reference = next(r for r in rows if r["strategy"] == "diloco")
    for r in rows:
        r["loss_vs_diloco"] = r["final_eval_loss"] / reference["final_eval_loss"] - 1
        r["speedup_vs_diloco"] = reference["training_time_s"] / r["training_time_s"]
        others = [p["busy_fraction"] for p in r["per_learner"] if p["learner"] != crashed]
        r["min_goodput_others"] = min(others)
        r["stale_share"] = r["tokens_stale"] / r["tokens"] if r["tokens"] else 0.0


def table_rows(rows: list[dict]) -> list[list[str]]:
    return [[r["name"], f"{r['final_eval_loss']:.4f}", f"{100 * r['loss_vs_diloco']:+.2f}%",
             f"{r['training_time_s']:.0f} s", f"{r['speedup_vs_diloco']:.2f}x", f"{r['goodput']:.3f}",
             f"{r['min_goodput_others']:.3f}", f"{(r['wire_bytes_up'] + r['wire_bytes_down']) / 1e6:.1f}",
             f"{r['tokens_lost']:,.0f}", f"{r['stale_share']:.2f}"] for r in rows]


def markdown(title: str, rows: list[dict]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    return "\n".join(lines) + "\n"


def plot(sections: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sections), figsize=(7 * len(sections), 5), sharey=True)
    for ax, (title, rows) in zip(axes, sections.items()):
        for r in rows:
            curve = r["eval_curve"]
            ax.plot([p["time_s"] for p in curve], [p["loss"] for p in curve], marker="o", ms=3, label=r["name"])
        ax.set_title(title)
        ax.set_xlabel("virtual wall-clock (s)")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out loss")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_200_000, help="total token budget of every run")
    parser.add_argument("--recovery", type=float, default=20.0, help="seconds from the crash until the learner is back")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for all runs")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON, markdown and PNG")
    parser.add_argument("--only", help="comma-separated subset of run names (for a quick look)")
    args = parser.parse_args()
    variants = [v for v in VARIANTS if not args.only or v[0] in args.only.split(",")]
    if not any(name == "diloco" for name, _ in variants):
        variants.insert(0, VARIANTS[1])

    console = Console()
    common = [f"train.tokens={args.tokens}", *HARDWARE, *args.set]
    healthy = [run_one(name, [*common, *o], console) for name, o in variants]
    crash_at = {r["name"]: r["training_time_s"] / 2 for r in healthy}
    crashed = [run_one(name, [*common, *o, f"failures.crashes=[{{learner = 1, at_s = {crash_at[name]}}}]",
                              f"failures.recovery_s={args.recovery}"], console) for name, o in variants]
    add_ratios(healthy, crashed=None)
    add_ratios(crashed, crashed=1)
    sections = {"no failures": healthy, f"learner 1 crashes mid-run, back after {args.recovery:g} s": crashed}

    for title, rows in sections.items():
        table = Table(title=f"{title} ({args.tokens:,} tokens, speeds 1, 1, 0.5, 0.25)")
        for col in COLUMNS:
            table.add_column(col, justify="right")
        for cells in table_rows(rows):
            table.add_row(*cells)
        console.print(table)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heterogeneous.json").write_text(json.dumps(
        {"tokens": args.tokens, "overrides": common, "recovery_s": args.recovery, "sections": sections},
        indent=2) + "\n")
    (out / "heterogeneous.md").write_text("".join(markdown(t, rows) + "\n" for t, rows in sections.items()))
    plot(sections, out / "heterogeneous.png")
    console.print(f"wrote {out}/heterogeneous.json, .md and .png")


if __name__ == "__main__":
    main()
