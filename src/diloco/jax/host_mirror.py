"""The JAX learner's parameters on the host, as the torch tensors the shared learner machinery reads.

`HostMirror` is a mapping Θ name → CPU torch tensor. After each jitted step the device arrays are newer
than the host copies; a tensor is copied to the host only when the learner's core reads it (to push a
fragment, or to merge into it), so a step without a push or merge moves nothing. What a merge wrote is
copied back to the device between steps (`merged_into`). `MirrorModule` shows the mirror to the shared
code as the nn.Module it partitions into fragments: embeddings declared, in Θ's tensor order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

from diloco.jax.name_map import NameMap, path_name


class MirrorModule(nn.Module):
    """Parameters only, under Θ's dotted names; 2-D embedding tensors sit in nn.Embedding modules so
    that `fragments.embedding_names` gives them fragments of their own, as for the torch model."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], embeddings: Iterable[str]) -> None:
        super().__init__()
        embeddings = set(embeddings)
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for i, part in enumerate(path):
                if part not in owner._modules:
                    is_embedding = name in embeddings and i == len(path) - 1 and tensor.dim() == 2
                    owner.add_module(part, nn.Embedding(*tensor.shape, _weight=tensor) if is_embedding
                                     else nn.Module())
                owner = owner._modules[part]
            if not isinstance(owner, nn.Embedding):
                owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=True))

    def forward(self, *args: Any) -> None:
        raise TypeError("a host mirror of JAX parameters is not run; the JAX model is")


class HostMirror(Mapping[str, torch.Tensor]):
    def __init__(self, params: Any, names: NameMap, order: Sequence[str] | None = None,
                 embeddings: Iterable[str] = ()) -> None:
        """`order`: Θ's tensor order (the torch model's, for the built-in GPT); default the pytree's."""
        leaves = names.leaves(params)
        order = list(order) if order is not None else list(leaves)
        self.names = names
        self.tensors = {n: torch.from_numpy(np.array(names.to_theta(n, leaves[n]), dtype=np.float32))
                        for n in order}
        self.module = MirrorModule(self.tensors, embeddings)
        # The module wraps each tensor in a Parameter sharing its storage: hand out those.
        self.tensors = dict(self.module.named_parameters())
        self._device: dict[str, jax.Array] = {}
        """Names whose device array is newer than the host copy, with that array."""
        self.copied_to_host = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        newer = self._device.pop(name, None)
        tensor = self.tensors[name]
        if newer is not None:
            np.copyto(tensor.detach().numpy(), self.names.to_theta(name, newer))
            self.copied_to_host += 1
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def trained(self, params: Any) -> None:
        """The training step made `params`: every host copy is now older (copied when next read)."""
        self._device = self.names.leaves(params)

    def merged_into(self, params: Any, names: Iterable[str]) -> Any:
        """`params` with the host values of `names` (what merges wrote) copied onto the device."""
        wanted = set(names)
        if not wanted:
            return params
        flat, tree = jax.tree_util.tree_flatten_with_path(params)
        values = []
        for path, leaf in flat:
            name = self.names.theta_name(path_name(path))
            if name in wanted:
                self._device.pop(name, None)
                leaf = jnp.array(self.names.from_theta(name, self.tensors[name]), dtype=leaf.dtype, copy=True)
            values.append(leaf)
        return jax.tree_util.tree_unflatten(tree, values)
