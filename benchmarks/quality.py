"""Quality at equal tokens: does Decoupled DiLoCo converge as well as synchronous training?

    python benchmarks/quality.py [--tokens N] [--real-tokens N] [--parts sim,real] [--set key=value ...] [--out DIR]

Part `sim` (the simulator, default 10M tokens): ddp, diloco, streaming and decoupled at equal tokens,
on four equal learners and on mixed hardware (speeds 1, 1, 0.5, 0.25), every run with the default
step-time model (the noise measured from real runs). Part `real` (the real runtime, `diloco run`,
default budget): synchronous DiLoCo against Decoupled DiLoCo on the same two hardware mixes, and the
simulator's prediction of each decoupled run on the same config. Every ratio is against the
synchronous run of the same part and hardware, measured in this invocation.

Writes DIR/quality.json (every run's summary and the ratios), DIR/quality.md (the tables) and
DIR/quality.png (held-out loss against tokens and against time), and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from diloco.config import load_config
from diloco.sim import simulate

HARDWARE: dict[str, list[str]] = {
    "equal": ["learners.speeds=[1, 1, 1, 1]"],
    "mixed": ["learners.speeds=[1, 1, 0.5, 0.25]"],
}
SIM_STRATEGIES = ("ddp", "diloco", "streaming", "decoupled")
REAL_STRATEGIES = ("diloco", "decoupled")
# Short headers so the table fits a terminal of 100 columns.
COLUMNS = ("part", "hardware", "strategy", "loss", "/diloco", "/ddp", "learners", "time", "speed-up",
           "parts.", "stale", "wait")


def row_of(part: str, hardware: str, strategy: str, summary: dict[str, Any], host_s: float) -> dict[str, Any]:
    """The fields the tables and the JSON keep, from a simulator's or a launcher's summary.json."""
    stats = summary.get("round_stats") or {}
    tokens = summary["tokens"] or 1
    waited = [p["waiting_s"] for p in summary["per_learner"]]
    return {
        "part": part, "hardware": hardware, "strategy": strategy,
        "final_eval_loss": summary["final_eval_loss"],
        "learners_eval_loss_mean": summary.get("learners_eval_loss_mean"),
        # The training time: virtual in the simulator, the launcher's measured training wall-clock for real.
        "time_s": summary.get("training_time_s", summary["training_time_s"]),
        "tokens": summary["tokens"],
        "participants_mean": stats.get("participants_mean"),
        "stale_fraction": summary["tokens_stale"] / tokens,
        "learner_wait_s": max(waited) if waited else 0.0,
        "rounds": summary["rounds"],
        "eval_curve": summary["eval_curve"],
        "host_seconds": host_s,
        "summary": {k: v for k, v in summary.items() if k not in ("config", "eval_curve")},
    }


def simulated(part: str, hardware: str, strategy: str, tokens: int, extra: list[str], console: Console) -> dict:
    started = time.perf_counter()
    overrides = [f"strategy={strategy}", f"train.tokens={tokens}", *HARDWARE[hardware], *extra]
    summary = simulate(load_config(None, overrides)).summary()
    row = row_of(part, hardware, strategy, summary, time.perf_counter() - started)
    console.print(f"{part} {hardware} {strategy}: eval loss {row['final_eval_loss']:.4f}, "
                  f"{row['time_s']:.0f} s ({row['host_seconds']:.0f} s on this host)")
    return row


def real(hardware: str, strategy: str, tokens: int, extra: list[str], work: Path, console: Console) -> dict:
    """One `diloco run`, as a user starts it, in its own folder."""
    out = work / f"run-{hardware}-{strategy}"
    overrides = [f"strategy={strategy}", f"train.tokens={tokens}", *HARDWARE[hardware], *extra]
    command = [sys.executable, "-m", "diloco", "run", "--out", str(out)]
    for item in overrides:
        command += ["--set", item]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    row = row_of("real", hardware, strategy, summary, time.perf_counter() - started)
    console.print(f"real {hardware} {strategy}: eval loss {row['final_eval_loss']:.4f}, training "
                  f"{row['time_s']:.0f} s, participants {row['participants_mean'] or 0:.2f}")
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each run against the synchronous runs of its own part and hardware, measured in this invocation."""
    for r in rows:
        peers = {p["strategy"]: p for p in rows if p["part"] == r["part"] and p["hardware"] == r["hardware"]}
        sync, ddp = peers.get("diloco"), peers.get("ddp")
        r["loss_vs_diloco"] = r["final_eval_loss"] / sync["final_eval_loss"] if sync else None
        r["loss_vs_ddp"] = r["final_eval_loss"] / ddp["final_eval_loss"] if ddp else None
        r["speedup_vs_diloco"] = sync["time_s"] / r["time_s"] if sync else None


