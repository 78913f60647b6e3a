"""The JAX learner's parameters on the host, as the torch tensors the shared learner machinery reads.

`HostMirror` is a mapping Θ name → CPU torch tensor. After each jitted step the device arrays are newer
than the host copies; a tensor is copied to the host only when the learner's core reads it (to push a
fragment, or to merge into it), so a step without a push or merge moves nothing and costs O(1) on the
training thread: `trained` keeps the new pytree and bumps a generation count, and its leaves are taken
only when a read needs one. What a merge wrote is copied back to the device between steps (`merged_into`:
one `device_put` of the merged leaves, the pytree rebuilt around them). `MirrorModule` shows the mirror to the shared
code as the nn.Module it partitions into fragments: embeddings declared, in Θ's tensor order.

A push's copy is staged off the training step (`stage_pushes`), as the torch learner's is on a GPU: when
the core reads a due fragment in a step (it is not in flight: a merge reads only fragments in flight),
the mirror starts the device → host copy (`copy_to_host_async`) and gives the core zeros, so its outer
gradient anchor − θ is, for now, the anchor itself, exactly. The staging thread then waits for the copy,
writes θ into the host tensor and subtracts it from that gradient in place (anchor − θ, bit for bit what
the core would have computed), before the link's encode thread may read the push (`side`). A later read
of the tensor on the training thread (a merge, a checkpoint) waits for its staging to be done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch
from torch import nn

from diloco.errors import DilocoError
from diloco.jax.name_map import NameMap

if TYPE_CHECKING:
    from diloco.core.learner_core import LearnerCore


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
        self._tree = jax.tree_util.tree_structure(params)
        self._slot = {name: i for i, name in enumerate(leaves)}
        """Θ name → its leaf's index in the flattened pytree."""
        self._params, self._leaves = params, list(leaves.values())
        """The latest params and, once a read needed them, their leaves."""
        self._generation = 0
        """Steps trained: a host tensor is current while its entry in `_current` equals it."""
        self._current = dict.fromkeys(self.tensors, 0)
        self._fetched: dict[int, int] = {}
        """Fragment → the generation whose device → host copies were started for a read on the step."""
        self.copied_on_step = 0
        """Tensors copied device → host on the training thread (a merge's, a checkpoint's)."""
        self.staged = 0
        """Tensors copied device → host by the staging thread (a push's), off the training step."""
        self.core: LearnerCore | None = None
        self.stepping = False
        """Inside the learner's step: where a due fragment's read is staged."""
        self._fragment_of: dict[str, int] = {}
        self._zeros: dict[str, torch.Tensor] = {}
        self._reads: deque[tuple[str, jax.Array | None]] = deque()
        """A push's reads, in the order the core made them, until its deltas are handed off."""
        self._pending: dict[str, Future[None]] = {}
        """Names whose host tensor the staging thread is writing."""
        self._staging: ThreadPoolExecutor | None = None
        self._shown_norm: torch.Tensor | None = None
        """The norm of the latest push staged: the core's `last_push_norm` while a later one is staged."""

    def stage_pushes(self, core: LearnerCore) -> None:
        """From now on, a push's device → host copy is the staging thread's (see the module's note)."""
        self.core = core
        self._fragment_of = {n: p for p, fragment in enumerate(core.fragments) for n in fragment.names}
        self._staging = ThreadPoolExecutor(1, thread_name_prefix="jax-staging")

    def __getitem__(self, name: str) -> torch.Tensor:
        self._wait(name)
        newer = self._take(name)
        tensor = self.tensors[name]
        if self._staging is not None and self.stepping and self._fragment_of[name] not in self.core.in_flight:
            self._reads.append((name, newer))  # a push's read
            if newer is not None:
                newer.copy_to_host_async()
                return self._zeros.setdefault(name, torch.zeros_like(tensor, requires_grad=False))
        elif newer is not None:
            if self._fragment_of:  # the rest of its fragment is read next (a merge)
                self._fetch(self._fragment_of[name])
            np.copyto(tensor.detach().numpy(), self.names.to_theta(name, newer))
            self.copied_on_step += 1
        return tensor

    def _take(self, name: str) -> jax.Array | None:
        """`name`'s device array if it is newer than the host copy, which is current from now on."""
        if self._current[name] == self._generation:
            return None
        self._current[name] = self._generation
        return self._leaves_now()[self._slot[name]]

    def _fetch(self, p: int) -> None:
        """Start the device → host copies of fragment p's newer tensors at once, not one per read."""
        if self._fetched.get(p) == self._generation:
            return
        self._fetched[p] = self._generation
        for name in self.core.fragments[p].names:
            if self._current[name] != self._generation:
                self._leaves_now()[self._slot[name]].copy_to_host_async()

    def _leaves_now(self) -> list[jax.Array]:
        if self._leaves is None:
            self._leaves = self._tree.flatten_up_to(self._params)
        return self._leaves

    @property
    def copied_to_host(self) -> int:
        """Tensors copied device → host, on the step or staged."""
        return self.copied_on_step + self.staged

    def _wait(self, name: str) -> None:
        pending = self._pending.pop(name, None)
        if pending is not None:
            pending.result()

    # ------------------------------------------------------------ the learner's staging (`link.Landing`)

    def hand_off(self, deltas: Iterable[torch.Tensor]) -> Future[None] | None:
        """Training thread: the core made a push of `deltas` from the reads it just made: stage them."""
        if self._staging is None or not self.stepping:  # the last pushes, at close: read on the training thread
            return None
        deltas = list(deltas)
        reads = [self._reads.popleft() for _ in deltas if self._reads]
        if len(reads) != len(deltas) or len({self._fragment_of[name] for name, _ in reads}) != 1:
            raise RuntimeError("a JAX learner's push does not match the reads its core made for it")
        staged = [(name, newer, delta) for (name, newer), delta in zip(reads, deltas) if newer is not None]
        if not staged:
            return None
        seq = None
        if not self._reads:  # the core's latest push: its norm (`outer_grad_norm`) is known once staged
            seq, self.core._last_push_norm = self.core.seq, self._shown_norm
        done = self._staging.submit(self._stage, staged, deltas, seq)
        for name, _, _ in staged:
            self._pending[name] = done
        return done

    @torch.no_grad()
    def _stage(self, staged: list[tuple[str, jax.Array, torch.Tensor]], deltas: list[torch.Tensor],
               seq: int | None) -> None:
        for name, newer, delta in staged:
            tensor = self.tensors[name]
            np.copyto(tensor.detach().numpy(), self.names.to_theta(name, newer))  # waits for the copy
            delta.sub_(tensor)
        self.staged += len(staged)
        if seq is not None:
            self._shown_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in deltas]))
            if self.core.seq == seq:
                self.core._last_push_norm = self._shown_norm

    @contextmanager
    def side(self, after: Future[None] | None = None) -> Iterator[None]:
        """The link's threads: what follows reads a push once its staging is done."""
        if after is not None:
            after.result()
        yield

    def to_device(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def done(self) -> None:
        return None

    def wait_in_training(self, event: Any) -> None:
        """An answer is merged on the host: nothing to wait for."""

    def close(self) -> None:
        if self._staging is not None:
            self._staging.shutdown(wait=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def trained(self, params: Any) -> None:
        """The training step made `params`: every host copy is now older (copied when next read)."""
        self._params, self._leaves = params, None
        self._generation += 1

    def merged_into(self, params: Any, names: Iterable[str]) -> Any:
        """`params` with the host values of `names` (what merges wrote) copied onto the device, where
        their leaves were: one `device_put` for all of them."""
        wanted = list(names)
        if not wanted:
            return params
        leaves, tree = jax.tree_util.tree_flatten(params)
        if tree != self._tree:
            raise DilocoError(f"the params pytree changed its structure since the learner joined: {tree}")
        for name in wanted:
            self._wait(name)
            self._current[name] = self._generation
        slots = [self._slot[name] for name in wanted]
        hosts = [np.array(self.names.from_theta(name, self.tensors[name]), dtype=leaves[i].dtype)  # a copy
                 for name, i in zip(wanted, slots)]
        for i, value in zip(slots, jax.device_put(hosts, [self._placement(leaves[i]) for i in slots])):
            leaves[i] = value
        return jax.tree_util.tree_unflatten(tree, leaves)

    @staticmethod
    def _placement(leaf: Any) -> jax.sharding.Sharding:
        """Where a merged leaf goes: where the trained one was (a host array's: the default device)."""
        if isinstance(leaf, jax.Array):
            return leaf.sharding
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
