"""Compression of outer gradients: what each codec costs and buys.

    python benchmarks/compression.py [--part a] [--numel N] [--reps R] [--block B] [--threads T] [--out FILE]

Parts, each a function of its own, selectable with --part (repeatable; default all):
  a  encode and decode throughput per codec on this machine's CPU, in GB/s of fp32 input, next to
     tensor.clone() measured in the same run; the target is encoding at ≥ 25% of clone().

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


PARTS: dict[str, Callable[[argparse.Namespace, Console], dict[str, Any]]] = {"a": part_a_throughput}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", action="append", choices=sorted(PARTS), help="part to run (default: all)")
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements of the benchmark tensor")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions; the median is reported")
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="elements per scale")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
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
