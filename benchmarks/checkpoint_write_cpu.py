"""CPU that one learner checkpoint of the default model costs: the copy on the training thread and the write on
the writing thread (thread CPU time, fair on a busy host), the state copied a clone per tensor (as before
`client/packed_state.py`) and packed into one buffer per dtype, taking turns in one process; and the
digest of the written bytes with BLAKE2b (the state files' digest before) and SHA-256 (now).

    python benchmarks/checkpoint_write_cpu.py [--repeats 20] [--json benchmarks/results/checkpoint_write_cpu.json]

Prints a table and writes JSON: copy_cpu_ms and write_cpu_ms per way (medians), digest_cpu_ms per digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from diloco.client.checkpoints import write_checkpoint
from diloco.client.packed_state import packed_copy
from diloco.config import Config
from diloco.models import build_model
from diloco.training import make_optimizer


def clone_per_tensor(value: Any) -> Any:
    """The copy as it was made before packing: every tensor cloned on its own."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_per_tensor(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_per_tensor(v) for v in value)
    return value


def cpu_ms(work: Callable[[], Any]) -> tuple[float, Any]:
    began = time.thread_time()
    result = work()
    return 1e3 * (time.thread_time() - began), result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "checkpoint_write_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(1)  # as each learner of `diloco run` trains
    config = Config()
    model = build_model(config, 256)
    optimizer = make_optimizer(model, config.train)
    x = torch.randint(0, 256, (config.train.batch_size, config.train.seq_len))
    model(x, x).backward()
    optimizer.step()  # the optimizer holds its moments, as a learner's does after its first step

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "steps": 1,
                "data": {"learner": 0, "epoch": 0, "index": 0}}

    folder = Path(tempfile.mkdtemp(prefix="checkpoint-cpu-"))
    ways = {"clone per tensor": clone_per_tensor, "packed": packed_copy}
    copy: dict[str, list[float]] = {w: [] for w in ways}
    write: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.repeats):
        for way, copier in ways.items():
            ms, copied = cpu_ms(lambda: copier(state()))
            copy[way].append(ms)
            write[way].append(cpu_ms(lambda: write_checkpoint(copied, folder / "learner.pt", b"k" * 32))[0])
    body = (folder / "learner.pt").read_bytes()
    digests = {name: statistics.median(cpu_ms(lambda: make(body).digest())[0] for _ in range(args.repeats))
               for name, make in (("blake2b", lambda b: hashlib.blake2b(b, digest_size=32)),
                                  ("sha256", hashlib.sha256))}
    result = {"parameters": sum(t.numel() for t in model.parameters()), "file_bytes": len(body),
              "repeats": args.repeats,
              "copy_cpu_ms": {w: statistics.median(v) for w, v in copy.items()},
              "write_cpu_ms": {w: statistics.median(v) for w, v in write.items()},
              "digest_cpu_ms": digests}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"one checkpoint of the default model ({len(body) / 1e6:.1f} MB), CPU ms, medians")
    for column in ("copy", "training thread", "writing thread"):
        table.add_column(column)
    for way in ways:
        table.add_row(way, f"{result['copy_cpu_ms'][way]:.2f}", f"{result['write_cpu_ms'][way]:.2f}")
    for name, ms in digests.items():
        table.add_row(f"of which the digest, {name}", "", f"{ms:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
