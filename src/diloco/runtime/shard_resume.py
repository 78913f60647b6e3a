"""What a saved shard state must be before a shard resumes from it: saved by this shard of this run,
with a Θ that fits the layout and is finite. Each refusal is one line naming the file."""

from __future__ import annotations

import torch

from diloco.errors import DilocoError
from diloco.runtime.shard_plan import ShardPlan
from diloco.v1 import diloco_pb2 as pb


def shard_identity(plan: ShardPlan, owned: list[int], settings: pb.Settings) -> dict:
    """What a saved state must match to be resumed here: this shard, its fragments, the run's settings."""
    encoded = settings.SerializeToString(deterministic=True)
    return {"shard": plan.index, "shards": plan.count, "fragments": list(owned),
            "settings": torch.frombuffer(bytearray(encoded), dtype=torch.uint8) if encoded
            else torch.empty(0, dtype=torch.uint8)}


def check_identity(state: dict, mine: dict, where: str) -> None:
    """Refuse a state saved by another shard, shard count or config."""
    identity = state.get("identity")
    if not isinstance(identity, dict):
        raise DilocoError(f"{where} does not say which shard saved it: it cannot be resumed here")
    for key in ("shard", "shards", "fragments"):
        if identity.get(key) != mine[key]:
            raise DilocoError(f"{where} was saved by a shard with {key} {identity.get(key)!r}, but this one has "
                              f"{mine[key]!r}: resume with the --shard and config of the run that saved it")
    saved, current = pb.Settings(), pb.Settings()
    current.ParseFromString(bytes(mine["settings"].numpy()))
    try:
        saved.ParseFromString(bytes(identity["settings"].numpy()))
    except Exception:  # noqa: BLE001 — anything unparsable is a foreign file
        raise DilocoError(f"{where} holds settings that cannot be read: it cannot be resumed here") from None
    differing = [f.name for f in pb.Settings.DESCRIPTOR.fields if getattr(saved, f.name) != getattr(current, f.name)]
    if differing:
        raise DilocoError(f"{where} was saved by a run with other settings ({', '.join(differing)} differ): "
                          f"resume with the config of the run that saved it")


def check_theta(state: dict, layout: list[pb.FragmentLayout], where: str) -> None:
    """Refuse a Θ that cannot be this shard's: tensors missing or of other shapes than the layout says,
    values that are not finite, learners' copies that do not fit."""
    theta = state["core"]["theta"]
    shapes = {t.name: list(t.shape) for f in layout for t in f.tensors}
    if not isinstance(theta, dict) or set(theta) != set(shapes):
        raise DilocoError(f"{where}: Θ holds other tensors than its layout names")
    for name, value in theta.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or list(value.shape) != shapes[name]:
            raise DilocoError(f"{where}: Θ tensor {name!r} is not a float tensor of shape {shapes[name]}")
        if not bool(torch.isfinite(value).all()):
            raise DilocoError(f"{where}: Θ tensor {name!r} holds NaN or Inf: refusing to resume from it")
    for learner, held in state["core"]["held"].items():
        for name, value in held.items():
            if name not in shapes or not isinstance(value, torch.Tensor) or list(value.shape) != shapes[name]:
                raise DilocoError(f"{where}: what learner {learner} holds of {name!r} does not fit Θ")
