"""A learner's own checkpoint (inner optimizer, data position, step count): written with its digest,
read back only once it is checked.

The file is a `state_files.py` file (torch.save plus a BLAKE2b trailer, keyed with the run's secret or
the learner's own credential when it holds one). Reading refuses, in one line
naming the file, anything a restarted learner should not build on: a damaged or foreign file, a step
count above what the run could have taken, an optimizer state for other parameters (another number,
other shapes) or holding NaN/Inf, a data position that is not one. Deleting the file restarts the
learner from the syncer's current Θ without its own state, which is always safe.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from diloco.errors import DilocoError
from diloco.state_files import file_key, load_checked, save_checked

ADVICE = "delete it to restart this learner from the current Θ without its own state"


def write_checkpoint(state: dict[str, Any], path: Path, key: bytes | None = None) -> None:
    """The checkpoint at `path`, atomically, with its digest (sealed with `key`: `checkpoint_key`)."""
    save_checked(state, path, key)


def checkpoint_key(secret: bytes | None, own_token: str | None = None) -> bytes | None:
    """What seals a learner's checkpoint: the run's secret, else the learner's own credential, if any."""
    return file_key(secret if secret is not None else own_token.encode("ascii") if own_token else None)


def read_checkpoint(path: Path, max_steps: int, optimizer: torch.optim.Optimizer, key: bytes | None = None
                    ) -> dict[str, Any]:
    """The checkpoint at `path`, checked against this run (`max_steps`: the most steps a learner of
    it can take) and this learner's `optimizer`; a one-line DilocoError for anything else."""
    state = load_checked(path, "learner checkpoint", ADVICE, key)
    check_checkpoint(state, path, max_steps, optimizer)
    return state


def check_checkpoint(state: dict[str, Any], path: Path, max_steps: int, optimizer: torch.optim.Optimizer) -> None:
    """The checks `read_checkpoint` makes on a loaded state (a sharded learner's state: one rank's part)."""

    def refuse(why: str) -> DilocoError:
        return DilocoError(f"learner checkpoint {path} {why}: {ADVICE}")

    steps = state.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise refuse(f"has no valid step count ({type(steps).__name__})")
    if steps > max_steps:
        raise refuse(f"claims {steps} steps, more than this run could have taken (at most {max_steps})")
    data = state.get("data")
    if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("learner", "epoch", "index")):
        raise refuse("has no valid data position")
    _check_optimizer(state.get("optimizer"), optimizer, refuse)


def _check_optimizer(saved: Any, optimizer: torch.optim.Optimizer, refuse) -> None:
    """The saved optimizer state fits this optimizer's parameters: same groups, same sizes, shapes of
    every per-parameter tensor, all finite (what torch's load_state_dict leaves to the next step)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise refuse("has no valid optimizer state")
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups) or any(
            not isinstance(s, dict) or len(s.get("params", ())) != len(g["params"])
            for s, g in zip(saved["param_groups"], groups)):
        raise refuse("holds the optimizer state of other parameters (another number of them)")
    params = {index: p for s, g in zip(saved["param_groups"], groups) for index, p in zip(s["params"], g["params"])}
    for index, per_param in saved["state"].items():
        if index not in params or not isinstance(per_param, dict):
            raise refuse(f"holds optimizer state for parameter {index!r}, which this model does not have")
        shape = params[index].shape
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                if value.dim() > 0 and value.shape != shape:
                    raise refuse(f"holds optimizer state {key!r} of shape {list(value.shape)} for a parameter of "
                                 f"shape {list(shape)}")
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise refuse(f"holds NaN or Inf in optimizer state {key!r}")
            elif isinstance(value, float) and not math.isfinite(value):
                raise refuse(f"holds a non-finite optimizer value {key!r}")