def predictions(rows: list[dict]) -> list[dict]:
    """The simulator's prediction of each real decoupled run, on the same config."""
    out = []
    for r in rows:
        if r["part"] != "real" or r["strategy"] != "decoupled":
            continue
        sim = next(p for p in rows if p["part"] == "predict" and p["hardware"] == r["hardware"])
        out.append({"hardware": r["hardware"], "real": r["final_eval_loss"], "sim": sim["final_eval_loss"],
                    "sim_over_real": sim["final_eval_loss"] / r["final_eval_loss"],
                    "real_participants": r["participants_mean"], "sim_participants": sim["participants_mean"]})
    return out


def ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}x"


def cells(r: dict) -> list[str]:
    return [r["part"], r["hardware"], r["strategy"], f"{r['final_eval_loss']:.4f}", ratio(r["loss_vs_diloco"]),
            ratio(r["loss_vs_ddp"]),
            "" if r["learners_eval_loss_mean"] is None else f"{r['learners_eval_loss_mean']:.4f}",
            f"{r['time_s']:.0f} s", ratio(r["speedup_vs_diloco"]),
            "" if r["participants_mean"] is None else f"{r['participants_mean']:.2f}",
            f"{r['stale_fraction']:.2f}", f"{r['learner_wait_s']:.1f} s"]


def markdown(rows: list[dict], agreement: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    if agreement:
        lines += ["", "| hardware | real decoupled | sim, same config | sim / real | participants real / sim |",
                  "|---|---|---|---|---|"]
        lines += [f"| {a['hardware']} | {a['real']:.4f} | {a['sim']:.4f} | {a['sim_over_real']:.3f}x | "
                  f"{a['real_participants'] or 0:.2f} / {a['sim_participants'] or 0:.2f} |" for a in agreement]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["part"], r["hardware"]) for r in rows})
    fig, axes = plt.subplots(2, len(groups), figsize=(5 * len(groups), 8), squeeze=False)
    for column, (part, hardware) in enumerate(groups):
        for r in (r for r in rows if (r["part"], r["hardware"]) == (part, hardware)):
            curve = r["eval_curve"]
            for line, x in enumerate(("tokens", "time_s")):
                axes[line][column].plot([p[x] for p in curve], [p["loss"] for p in curve], marker=".",
                                        label=r["strategy"])
        axes[0][column].set_title(f"{part}, {hardware}")
        axes[0][column].set_xlabel("tokens")
        axes[1][column].set_xlabel("virtual s" if part != "real" else "training wall-clock s")
        for line in (0, 1):
            axes[line][column].set_ylabel("held-out loss of Θ")
            axes[line][column].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10_000_000, help="token budget of the simulator part")
    parser.add_argument("--real-tokens", type=int, default=None,
                        help="token budget of the real part (default: the built-in config's)")
    parser.add_argument("--parts", default="sim,real", help="sim, real, or both")
    parser.add_argument("--hardware", default="equal,mixed", help="equal, mixed, or both")
    parser.add_argument("--set", action="append", default=[], help="an override for every run")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    hardware = [h for h in args.hardware.split(",") if h]
    if not parts <= {"sim", "real"} or not set(hardware) <= set(HARDWARE):
        parser.error(f"--parts takes sim,real and --hardware takes {','.join(HARDWARE)}")
    real_tokens = args.real_tokens or load_config(None, args.set).train.tokens
    console = Console(width=None if sys.stdout.isatty() else 132)  # a log file gets the whole table
    rows: list[dict] = []
    started = time.perf_counter()
    for h in hardware:
        if "sim" in parts:
            rows += [simulated("sim", h, s, args.tokens, args.set, console) for s in SIM_STRATEGIES]
        if "real" in parts:
            with tempfile.TemporaryDirectory(prefix="diloco-quality-") as work:
                rows += [real(h, s, real_tokens, args.set, Path(work), console) for s in REAL_STRATEGIES]
            rows.append(simulated("predict", h, "decoupled", real_tokens, args.set, console))
    add_ratios(rows)
    agreement = predictions(rows)

    table = Table(title=f"Quality at equal tokens (sim {args.tokens:,}, real {real_tokens:,})")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("part", "hardware", "strategy") else "right",
                         no_wrap=True)
    for r in rows:
        table.add_row(*cells(r))
    console.print(table)
    console.print("loss: Θ's held-out loss; learners: mean of the learners' own held-out losses; "
                  "parts.: mean participants per round; stale: share of tokens merged stale; "
                  "wait: the longest time a learner waited")
    for a in agreement:
        console.print(f"sim predicts real ({a['hardware']}): {a['sim']:.4f} vs {a['real']:.4f} "
                      f"({a['sim_over_real']:.3f}x)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(
        {"tokens": args.tokens, "real_tokens": real_tokens, "overrides": args.set, "runs": rows,
         "sim_vs_real": agreement, "host_seconds": time.perf_counter() - started}, indent=2) + "\n")
    (out / "quality.md").write_text(markdown(rows, agreement))
    plot(rows, out / "quality.png")
    console.print(f"wrote {out / 'quality.json'}, {out / 'quality.md'}, {out / 'quality.png'} "
                  f"in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
