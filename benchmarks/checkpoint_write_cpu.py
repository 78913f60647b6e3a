"""CPU that one learner checkpoint of the default model costs: the copy on the training thread and the write on
the writing thread (thread CPU time, fair on a busy host), taking turns in one process, for the states a
syncing learner saved (unpushed progress with a push in flight, inner optimizer): in one file with its
parameters (s45), in one file without them (s46: Θ and the progress make them again), and now as a
progress file each checkpoint and an optimizer file every `OPTIMIZER_EVERY`; the write as in s46 (torch.save's
CRC-32 of each record, then the file read back for its digest) against now (no CRC-32, the digest taken as
the bytes are written), taking turns; and the digest of the written bytes with BLAKE2b (the state files'
digest before) and SHA-256 (now).

    python benchmarks/checkpoint_write_cpu.py [--repeats 20] [--json benchmarks/results/checkpoint_write_cpu.json]

Prints a table and writes JSON: file_bytes, copy_cpu_ms and write_cpu_ms per file (medians),
per_checkpoint_cpu_ms per way of saving (what the checkpoint period is derived from), write_s46_cpu_ms
and per_checkpoint_s46_write_cpu_ms (the same files written the s46 way), digest_cpu_ms.
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

from diloco.client.checkpoints import OPTIMIZER_EVERY, write_checkpoint
from diloco.state_files import SEALED_MARK, TRAILER, _digest_of, sync_folder
from diloco.outputs import replacing
from diloco.client.packed_state import packed_copy
from diloco.config import Config
from diloco.core.own_progress import export_progress
from diloco.fragments import embedding_names, partition
from diloco.models import build_model
from diloco.strategies import build_strategy
from diloco.training import make_optimizer


def cpu_ms(work: Callable[[], Any]) -> tuple[float, Any]:
    began = time.thread_time()
    result = work()
    return 1e3 * (time.thread_time() - began), result


def write_as_in_s46(state: dict[str, Any], path: Path, key: bytes) -> None:
    """A state file written as before s47: torch.save with its CRC-32 of each record, then the file read
    back for its digest; the same bytes otherwise (a reference for the row "written the s46 way")."""
    with replacing(path, binary=True, durable=True) as file:
        torch.save(state, file)
        file.flush()
        length = file.tell()
        digest = _digest_of(file, length, key)
        file.seek(length)
        file.write(TRAILER.pack(SEALED_MARK, length, digest))
    sync_folder(path.parent)


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

    core = build_strategy(config).learner_core(0, dict(model.named_parameters()),
                                                partition(model, config.outer.fragments, embedding_names(model)))
    while not core.in_flight:  # a push on its way, as most of a learner's checkpoints find one
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param), alpha=1e-3)
        core.on_step(config.train.batch_size * config.train.seq_len)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=1e-3)  # trained since that push: unpushed progress

    def state(parameters: bool, progress: bool, moments: bool) -> dict[str, Any]:
        return {**({"model": model.state_dict()} if parameters else {}),
                **({"sync": export_progress(core)} if progress else {}),
                **({"optimizer": optimizer.state_dict()} if moments else {}),
                "steps": core.step, "data": {"learner": 0, "epoch": 0, "index": 0}}

    folder = Path(tempfile.mkdtemp(prefix="checkpoint-cpu-"))
    states = {"syncing, one file with its parameters (s45)": (True, True, True),
              "syncing, one file without them (s46)": (False, True, True),
              "syncing, progress file": (False, True, False), "syncing, optimizer file": (False, False, True)}
    copy: dict[str, list[float]] = {w: [] for w in states}
    write: dict[str, list[float]] = {w: [] for w in states}
    write_s46: dict[str, list[float]] = {w: [] for w in states}
    sizes: dict[str, int] = {}
    for _ in range(args.repeats):
        for way, kept in states.items():
            ms, copied = cpu_ms(lambda: packed_copy(state(*kept)))
            copy[way].append(ms)
            write[way].append(cpu_ms(lambda: write_checkpoint(copied, folder / "learner.pt", b"k" * 32))[0])
            write_s46[way].append(cpu_ms(lambda: write_as_in_s46(copied, folder / "learner.pt", b"k" * 32))[0])
            sizes[way] = (folder / "learner.pt").stat().st_size
    body = (folder / "learner.pt").read_bytes()
    digests = {name: statistics.median(cpu_ms(lambda: make(body).digest())[0] for _ in range(args.repeats))
               for name, make in (("blake2b", lambda b: hashlib.blake2b(b, digest_size=32)),
                                  ("sha256", hashlib.sha256))}
    result = {"parameters": sum(t.numel() for t in model.parameters()), "file_bytes": sizes,
              "repeats": args.repeats,
              "copy_cpu_ms": {w: statistics.median(v) for w, v in copy.items()},
              "write_cpu_ms": {w: statistics.median(v) for w, v in write.items()},
              "write_s46_cpu_ms": {w: statistics.median(v) for w, v in write_s46.items()},
              "digest_cpu_ms": digests}
    both = {w: result["copy_cpu_ms"][w] + result["write_cpu_ms"][w] for w in states}
    result["per_checkpoint_cpu_ms"] = {  # what the period is derived from: the optimizer's file spread out
        "syncing, one file with its parameters (s45)": both["syncing, one file with its parameters (s45)"],
        "syncing, one file without them (s46)": both["syncing, one file without them (s46)"],
        f"syncing, optimizer every {OPTIMIZER_EVERY} (now)": both["syncing, progress file"]
        + both["syncing, optimizer file"] / OPTIMIZER_EVERY}
    both_s46 = {w: result["copy_cpu_ms"][w] + result["write_s46_cpu_ms"][w] for w in states}
    result["per_checkpoint_s46_write_cpu_ms"] = both_s46["syncing, progress file"] \
        + both_s46["syncing, optimizer file"] / OPTIMIZER_EVERY
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title="one checkpoint of the default model, CPU ms, medians")
    for column in ("state", "MB", "copy: training thread", "write: writing thread", "write, s46 way", "both"):
        table.add_column(column)
    for way in states:
        copy_ms, write_ms = result["copy_cpu_ms"][way], result["write_cpu_ms"][way]
        table.add_row(way, f"{sizes[way] / 1e6:.2f}", f"{copy_ms:.2f}", f"{write_ms:.2f}",
                      f"{result['write_s46_cpu_ms'][way]:.2f}", f"{copy_ms + write_ms:.2f}")
    for way, ms in result["per_checkpoint_cpu_ms"].items():
        table.add_row(f"per checkpoint: {way}", "", "", "", "", f"{ms:.2f}")
    table.add_row("per checkpoint: the same, written the s46 way", "", "", "", "",
                  f"{result['per_checkpoint_s46_write_cpu_ms']:.2f}")
    for name, ms in digests.items():
        table.add_row(f"the digest alone, {name} ({len(body) / 1e6:.2f} MB)", "", "", f"{ms:.2f}", "", "")
    Console().print(table)


if __name__ == "__main__":
    main()
