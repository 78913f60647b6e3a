"""A sharded learner's checkpoint (FSDP2, HSDP): `torch.distributed.checkpoint` writes each rank's rows of
the inner optimizer and its own unpushed progress (`sharded_progress.py`; for a learner that does not sync,
of the model instead) into one folder, and
each rank seals a sidecar (`checkpoints.py`'s file, digest and key) with its step count, data position,
the world it was written by, the progress counters, and the digest of every file it wrote. Nothing is
read back before it is checked: the sidecar's seal, its steps and data position, each DCP file's digest,
then the loaded optimizer state with `checkpoints.py`'s checks on each rank's rows; a refusal on any rank
is every rank's, in one line.

Written off the training step (`ShardedWriter`): DCP's `async_save` copies the state on the training
thread and writes it on a background thread over a process group of its own (its collectives never
interleave with the training thread's). Checkpoints alternate between two slots (`a/`, `b/`) and a sealed
`latest` file, replaced atomically once every rank's files and sidecar are on disk, names the complete
one: a kill mid-write leaves the one before it whole.

Another world size: DCP stores global shapes and offsets, so the model, optimizer and unpushed progress
reshard to the ranks that load them; a data position belongs to the rank of the world that wrote it, so
each rank then starts its data shard afresh (as a DDP learner with several ranks does today).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.client.collective_bound import BOUND, floor_s
from diloco.client.checkpoint_staging import KeptStaging
from diloco.client.checkpoints import ADVICE, CheckpointPacer, check_checkpoint, write_checkpoint
from diloco.client.sharded_progress import joined_progress, progress_target, split_progress
from diloco.digests import NEWEST, Digest, digest_of_file
from diloco.errors import DilocoError
from diloco.state_files import load_checked

log = logging.getLogger("diloco.learner")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)  # a slot, reused

try:
    from torch.distributed.checkpoint.state_dict import _init_optim_state
except ImportError:  # pragma: no cover - older torch
    _init_optim_state = None

LATEST, SLOTS = "latest", ("a", "b")


def sidecar(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.state"


def save_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                 data: dict[str, Any], key: bytes | None = None, progress: dict[str, Any] | None = None) -> None:
    """Every rank at once (a collective), waiting for the write: its rows of the model, optimizer and
    `progress` (`export_progress` of its core), then its sealed sidecar."""
    _start(folder, _next_slot(folder, key), model, optimizer, steps, data, key, progress, None)()
    dist.barrier()  # no rank reads `latest` before it names this checkpoint


def _start(folder: Path, slot: str, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
           data: dict[str, Any], key: bytes | None, progress: dict[str, Any] | None,
           group: dist.ProcessGroup | None, stager: KeptStaging | None = None) -> Callable[[], None]:
    """Start writing a checkpoint into `slot` (on `group` in the background, copied by `stager`, else by DCP's
    own; None: here, now); returns what completes it: the sidecar, then, once every rank's is written,
    `latest`."""
    rank, place = dist.get_rank(), folder / slot
    place.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"optimizer": optimizer.state_dict()}
    counters = None
    if progress is not None:  # a syncing learner's rows of Θ are not kept: a restart takes Θ (`_learner_state`)
        state["progress"], counters = split_progress(progress, dict(model.named_parameters()))
    else:
        state["model"] = model.state_dict()
    writer = dcp.FileSystemWriter(place, overwrite=True)  # a slot is rewritten every other checkpoint
    if group is None:
        dcp.save(state, storage_writer=writer)
        written = None
    else:
        written = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)

    def finish() -> None:
        if written is not None:
            written.result()
        files = {f.name: _digest(f) for f in _own_files(place, rank)}
        write_checkpoint({"steps": steps, "data": data, "world": dist.get_world_size(), "files": files,
                          "progress": counters}, sidecar(place, rank), key)
        dist.barrier(group=group)  # every rank's files and sidecar are on disk
        if rank == 0:
            write_checkpoint({"slot": slot, "steps": steps}, folder / LATEST, key)
    return finish


def exists(folder: Path) -> bool:
    return (folder / LATEST).is_file() or (sidecar(folder, 0).is_file() and (folder / ".metadata").is_file())


def _current(folder: Path, key: bytes | None) -> Path:
    """The slot `latest` names (a folder of the layout before slots: itself)."""
    if not (folder / LATEST).is_file():
        return folder
    slot = load_checked(folder / LATEST, "learner checkpoint", ADVICE, key).get("slot")
    if slot not in SLOTS:
        raise DilocoError(f"learner checkpoint {folder} names no slot it has ({slot!r}): {ADVICE}")
    return folder / slot


def _next_slot(folder: Path, key: bytes | None) -> str:
    """The slot the next checkpoint goes to: not the one `latest` names."""
    try:
        return SLOTS[1] if _current(folder, key).name == SLOTS[0] else SLOTS[0]
    except DilocoError:
        return SLOTS[0]


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, max_steps: int,
                 key: bytes | None = None, restore_model: bool = True, restore_optimizer: bool = True
                 ) -> dict[str, Any]:
    """Every rank at once: the checked checkpoint in `folder` loaded into `model` and `optimizer`; returns
    this rank's sidecar (steps, data position: None when another world wrote it)."""
    side, target = _checked_load(folder, optimizer, max_steps, key, model=model)
    with torch.no_grad():
        if restore_model:
            model.load_state_dict(target["model"])
        if restore_optimizer:
            optimizer.load_state_dict(target["optimizer"])
    same_world = side.get("world") == dist.get_world_size()
    return {"steps": side["steps"], "data": side["data"] if same_world else None, "world": side.get("world")}


