"""A sharded learner's checkpoint (FSDP2, HSDP): `torch.distributed.checkpoint` writes each rank's rows of
the model and inner optimizer into one folder, and each rank seals a sidecar (`checkpoints.py`'s file,
digest and key) with its step count, data position, the world it was written by, and the digest of
every file it wrote. Nothing is read back before it is checked: the sidecar's seal, its steps and
data position, each DCP file's digest, then the loaded optimizer state with `checkpoints.py`'s checks
on each rank's rows; a refusal on any rank is every rank's, in one line.

Another world size: DCP stores global shapes and offsets, so the model and optimizer reshard to the
ranks that load them; a data position belongs to the rank of the world that wrote it, so each rank
then starts its data shard afresh (as a DDP learner with several ranks does today).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from diloco.client.collective_bound import BOUND
from diloco.client.checkpoints import ADVICE, check_checkpoint, write_checkpoint
from diloco.errors import DilocoError
from diloco.state_files import load_checked

log = logging.getLogger("diloco.learner")

try:
    from torch.distributed.checkpoint.state_dict import _init_optim_state
except ImportError:  # pragma: no cover - older torch
    _init_optim_state = None


def sidecar(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.state"


def save_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                 data: dict[str, Any], key: bytes | None = None) -> None:
    """Every rank at once (a collective): its rows of the model and optimizer, then its sealed sidecar."""
    rank = dist.get_rank()
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=str(folder))
    files = {f.name: _digest(f) for f in _own_files(folder, rank)}
    write_checkpoint({"steps": steps, "data": data, "world": dist.get_world_size(), "files": files},
                     sidecar(folder, rank), key)
    dist.barrier()  # no rank reads a sidecar before every one is written


def exists(folder: Path) -> bool:
    return sidecar(folder, 0).is_file() and (folder / ".metadata").is_file()


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, max_steps: int,
                 key: bytes | None = None, restore_model: bool = True, restore_optimizer: bool = True
                 ) -> dict[str, Any]:
    """Every rank at once: the checked checkpoint in `folder` loaded into `model` and `optimizer`; returns
    this rank's sidecar (steps, data position: None when another world wrote it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = sidecar(folder, rank if sidecar(folder, rank).is_file() else 0)
    problem, side = None, {}
    try:
        side = load_checked(path, "learner checkpoint", ADVICE, key)
        for name, digest in dict(side.get("files", {})).items():
            if not (folder / name).is_file() or _digest(folder / name) != digest:
                raise DilocoError(f"learner checkpoint {folder} has a damaged or missing {name}: {ADVICE}")
    except DilocoError as exc:
        problem = str(exc)
    _agree(problem)
    if _init_optim_state is not None:
        _init_optim_state(optimizer)  # the state DCP loads into exists before the first step
    target = _cloned({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    dcp.load(target, checkpoint_id=str(folder))
    problem = None
    try:
        state = {"steps": side.get("steps"), "data": side.get("data"), "optimizer": _local(target["optimizer"])}
        check_checkpoint(state, folder, max_steps, _LocalGroups(optimizer))
    except DilocoError as exc:
        problem = str(exc)
    _agree(problem)
    with torch.no_grad():
        if restore_model:
            model.load_state_dict(target["model"])
        if restore_optimizer:
            optimizer.load_state_dict(target["optimizer"])
    same_world = side.get("world") == world
    return {"steps": side["steps"], "data": side["data"] if same_world else None, "world": side.get("world")}


def _agree(problem: str | None) -> None:
    """Every rank raises the first rank's refusal, or none does."""
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise DilocoError(first)


def _own_files(folder: Path, rank: int) -> list[Path]:
    """The DCP files this rank wrote: its data file(s), and the metadata for rank 0."""
    return sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / ".metadata"] if rank == 0 else [])


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cloned(value: Any) -> Any:
    """A state dict whose tensors DCP can load into without touching the live ones."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value


def _local(value: Any) -> Any:
    """This rank's rows of every tensor (checked without collectives)."""
    if hasattr(value, "to_local"):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


class _LocalGroups:
    """The optimizer's parameter groups as this rank holds them: the shapes its rows of state must have."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = [{**g, "params": [_local(p) for p in g["params"]]} for g in optimizer.param_groups]


class ShardedWriter:
    """The built-in learner's checkpoints when its model is sharded: every rank writes (`every_rank`), in
    step with the others, on the training thread (DCP's writes are collectives)."""

    every_rank = True

    def __init__(self, folder: Path, key: bytes | None = None) -> None:
        self.folder, self.key = folder, key

    def save(self, model: nn.Module, replica: Any, wait: bool = False) -> None:
        with BOUND.relaxed():  # a write may take longer than a step: the ranks wait at the floor
            save_sharded(self.folder, model, replica.optimizer, replica.steps, replica.sampler.state_dict(), self.key)

    def wait(self) -> None:
        pass


def restore_sharded(folder: Path, replica: Any, max_steps: int, plan: Any, key: bytes | None = None) -> None:
    """A restarted sharded learner's own state, as `core/recovery.py`'s `plan` says (its parameters come
    from the syncer's current Θ, which is newer); its data position only when the world is the same."""
    side = load_sharded(folder, replica.model, replica.optimizer, max_steps, key, restore_model=False,
                        restore_optimizer=plan.optimizer)
    if side["data"] is None and dist.get_rank() == 0:
        log.warning("checkpoint %s was written by %s ranks, this learner has %d: its optimizer is resharded and "
                    "its step count kept; each rank starts its new slice of the learner's data shard afresh",
                    folder, side["world"], dist.get_world_size())
    if plan.data and side["data"] is not None:
        replica.sampler.load_state_dict(side["data"])
    if plan.steps:
        replica.steps = int(side["steps"])


def refuse_other_kind(folder: Path | None, file: Path | None, sharded: bool) -> None:
    """A learner whose own checkpoint is of the other kind (a DCP folder for a one-process or DDP learner,
    a file for a sharded one) is refused in one line before it joins: that state cannot be honoured."""
    if folder is None or file is None or (exists(folder) if sharded else file.is_file()):
        return
    if not sharded and exists(folder):
        raise DilocoError(f"checkpoint {folder} was written by a sharded learner (DCP), and this learner is not "
                          f"sharded (one process, or train.sharding = ddp): start it with its sharding and at least "
                          f"2 ranks, or remove the folder to start from Θ")
    if sharded and file.is_file():
        raise DilocoError(f"checkpoint {file} was written by an unsharded learner, and this learner is sharded: "
                          f"start it as it was (one process, or ddp), or remove the file to start from Θ")
