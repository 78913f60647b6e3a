"""A JAX learner's own checkpoint, in the torch learner's format: the boundary where optax meets it.

The built-in torch learner's checkpoint machinery (`client/checkpoints.py`: sealing, digests, the
plausibility checks, the writer thread and its period rule; `core/own_progress.py`)
is the JAX learner's too. Only two things differ, and they are converted here:

- the inner optimizer is an optax state pytree, not a torch optimizer. `OptaxOptimizer` shows it as
  one: `param_groups` (Θ's shapes, for `check_checkpoint`), `state_dict()` (per parameter, its leaves
  in Θ's layout, keyed by their path in the state; the other leaves (step counts, hyperparameters)
  in the group) and `load_state_dict()`, which checks every leaf against this optimizer's own state
  before it replaces anything;
- the parameters are a pytree on the device: `ParamsModel.state_dict()` is Θ's tensors on the host.

Every value converts bit for bit (float32 stays float32, int32 step counts stay int32).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from diloco.codecs.base import all_finite
from diloco.errors import DilocoError
from diloco.jax.name_map import NameMap, path_name

SCALARS = "optax"
"""The group key holding the optax state's leaves that belong to no parameter."""


def _host(value: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(value))


def _owner(path: tuple[Any, ...], leaf: Any, params: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[str, str] | None:
    """(where in the state, Θ name) when `path` ends with a parameter's path and `leaf` has its shape."""
    for k in range(len(path)):
        hit = params.get(path_name(path[k:]))
        if hit is not None and tuple(np.shape(leaf)) == hit[1]:
            return path_name(path[:k]), hit[0]
    return None


def _param_paths(params: Any, names: NameMap) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each parameter's pytree path → (Θ name, its pytree shape)."""
    return {path_name(p): (names.theta_name(path_name(p)), tuple(np.shape(leaf)))
            for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def optax_state_dict(opt_state: Any, params: Any, names: NameMap) -> dict[str, Any]:
    """`opt_state` as a torch optimizer's state dict: parameter i is the i-th of `names.leaves(params)`."""
    order = {name: i for i, name in enumerate(names.leaves(params))}
    owners = _param_paths(params, names)
    state: dict[int, dict[str, torch.Tensor]] = {}
    scalars: dict[str, torch.Tensor] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        owner = _owner(path, leaf, owners)
        if owner is None:
            scalars[path_name(path)] = _host(leaf)
        else:
            where, name = owner
            state.setdefault(order[name], {})[where] = _host(names.to_theta(name, leaf))
    return {"state": state, "param_groups": [{"params": list(range(len(order))), SCALARS: scalars}]}


def optax_from_state_dict(saved: dict[str, Any], template: Any, params: Any, names: NameMap,
                          refuse: Callable[[str], DilocoError]) -> Any:
    """The optax state `saved` holds, shaped like `template` (this optimizer's state): every leaf
    present, of the template's shape, finite; else `refuse(why)` is raised and nothing is built."""
    order = {name: i for i, name in enumerate(names.leaves(params))}
    owners = _param_paths(params, names)
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    per_param = saved.get("state") if isinstance(saved, dict) else None
    scalars = groups[0].get(SCALARS) if isinstance(groups, list) and groups and isinstance(groups[0], dict) else None
    if not isinstance(per_param, dict) or not isinstance(scalars, dict):
        raise refuse("holds no optax state")
    flat, tree = jax.tree_util.tree_flatten_with_path(template)
    values = []
    for path, leaf in flat:
        owner = _owner(path, leaf, owners)
        if owner is None:
            where = path_name(path)
            value = scalars.get(where)
            shape = tuple(np.shape(leaf))
        else:
            where, name = owner
            value = per_param.get(order[name], {}).get(where) if isinstance(per_param.get(order[name]), dict) else None
            shape = names.theta_shape(name, tuple(np.shape(leaf)))
            where = f"{where} of {name}"
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            raise refuse(f"holds no optax state {where!r} of shape {list(shape)}")
        if not all_finite(value):
            raise refuse(f"holds NaN or Inf in optax state {where!r}")
        host = names.from_theta(owner[1], value) if owner is not None else value.numpy()
        values.append(jnp.array(host, dtype=leaf.dtype, copy=True))
    return jax.tree_util.tree_unflatten(tree, values)


class OptaxOptimizer:
    """A JAX replica's optax state, as the checkpoint code reads and restores a torch optimizer."""

    def __init__(self, replica: Any, names: NameMap) -> None:
        """`replica`: what holds `params` and `opt_state` (a `JaxReplica`)."""
        self.replica, self.names = replica, names

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """One group of Θ-shaped stand-ins (no storage): what the checkpoint checks compare shapes with."""
        shapes = [self.names.theta_shape(n, tuple(np.shape(v))) for n, v in self.names.leaves(self.replica.params).items()]
        return [{"params": [torch.empty(shape, device="meta") for shape in shapes]}]

    def state_dict(self) -> dict[str, Any]:
        return optax_state_dict(self.replica.opt_state, self.replica.params, self.names)

    def converted(self, saved: dict[str, Any], path: Any = "") -> Any:
        """`saved` as this optimizer's optax state, checked leaf for leaf (a one-line DilocoError)."""
        from diloco.client.checkpoints import ADVICE

        def refuse(why: str) -> DilocoError:
            return DilocoError(f"learner checkpoint {path} {why}: {ADVICE}")

        return optax_from_state_dict(saved, self.replica.opt_state, self.replica.params, self.names, refuse)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.replica.opt_state = self.converted(saved)


class ParamsModel:
    """A JAX replica's parameters as the checkpoint holds a model's: Θ's names, torch's layout, host tensors."""

    def __init__(self, replica: Any, names: NameMap) -> None:
        self.replica, self.names = replica, names

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.names.theta_from_params(self.replica.params)

    def load_state_dict(self, saved: dict[str, torch.Tensor]) -> None:
        """Saved parameters back into the replica (a learner that does not sync resumes its own)."""
        self.replica.params = self.names.params_from_theta(self.replica.params, saved, what="the checkpoint")
