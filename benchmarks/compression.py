"""Compression of outer gradients: what each codec costs and buys.

    python benchmarks/compression.py [--part a|b|c ...] [--numel N] [--reps R] [--block B] [--threads T]
                                     [--tokens N] [--bytes-tokens N] [--set key=value ...] [--out FILE]

Parts, each a function of its own, selectable with --part (repeatable; default all):
  a  encode and decode throughput per codec on this machine's CPU, in GB/s of fp32 input, next to
     tensor.clone() measured in the same run; the target is encoding at ≥ 25% of clone().
  b  quality: `decoupled` with each uplink/downlink codec pair against fp32, final eval loss at equal
     tokens in the simulator (--tokens); the target is int4 up within 0.5% of fp32.
  c  wire bytes: `decoupled` with H = 100 and int4 both ways against `ddp` at equal tokens
     (--bytes-tokens); the target is at least 1000x fewer bytes.

Prints a table per part and merges each part's results into JSON (default
benchmarks/results/compression.json) under the part's letter, so parts can be rerun one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from diloco.codecs import CODEC_NAMES, DEFAULT_BLOCK, get_codec

ENCODE_TARGET = 0.25
"""Encoding should run at no less than this fraction of clone() bandwidth."""


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of `fn` over `reps` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def part_a_throughput(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Encode and decode GB/s of fp32 input per codec, and as a ratio to clone() bandwidth."""
    load = os.getloadavg()[0]  # other work on the machine skews every ratio, multi-op codecs most
    torch.manual_seed(0)
    x = torch.randn(args.numel) * 1e-3
    gigabytes = x.numel() * x.element_size() / 1e9
    clone_s = median_seconds(x.clone, args.reps)
    rows = []
    for name in CODEC_NAMES:
        codec = get_codec(name, args.block)
        encoded = codec.encode(x)
        encode_s = median_seconds(lambda: codec.encode(x), args.reps)
        decode_s = median_seconds(lambda: codec.decode(encoded), args.reps)
        rows.append({"codec": name, "wire_bytes": encoded.wire_bytes(),
                     "bits_per_element": 8 * encoded.wire_bytes() / x.numel(),
                     "encode_s": encode_s, "decode_s": decode_s,
                     "encode_gb_s": gigabytes / encode_s, "decode_gb_s": gigabytes / decode_s,
                     "encode_vs_clone": clone_s / encode_s, "decode_vs_clone": clone_s / decode_s})

    table = Table(title=f"codec throughput on {x.numel():,} fp32 elements, block {args.block}, "
                        f"{torch.get_num_threads()} threads, load {load:.1f} on {os.cpu_count()} CPUs; "
                        f"clone() {gigabytes / clone_s:.2f} GB/s")
    for col in ("codec", "bits/element", "encode GB/s", "encode vs clone", "decode GB/s", "decode vs clone"):
        table.add_column(col, justify="right")
    for r in rows:
        mark = "" if r["encode_vs_clone"] >= ENCODE_TARGET else " [red](below target)[/red]"
        table.add_row(r["codec"], f"{r['bits_per_element']:.2f}", f"{r['encode_gb_s']:.2f}",
                      f"{r['encode_vs_clone']:.2f}{mark}", f"{r['decode_gb_s']:.2f}", f"{r['decode_vs_clone']:.2f}")
    console.print(table)
    return {"numel": x.numel(), "block": args.block, "reps": args.reps, "threads": torch.get_num_threads(),
            "load_before": load, "cpus": os.cpu_count(),
            "clone_s": clone_s, "clone_gb_s": gigabytes / clone_s, "encode_target_vs_clone": ENCODE_TARGET,
            "codecs": rows}


QUALITY_RUNS: list[tuple[str, list[str]]] = [
    ("fp32 / fp32", ["codec.up=fp32", "codec.down=fp32"]),
    ("bf16 / bf16", ["codec.up=bf16", "codec.down=bf16"]),
    ("int8 / bf16", ["codec.up=int8", "codec.down=bf16"]),
    ("int4 / bf16", ["codec.up=int4", "codec.down=bf16"]),
    ("int4 / int4", ["codec.up=int4", "codec.down=int4"]),
    ("fp4 / bf16", ["codec.up=fp4", "codec.down=bf16"]),
    ("fp4 + error feedback / bf16", ["codec.up=fp4", "codec.down=bf16", "codec.error_feedback=true"]),
]


