"""Θ's names for a JAX params pytree, and back: the one place a JAX model meets the run's tensors.

A pytree path is its keys joined with dots (`{"blocks": {"0": {"mlp": …}}}` → `blocks.0.mlp…`); by default
that is the tensor's name in Θ, which is what the built-in Flax GPT is built for. A user's own model
gives `names` (path → Θ name) where its paths differ, and `transposed` for the Θ tensors it keeps the
other way round (a Flax Dense kernel is (in, out); torch keeps (out, in)). Every conversion is checked
tensor for tensor: a mismatch is refused in one line that names the first differing tensor.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import torch

from diloco.errors import DilocoError


def path_name(path: tuple[Any, ...]) -> str:
    """A pytree key path as dotted text: dict keys, sequence indices and attribute names alike."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


@dataclass(frozen=True)
class NameMap:
    names: Mapping[str, str] = field(default_factory=dict)
    """Pytree path → Θ name, for the paths whose dotted form is not already the name."""
    transposed: Collection[str] = ()
    """Θ names of 2-D tensors the pytree holds transposed."""

    def theta_name(self, path: str) -> str:
        return self.names.get(path, path)

    def leaves(self, params: Any) -> dict[str, jax.Array]:
        """Θ name → the pytree's array (in the pytree's layout), in the pytree's order."""
        named: dict[str, jax.Array] = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            name = self.theta_name(path_name(path))
            if name in named:
                raise DilocoError(f"the name map gives two tensors of the params pytree the name {name!r}")
            named[name] = leaf
        return named

    def theta_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape Θ keeps a tensor of this pytree shape in."""
        return tuple(reversed(shape)) if name in self.transposed else tuple(shape)

    def to_theta(self, name: str, value: Any) -> np.ndarray:
        """A pytree array as Θ lays it out (a host array; a view where the layout is the same)."""
        host = np.asarray(value)
        return host.T if name in self.transposed else host

    def from_theta(self, name: str, value: torch.Tensor | np.ndarray) -> np.ndarray:
        host = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        return host.T if name in self.transposed else host

    def check(self, params: Any, theta: Mapping[str, Any], what: str) -> None:
        """`theta` (name → tensor) holds exactly this pytree's tensors, with Θ's shapes; else one line
        naming the first tensor that differs."""
        ours = {n: self.theta_shape(n, tuple(np.shape(v))) for n, v in self.leaves(params).items()}
        theirs = {n: tuple(v.shape) for n, v in theta.items()}
        for name, shape in ours.items():
            if name not in theirs:
                raise DilocoError(f"{what} does not match this model: it has no tensor {name!r} {list(shape)}")
            if theirs[name] != shape:
                raise DilocoError(f"{what} does not match this model: {name!r} is {list(theirs[name])} there, "
                                  f"{list(shape)} here")
        extra = next((n for n in theirs if n not in ours), None)
        if extra is not None:
            raise DilocoError(f"{what} does not match this model: it has {extra!r} {list(theirs[extra])}, "
                              "which this model does not")

    def params_from_theta(self, params: Any, theta: Mapping[str, Any], what: str = "Θ") -> Any:
        """A pytree shaped like `params` holding `theta`'s values (checked first), as device arrays."""
        self.check(params, theta, what)
        flat, tree = jax.tree_util.tree_flatten_with_path(params)
        values = []
        for path, leaf in flat:
            name = self.theta_name(path_name(path))
            values.append(jax.numpy.array(self.from_theta(name, theta[name]), dtype=leaf.dtype, copy=True))
        return jax.tree_util.tree_unflatten(tree, values)

    def theta_from_params(self, params: Any) -> dict[str, torch.Tensor]:
        """Θ (name → CPU torch tensor, torch's layout) from a pytree: what `model.pt` holds."""
        return {n: torch.from_numpy(np.array(self.to_theta(n, v))) for n, v in self.leaves(params).items()}


GPT_NAMES = NameMap()
"""The built-in Flax GPT's paths are Θ's names already."""


def load_model_file(path: str, params: Any, names: NameMap = GPT_NAMES) -> Any:
    """A run's `model.pt` (torch's state dict of Θ) as a pytree shaped like `params`, checked first."""
    theta = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(theta, dict):
        raise DilocoError(f"{path} holds no model state (a {type(theta).__name__})")
    return names.params_from_theta(params, theta, what=str(path))
