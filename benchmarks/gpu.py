"""A learner on a GPU: does syncing cost anything next to a plain PyTorch training loop?

    python benchmarks/gpu.py [--steps 30] [--warmup 10] [--batch 32] [--context 1024] [--no-compile]
    python benchmarks/gpu.py --smoke        # a tiny run on the CPU: checks the script, measures nothing

Measured in one run, on one device:
  rate  a bf16 matrix multiply (8192 x 8192, timed with CUDA events): the device's achievable TFLOP/s.
  a     a plain loop: the built-in GPT at GPT-2-small size (12 layers, width 768, 12 heads, context
        1024, GPT-2's vocabulary; its embeddings are not tied, so 163M parameters, 124M without the
        output layer), batch 32, bf16 autocast, fused AdamW, torch.compile.
  b     the same loop as a `diloco.Learner` of a `diloco syncer` process on the same host (CPU, loopback), with
        as many fragments as H so that one fragment is pushed and one merged every step
        (`--shard-in-process` serves the shard from the benchmark's own process instead: its merges then
        hold the same interpreter as the loop, which no deployment does).
Step time is the mean over the timed steps (CUDA events around them, one synchronisation at the end);
MFU = 6 · parameters · tokens per step / step time / the matmul rate (attention's own FLOPs left out,
as in the usual approximation). Targets: (b)/(a) step time ≤ 1.03; MFU of (a) ≥ 50% of the rate.
Prints a table and writes benchmarks/results/gpu.json. A few minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from diloco.config import load_config  # noqa: E402
from diloco.models.gpt import GPT, GPTConfig  # noqa: E402
from diloco.client.learner_client import Learner  # noqa: E402
from diloco.shard.server import ShardPlan, SyncerShard, serve  # noqa: E402
from diloco.training import make_optimizer  # noqa: E402
from syncer_process import syncer_process  # noqa: E402 - benchmarks/syncer_process.py

GPT2_VOCAB = 50257


def matmul_tflops(device: torch.device, size: int, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    elapsed = timed(device, lambda: a @ b, repeats)
    return 2 * size**3 / elapsed / 1e12


def timed(device: torch.device, step, repeats: int) -> float:
    """Mean seconds per call: CUDA events on a GPU, one synchronisation at the end."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - began) / repeats


def build(args, device: torch.device):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, context=args.context, layers=args.layers, width=args.width,
                          heads=args.heads, dropout=0.0)).to(device)
    config = load_config(None, ["train.lr=3e-4", f"train.batch_size={args.batch}", f"train.seq_len={args.context}",
                                "train.weight_decay=0.1"])
    optimizer = make_optimizer(model, config.train)
    trained = torch.compile(model) if args.compile else model
    inputs = torch.randint(0, args.vocab, (args.batch, args.context), device=device)
    targets = torch.randint(0, args.vocab, (args.batch, args.context), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = trained(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def measure(args, device: torch.device, sync: bool) -> dict:
    model, step = build(args, device)
    shard = server = learner = None
    if sync:
        fragments = args.fragments
        sync_settings = ["learners.count=1", f"outer.fragments={fragments}", f"outer.H={fragments}",
                         "outer.tau=1", f"train.batch_size={args.batch}", f"train.seq_len={args.context}",
                         f"train.tokens={args.batch * args.context * 10**6}", *args.set]
        config = load_config(None, sync_settings)
        if args.shard_in_process:
            shard = SyncerShard(config, ShardPlan(0, 1, ("",)))
            server, port = serve(shard, "127.0.0.1:0")
            shard.plan = ShardPlan(0, 1, (f"127.0.0.1:{port}",))
        else:
            server = syncer_process(sync_settings)
            port = server.__enter__()
        learner = Learner(model, syncer=f"127.0.0.1:{port}", learner=0)
        tokens = args.batch * args.context

        def synced() -> None:
            step()
            learner.step(tokens)
        run = synced
    else:
        run = step
    for _ in range(args.warmup):
        run()
    seconds = timed(device, run, args.steps)
    result = {"step_time_s": seconds, "parameters": sum(p.numel() for p in model.parameters())}
    if sync:
        report = learner.close()
        result.update(merges=report["merges"], pushes=report["pushes"], bytes_up=report["bytes_up"],
                      waiting_s=report["waiting_s"], busy_s=report["busy_s"])
        if shard is not None:
            shard.stop()
            server.stop(0)
        else:
            server.__exit__(None, None, None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--fragments", type=int, default=12, help="fragments = H: one pushed per step")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--shard-in-process", action="store_true",
                        help="serve the syncer shard from this process (its merges then contend with the loop)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the syncing run (e.g. outer.tau=11, codec.up=int4)")
    parser.add_argument("--smoke", action="store_true", help="a tiny run on whatever device there is")
    parser.add_argument("--out", default="benchmarks/results/gpu.json")
    args = parser.parse_args()
    args.layers, args.width, args.heads, args.vocab = 12, 768, 12, GPT2_VOCAB
    matmul_size, matmul_repeats = 8192, 50
    if args.smoke:
        args.layers, args.width, args.heads, args.vocab, args.context, args.batch = 2, 64, 2, 256, 32, 4
        args.steps, args.warmup, args.fragments, args.compile = 4, 2, 2, False
        matmul_size, matmul_repeats = 256, 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("benchmarks/gpu.py needs a CUDA device (or --smoke for a tiny check on the CPU)")
    console = Console()
    rate = matmul_tflops(device, matmul_size, matmul_repeats)
    plain = measure(args, device, sync=False)
    synced = measure(args, device, sync=True)
    tokens = args.batch * args.context
    for result in (plain, synced):
        result["tokens_per_s"] = tokens / result["step_time_s"]
        result["tflops"] = 6 * result["parameters"] * tokens / result["step_time_s"] / 1e12
        result["mfu_of_matmul_rate"] = result["tflops"] / rate
    ratio = synced["step_time_s"] / plain["step_time_s"]
    table = Table(title=f"GPT {args.layers}x{args.width}, batch {args.batch} x {args.context} on "
                        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    for column in ("", "step time", "tokens/s", "TFLOP/s", "of matmul rate", "target"):
        table.add_column(column, justify="right")
    table.add_row("bf16 matmul rate", "", "", f"{rate:.1f}", "", "")
    table.add_row("(a) plain loop", f"{plain['step_time_s'] * 1e3:.1f} ms", f"{plain['tokens_per_s']:,.0f}",
                  f"{plain['tflops']:.1f}", f"{plain['mfu_of_matmul_rate']:.1%}", "≥ 50%")
    table.add_row("(b) diloco learner", f"{synced['step_time_s'] * 1e3:.1f} ms", f"{synced['tokens_per_s']:,.0f}",
                  f"{synced['tflops']:.1f}", f"{synced['mfu_of_matmul_rate']:.1%}", "")
    table.add_row("(b) / (a) step time", f"{ratio:.3f}", "", "", "", "≤ 1.03")
    table.add_row("(b) waiting at τ", f"{synced['waiting_s']:.2f} s", f"of {synced['busy_s']:.2f} s busy", "", "", "")
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": str(device), "smoke": args.smoke, "matmul_tflops": rate, "plain": plain,
                               "synced": synced, "step_time_ratio": ratio, "args": vars(args)}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
