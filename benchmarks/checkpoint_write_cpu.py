"""CPU that one learner checkpoint of the default model costs: the copy on the training thread and the write on
the writing thread (thread CPU time, fair on a busy host), taking turns in one process, for the states a
syncing learner saved (unpushed progress with a push in flight, inner optimizer): in one file with its
parameters (s45), in one file without them (s46: Θ and the progress make them again), and now as a
progress file each checkpoint and an optimizer file every `OPTIMIZER_EVERY`; the write as in s46 (torch.save's
CRC-32 of each record, then the file read back for its SHA-256 digest), as in s54 (no CRC-32, SHA-256 taken
as the bytes are written) and now (the same with BLAKE3), taking turns; the progress copied as in s54
(computed into tensors, then packed) and now (computed straight into the packed buffer); and the digest
of the written bytes with BLAKE2b, SHA-256 and BLAKE3.

    python benchmarks/checkpoint_write_cpu.py [--repeats 20] [--json benchmarks/results/checkpoint_write_cpu.json]

Prints a table and writes JSON: file_bytes, copy_cpu_ms and write_cpu_ms per file (medians), copy_s54_cpu_ms,
write_s54_cpu_ms and write_s46_cpu_ms (the same files the earlier ways), per_checkpoint_cpu_ms per way of
saving (what the checkpoint period is derived from), per_checkpoint_s54_cpu_ms and
per_checkpoint_s46_write_cpu_ms (today's files saved the earlier ways), digest_cpu_ms.
"""

from __future__ import annotations

import argparse
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
from diloco.digests import Digest, digest_of_file, new_digest
from diloco.state_files import TRAILER, _HashingWriter, _without_crc32, sync_folder
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
    back for its SHA-256 digest; the same bytes otherwise (a reference for the row "written the s46 way")."""
    with replacing(path, binary=True, durable=True) as file:
        torch.save(state, file)
        file.flush()
        length = file.tell()
        digest = digest_of_file(file, length, "sha256", key)
        file.seek(length)
        file.write(TRAILER.pack(b"DLCMAC02", length, digest))
    sync_folder(path.parent)


def write_as_in_s54(state: dict[str, Any], path: Path, key: bytes) -> None:
    """A state file written as in s47–s54: without CRC-32, digested as written, with SHA-256 (HMAC)."""
    written_with(state, path, key, "sha256", b"DLCMAC02")


def written_with(state: dict[str, Any], path: Path, key: bytes, kind: Digest, mark: bytes) -> None:
    with replacing(path, binary=True, durable=True) as file:
        hashing = _HashingWriter(file, new_digest(kind, key))
        with _without_crc32():
            torch.save(state, hashing)
        file.write(TRAILER.pack(mark, hashing.length, hashing.digest.digest()))
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

    def state(parameters: bool, progress: bool, moments: bool, deferred: bool = True) -> dict[str, Any]:
        return {**({"model": model.state_dict()} if parameters else {}),
                **({"sync": export_progress(core, deferred)} if progress else {}),
                **({"optimizer": optimizer.state_dict()} if moments else {}),
                "steps": core.step, "data": {"learner": 0, "epoch": 0, "index": 0}}

    folder = Path(tempfile.mkdtemp(prefix="checkpoint-cpu-"))
    states = {"syncing, one file with its parameters (s45)": (True, True, True),
              "syncing, one file without them (s46)": (False, True, True),
              "syncing, progress file": (False, True, False), "syncing, optimizer file": (False, False, True)}
    ways = ("copy", "copy_s54", "write", "write_s54", "write_s46")
    times: dict[str, dict[str, list[float]]] = {k: {w: [] for w in states} for k in ways}
    sizes: dict[str, int] = {}
    key, path = b"k" * 32, folder / "learner.pt"
    for _ in range(args.repeats):
        for way, kept in states.items():
            ms, copied = cpu_ms(lambda: packed_copy(state(*kept)))
            times["copy"][way].append(ms)
            times["copy_s54"][way].append(cpu_ms(lambda: packed_copy(state(*kept, deferred=False)))[0])
            times["write"][way].append(cpu_ms(lambda: write_checkpoint(copied, path, key))[0])
            times["write_s54"][way].append(cpu_ms(lambda: write_as_in_s54(copied, path, key))[0])
            times["write_s46"][way].append(cpu_ms(lambda: write_as_in_s46(copied, path, key))[0])
            sizes[way] = path.stat().st_size
    body = path.read_bytes()
    digests = {name: statistics.median(cpu_ms(lambda: new_digest(name).update(body))[0] for _ in range(args.repeats))
               for name in ("blake2b", "sha256", "blake3")}
    result: dict[str, Any] = {"parameters": sum(t.numel() for t in model.parameters()), "file_bytes": sizes,
                              "repeats": args.repeats}
    for k in ways:
        result[f"{k}_cpu_ms"] = {w: statistics.median(v) for w, v in times[k].items()}
    result["digest_cpu_ms"] = digests

    def per_checkpoint(copy: str, write: str) -> float:
        """A progress file each checkpoint, the optimizer's every OPTIMIZER_EVERY (what the period is
        derived from)."""
        both = {w: result[f"{copy}_cpu_ms"][w] + result[f"{write}_cpu_ms"][w] for w in states}
        return both["syncing, progress file"] + both["syncing, optimizer file"] / OPTIMIZER_EVERY

    both = {w: result["copy_cpu_ms"][w] + result["write_cpu_ms"][w] for w in states}
    result["per_checkpoint_cpu_ms"] = {
        "syncing, one file with its parameters (s45)": both["syncing, one file with its parameters (s45)"],
        "syncing, one file without them (s46)": both["syncing, one file without them (s46)"],
        f"syncing, optimizer every {OPTIMIZER_EVERY} (now)": per_checkpoint("copy", "write")}
    result["per_checkpoint_s54_cpu_ms"] = per_checkpoint("copy_s54", "write_s54")
    result["per_checkpoint_s46_write_cpu_ms"] = per_checkpoint("copy_s54", "write_s46")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title="one checkpoint of the default model, CPU ms, medians")
    for column in ("state", "MB", "copy", "copy, s54 way", "write", "write, s54 way", "write, s46 way"):
        table.add_column(column)
    for way in states:
        table.add_row(way, f"{sizes[way] / 1e6:.2f}", *(f"{result[f'{k}_cpu_ms'][way]:.2f}" for k in ways))
    for way, ms in result["per_checkpoint_cpu_ms"].items():
        table.add_row(f"per checkpoint, copy and write: {way}", "", f"{ms:.2f}")
    table.add_row("per checkpoint: the same, copied and written the s54 way", "", f"{result['per_checkpoint_s54_cpu_ms']:.2f}")
    table.add_row("per checkpoint: copied the s54 way, written the s46 way", "",
                  f"{result['per_checkpoint_s46_write_cpu_ms']:.2f}")
    for name, ms in digests.items():
        table.add_row(f"the digest alone, {name} ({len(body) / 1e6:.2f} MB)", "", "", "", f"{ms:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