def simulate_summary(overrides: list[str]) -> dict[str, Any]:
    from diloco.config import load_config
    from diloco.sim import simulate

    started = time.perf_counter()
    summary = simulate(load_config(None, overrides)).summary()
    summary.pop("config")
    summary["host_seconds"] = time.perf_counter() - started
    return summary


def part_b_quality(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Final eval loss of `decoupled` with each codec pair, against fp32, at equal tokens."""
    common = ["strategy=decoupled", f"train.tokens={args.tokens}", f"codec.block={args.block}", *args.set]
    rows = []
    for name, overrides in QUALITY_RUNS:
        summary = simulate_summary([*common, *overrides])
        rows.append({"codecs": name, "final_eval_loss": summary["final_eval_loss"],
                     "wire_bytes_up": summary["wire_bytes_up"], "wire_bytes_down": summary["wire_bytes_down"]})
        console.print(f"{name}: eval loss {summary['final_eval_loss']:.4f} ({summary['host_seconds']:.0f} s)")
    reference = rows[0]
    table = Table(title=f"decoupled at {args.tokens:,} tokens: codecs (up / down) against fp32")
    for col in ("codecs", "eval loss", "vs fp32", "bytes up", "fewer bytes up", "bytes down"):
        table.add_column(col, justify="right")
    for r in rows:
        r["loss_vs_fp32"] = r["final_eval_loss"] / reference["final_eval_loss"] - 1
        r["up_reduction"] = reference["wire_bytes_up"] / r["wire_bytes_up"]
        table.add_row(r["codecs"], f"{r['final_eval_loss']:.4f}", f"{100 * r['loss_vs_fp32']:+.2f}%",
                      f"{r['wire_bytes_up'] / 1e6:.1f} MB", f"{r['up_reduction']:.1f}x",
                      f"{r['wire_bytes_down'] / 1e6:.1f} MB")
    console.print(table)
    return {"tokens": args.tokens, "overrides": common, "runs": rows}


def part_c_bytes(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Total wire bytes of `decoupled` (H = 100, int4 both ways) against `ddp` at equal tokens."""
    common = [f"train.tokens={args.bytes_tokens}", "train.eval_points=1", *args.set]
    runs = {"ddp": simulate_summary([*common, "strategy=ddp"]),
            "decoupled H=100 int4/int4": simulate_summary([*common, "strategy=decoupled", "outer.H=100",
                                                           "codec.up=int4", "codec.down=int4"])}
    ddp_bytes = runs["ddp"]["wire_bytes_up"] + runs["ddp"]["wire_bytes_down"]
    table = Table(title=f"wire bytes at {args.bytes_tokens:,} tokens, 4 learners")
    for col in ("run", "tokens", "bytes up + down", "fewer than ddp", "eval loss"):
        table.add_column(col, justify="right")
    rows = []
    for name, s in runs.items():
        total = s["wire_bytes_up"] + s["wire_bytes_down"]
        rows.append({"run": name, "tokens": s["tokens"], "wire_bytes": total, "reduction_vs_ddp": ddp_bytes / total,
                     "final_eval_loss": s["final_eval_loss"]})
        table.add_row(name, f"{s['tokens']:,}", f"{total / 1e6:,.2f} MB", f"{ddp_bytes / total:,.0f}x",
                      f"{s['final_eval_loss']:.4f}")
    console.print(table)
    return {"tokens": args.bytes_tokens, "overrides": common, "runs": rows}


PARTS: dict[str, Callable[[argparse.Namespace, Console], dict[str, Any]]] = {
    "a": part_a_throughput, "b": part_b_quality, "c": part_c_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", action="append", choices=sorted(PARTS), help="part to run (default: all)")
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements of the benchmark tensor")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions; the median is reported")
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="elements per scale")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--tokens", type=int, default=1_200_000, help="token budget of each part b run")
    parser.add_argument("--bytes-tokens", type=int, default=4_800_000, help="token budget of the part c runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every simulated run (parts b and c)")
    parser.add_argument("--out", default="benchmarks/results/compression.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    console = Console()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for part in args.part or sorted(PARTS):
        results[part] = PARTS[part](args, console)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