def read_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, max_steps: int,
                 key: bytes | None = None, own_params: bool = False) -> dict[str, Any]:
    """Every rank at once, for a restart: this rank's part of the checked checkpoint, as `read_checkpoint`
    gives a whole one (steps, data position, optimizer state, and `sync`: its rows of the unpushed
    progress; `model`: its rows of the parameters, with `own_params`, for a learner that does not sync),
    nothing applied yet; `rank_data`: the data position is this rank's (the same world)."""
    side, target = _checked_load(folder, optimizer, max_steps, key, progress_of=model,
                                 model=model if own_params else None)
    world = dist.get_world_size()
    if side.get("world") != world and dist.get_rank() == 0:
        log.warning("checkpoint %s was written by %s ranks, this learner has %d: its optimizer and own progress "
                    "are resharded and its step count kept; each rank starts its new slice of the learner's data "
                    "shard afresh", folder, side.get("world"), world)
    progress = joined_progress(side.get("progress"), target.get("progress", {}))
    return {"steps": side["steps"], "data": side["data"], "rank_data": side.get("world") == world,
            "optimizer": target["optimizer"], **({"sync": progress} if progress is not None else {}),
            **({"model": target["model"]} if "model" in target else {})}


def _checked_load(folder: Path, optimizer: torch.optim.Optimizer, max_steps: int, key: bytes | None,
                  model: nn.Module | None = None, progress_of: nn.Module | None = None
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's sidecar and what DCP loaded (the optimizer's rows; the model's, with `model`; the
    progress rows laid out like `progress_of`'s parameters), every check passed on every rank."""
    rank = dist.get_rank()
    problem, side, place = None, {}, folder
    try:
        place = _current(folder, key)
        side = load_checked(sidecar(place, rank if sidecar(place, rank).is_file() else 0), "learner checkpoint",
                            ADVICE, key)
        for name, digest in dict(side.get("files", {})).items():
            if not (place / name).is_file() or _digest(place / name, str(digest)) != digest:
                raise DilocoError(f"learner checkpoint {folder} has a damaged or missing {name}: {ADVICE}")
    except DilocoError as exc:
        problem = str(exc)
    _agree(problem)
    if _init_optim_state is not None:
        _init_optim_state(optimizer)  # the state DCP loads into exists before the first step
    target: dict[str, Any] = {"optimizer": _cloned(optimizer.state_dict())}
    if model is not None and side.get("progress") is None:  # a syncing learner's checkpoint holds no rows of Θ
        target["model"] = _cloned(model.state_dict())
    if progress_of is not None and side.get("progress") is not None:
        target["progress"] = progress_target(side["progress"], dict(progress_of.named_parameters()))
    dcp.load(target, checkpoint_id=str(place))
    problem = None
    try:
        state = {"steps": side.get("steps"), "data": side.get("data"), "optimizer": _local(target["optimizer"])}
        check_checkpoint(state, folder, max_steps, _LocalGroups(optimizer))
    except DilocoError as exc:
        problem = str(exc)
    _agree(problem)
    return side, target


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


DIGEST: Digest = NEWEST
"""How a sidecar's digests of its DCP files are taken (`digests.py`): every byte of every checkpoint goes
through it, on cores the training shares. A digest is tagged with its kind ("blake3:…"); one tagged
"sha256:" or untagged (BLAKE2b) is one a checkpoint written before holds, and checks as it was taken."""
_TAGGED: dict[str, Digest] = {"blake3": "blake3", "sha256": "sha256"}


def _digest(path: Path, like: str = DIGEST + ":") -> str:
    """`path`'s digest, taken as `like` (a digest read from a sidecar) was."""
    kind = _TAGGED.get(like.partition(":")[0], "blake2b")
    with path.open("rb") as f:
        hexdigest = digest_of_file(f, kind=kind, chunk_bytes=1 << 20).hex()
    return hexdigest if kind == "blake2b" else f"{kind}:{hexdigest}"


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
    """The built-in learner's checkpoints when its model is sharded: every rank writes its rows (`every_rank`),
    at the same steps as the others, off the training step. As `checkpoints.CheckpointWriter`: at most one
    write at a time (a due checkpoint is skipped while one is on its way), the period the fewest steps
    that keep a checkpoint's measured cost within `COST_SHARE` (pushes never make one due:
    `core/own_progress.py`). Every rank decides alike: from the step and the figures the ranks agree on
    (by maximum) whenever one may be due."""

    every_rank = True

    def __init__(self, folder: Path, key: bytes | None = None, learner: Any = None, most_every: int = 25) -> None:
        """`learner`: the `Learner` whose own progress each checkpoint keeps (None: none)."""
        self.folder, self.key, self.learner = folder, key, learner
        self.pacer = CheckpointPacer(most_every)
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=floor_s()))
        self.stager = KeptStaging()
        box = [_next_slot(folder, key)]
        dist.broadcast_object_list(box, 0)  # every rank writes the same slot
        self.slot = box[0]
        self._thread: threading.Thread | None = None
        self.copy_s = self.copy_total_s = self.write_s = 0.0
        self.written = self.skipped = 0

    def maybe_save(self, model: nn.Module, replica: Any, step_s: float) -> bool:
        """At the end of a step that took `step_s` (every rank): save if one is due and every rank's last
        write is done."""
        self.pacer.step(step_s, self._writing())
        if not self.pacer.may_be_due(replica.steps):
            return False
        shared = torch.tensor([float(self._writing()), *self.pacer.figures()], dtype=torch.float64)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        if shared[0]:
            self.skipped += 1
            return False
        if not self.pacer.due(replica.steps, float(shared[1]), float(shared[2])):
            return False
        self.save(model, replica)
        self.pacer.saved(replica.steps, self.copy_s)
        return True

    def save(self, model: nn.Module, replica: Any, wait: bool = False) -> None:
        self.wait()
        began = clock.monotonic()
        progress = self.learner.own_progress_state() if self.learner is not None else None
        with BOUND.relaxed():
            finish = _start(self.folder, self.slot, model, replica.optimizer, replica.steps,
                            replica.sampler.state_dict(), self.key, progress, self.group, self.stager)
        self.copy_s = clock.monotonic() - began
        self.copy_total_s += self.copy_s
        self.slot = SLOTS[1] if self.slot == SLOTS[0] else SLOTS[0]
        self._thread = threading.Thread(target=self._finish, args=(finish,), name="learner-checkpoint", daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    def _finish(self, finish: Callable[[], None]) -> None:
        began = clock.monotonic()
        try:
            finish()
        except Exception as exc:  # a full disk, a rank gone: training goes on, the last checkpoint stands
            log.warning("checkpoint %s was not written: %s", self.folder, str(exc).splitlines()[0] if str(exc) else exc)
            return
        self.write_s = clock.monotonic() - began
        self.written += 1

    def _writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


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
