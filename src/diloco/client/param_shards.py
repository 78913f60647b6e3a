"""Where a sharded learner's parameters live: FSDP2's rows (Shard(0)) on a 1-D mesh, or HSDP's replicate ×
shard mesh; the one layout a learner syncs, checked once; each rank's rows of a tensor; and how the
built-in learner shards a model (`shard_model`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.errors import DilocoError

try:  # DTensor and fully_shard are public from torch 2.5 on
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
except ImportError:  # pragma: no cover - an older torch has no sharded learners
    DTensor = Replicate = Shard = fully_shard = init_device_mesh = None  # type: ignore[assignment,misc]

SHARDINGS = ("ddp", "fsdp", "hsdp")


def is_sharded(params: Mapping[str, torch.Tensor]) -> bool:
    return DTensor is not None and any(isinstance(p, DTensor) for p in params.values())


@dataclass(frozen=True)
class ShardPlacement:
    """Where one learner's parameters live: a mesh whose last dim shards rows (Shard(0)), and for HSDP a
    first dim that replicates them."""

    mesh: Any
    hsdp: bool

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.mesh.ndim - 1)

    @property
    def shards(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def coordinate(self) -> list[int]:
        return list(self.mesh.get_coordinate())

    @property
    def in_first_replica(self) -> bool:
        """This rank's shard group is the one global rank 0 gathers and scatters over."""
        return not self.hsdp or self.coordinate[0] == 0


def placement_of(params: Mapping[str, torch.Tensor], world: int) -> ShardPlacement:
    """The one layout a sharded learner syncs; any other is refused with one line."""
    plain = [n for n, p in params.items() if not isinstance(p, DTensor)]
    if plain:
        raise DilocoError(f"parameters on mixed meshes: {plain[0]} is a plain tensor while others are DTensors; "
                          f"shard every parameter (fully_shard the root module too)")
    meshes: dict[Any, str] = {}
    for name, p in params.items():
        meshes.setdefault(p.device_mesh, name)
        placements = tuple(p.placements)
        fsdp = p.device_mesh.ndim == 1 and placements == (Shard(0),)
        hsdp = p.device_mesh.ndim == 2 and placements == (Replicate(), Shard(0))
        if not (fsdp or hsdp):
            raise DilocoError(f"parameter {name} is placed {list(placements)} on a {p.device_mesh.ndim}-D mesh; a "
                              f"learner syncs FSDP (Shard(0)) or HSDP (Replicate(), Shard(0)) parameters only")
    if len(meshes) > 1:
        a, b = list(meshes.values())[:2]
        raise DilocoError(f"parameters on mixed meshes: {a} and {b} are on different device meshes; a learner "
                          f"syncs parameters of one mesh")
    mesh = next(iter(meshes))
    if mesh.size() != world:
        raise DilocoError(f"the parameters' mesh spans {mesh.size()} ranks, the learner's process group {world}; "
                          f"the mesh must span every rank of the learner")
    placement = ShardPlacement(mesh, hsdp=mesh.ndim == 2)
    if dist.get_rank() == 0 and any(placement.coordinate):
        raise DilocoError(f"global rank 0 sits at {placement.coordinate} on the mesh; it must be at its origin")
    return placement


def rows_per_shard(rows: int, shards: int) -> int:
    """torch.chunk's rows per shard, as FSDP2 splits dim 0 (the last shards may hold fewer, or none)."""
    return max(1, math.ceil(rows / shards))


def layout_fingerprint(params: Mapping[str, torch.Tensor], placement: ShardPlacement) -> list[tuple]:
    """What every rank must agree on before syncing: names, global shapes, and its own rows of each."""
    index = placement.coordinate[-1]
    rows = [(n, tuple(p.shape), p.to_local().shape[0] if p.dim() else 0) for n, p in params.items()]
    expected = [(n, shape, max(0, min(rows_per_shard(shape[0], placement.shards),
                                      shape[0] - index * rows_per_shard(shape[0], placement.shards))))
                for n, shape, _ in rows if shape]
    wrong = [(n, got) for (n, _, got), (_, _, want) in zip(rows, expected) if got != want]
    if wrong or len(expected) != len(rows):
        name = wrong[0][0] if wrong else next(n for n, shape, _ in rows if not shape)
        raise DilocoError(f"parameter {name} is not split by rows as FSDP2 splits them (torch.chunk on dim 0)")
    return [(n, shape) for n, shape, _ in rows]


def padded_rows(rows_here: torch.Tensor, rows: int) -> torch.Tensor:
    """This rank's rows, padded to the rows every rank sends (gloo gathers equal sizes)."""
    if rows_here.shape[0] == rows:
        return rows_here.contiguous()
    padded = torch.zeros((rows, *rows_here.shape[1:]), dtype=rows_here.dtype, device=rows_here.device)
    padded[:rows_here.shape[0]] = rows_here
    return padded


def row_pieces(value: torch.Tensor, rows: int, shards: int) -> list[torch.Tensor]:
    """`value` cut into `shards` pieces of `rows` rows (views, but for the short or missing last ones)."""
    pieces = [piece.contiguous() for piece in value.split(rows)]
    return [p if p.shape[0] == rows else padded_rows(p, rows) for p in pieces] + \
        [torch.zeros((rows, *value.shape[1:]), dtype=value.dtype, device=value.device)
         for _ in range(shards - len(pieces))]


def hsdp_shape(world: int) -> tuple[int, int]:
    """HSDP's (replicas, shards per replica): the ranks of one node shard (torchrun's LOCAL_WORLD_SIZE
    when it divides the world), the nodes replicate; on one node, two replicas when the world is even."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    shards = local if 0 < local < world and world % local == 0 else (world // 2 if world % 2 == 0 else world)
    return world // shards, shards


def shard_model(model: nn.Module, sharding: str, world: int, device: str = "cpu") -> nn.Module:
    """The model as `train.sharding` says: each block of every ModuleList, then the root, under
    `fully_shard` on a 1-D mesh (fsdp) or a replicate × shard mesh (hsdp); ddp: DistributedDataParallel."""
    if sharding == "ddp":
        return nn.parallel.DistributedDataParallel(model) if world > 1 else model
    if fully_shard is None:
        raise DilocoError(f"train.sharding = {sharding!r} needs torch.distributed.fsdp.fully_shard (torch >= 2.5)")
    mesh = (init_device_mesh(device, (world,), mesh_dim_names=("shard",)) if sharding == "fsdp" else
            init_device_mesh(device, hsdp_shape(world), mesh_dim_names=("replicate", "shard")))
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
