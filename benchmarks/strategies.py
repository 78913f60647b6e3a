"""Data-parallel, DiLoCo and Streaming DiLoCo side by side at equal tokens, in the simulator.

    python benchmarks/strategies.py [--tokens N] [--set key=value ...] [--out FILE]

Prints a table and writes JSON (default benchmarks/results/strategies.json). Ratios are taken
against data-parallel (loss, bytes) and DiLoCo (peak bytes per sync) from the same run.
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

STRATEGIES = ("ddp", "diloco", "streaming")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4_000_000, help="total token budget of every run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for all runs")
    parser.add_argument("--out", default="benchmarks/results/strategies.json")
    args = parser.parse_args()

    console = Console()
    rows = []
    for strategy in STRATEGIES:
        config = load_config(None, ["learners.count=4", f"train.tokens={args.tokens}", *args.set,
                                    f"strategy={strategy}"])
        started = time.perf_counter()
        result = simulate(config)
        summary = result.summary()
        summary["host_seconds"] = time.perf_counter() - started
        rows.append(summary)
        console.print(f"{strategy}: eval loss {result.final_eval_loss:.4f} in {summary['host_seconds']:.0f} s")

    ddp = next(r for r in rows if r["strategy"] == "ddp")
    diloco = next(r for r in rows if r["strategy"] == "diloco")
    for r in rows:
        r["loss_vs_ddp"] = r["final_eval_loss"] / ddp["final_eval_loss"] - 1
        r["wire_bytes"] = r["wire_bytes_up"] + r["wire_bytes_down"]
        r["bytes_reduction_vs_ddp"] = (ddp["wire_bytes_up"] + ddp["wire_bytes_down"]) / r["wire_bytes"]
        r["peak_vs_diloco"] = r["peak_sync_bytes"] / diloco["peak_sync_bytes"]

    table = Table(title=f"strategies at {rows[0]['tokens']:,} tokens, 4 learners")
    for col in ("strategy", "eval loss", "vs ddp", "virtual time", "goodput", "wire bytes", "fewer bytes than ddp",
                "peak bytes/sync", "peak vs diloco"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["strategy"], f"{r['final_eval_loss']:.4f}", f"{100 * r['loss_vs_ddp']:+.2f}%",
                      f"{r['training_time_s']:.0f} s", f"{r['goodput']:.3f}", f"{r['wire_bytes'] / 1e6:.1f} MB",
                      f"{r['bytes_reduction_vs_ddp']:.0f}x", f"{r['peak_sync_bytes'] / 1e3:.0f} KB",
                      f"{r['peak_vs_diloco']:.2f}")
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("config", None)
    out.write_text(json.dumps({"tokens": args.tokens, "overrides": args.set, "runs": rows}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
