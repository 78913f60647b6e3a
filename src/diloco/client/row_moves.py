"""Moving a sharded learner's rows between its ranks, and counting what rank 0 holds of them.

Split from `rank_sync.py` so that one place does the gathers and scatters over the learner's own process
group and keeps the memory figures honest: rank 0 gathers a tensor whole only to send it (a push, or Θ
seeding a shard), and "no rank holds the whole model" is only true if those tensors are let go before
many more are gathered. `HeldBytes` counts the gathered tensors still alive anywhere in the process
(the link's queue, a dict, a gRPC iterator), not just the ones one call holds: each gathered tensor's
storage carries a finalizer that takes its bytes off when the memory is freed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist

from diloco.client.param_shards import padded_rows, row_pieces, rows_per_shard
from diloco.errors import DilocoError


def collective_error(exc: BaseException, during: str = "sync") -> DilocoError:
    """A collective of the learner's own process group failed (a rank died, or did not come in time)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DilocoError(f"a rank of this learner stopped answering during {during} ({first[:200]})")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc`, raised by code that runs collectives among others (a training step's FSDP or DDP
    communication, a DCP save), is the process group failing: torch's distributed errors, or a Gloo
    transport's (a peer's connection reset, a timed-out receive) which torch raises as a RuntimeError."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc).lower())


class HeldBytes:
    """Bytes of gathered tensors alive at once, per phase of the learner ("join", "train", "finish"): the
    most held when a tensor was gathered in that phase."""

    def __init__(self) -> None:
        self.now = 0
        self.phase = "train"
        self.peaks: dict[str, int] = {}
        self._lock = threading.RLock()  # a finalizer may run on any thread, this one included

    def track(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.now += nbytes
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.now)
        weakref.finalize(tensor.untyped_storage(), self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.now -= nbytes

    @property
    def peak(self) -> int:
        return max(self.peaks.values(), default=0)


class RowMoves:
    """Gathers to rank 0 and scatters from it, tensor by tensor, over the first replica's shard group
    (HSDP: passed on to the other replicas)."""

    def __init__(self, params: Mapping[str, torch.Tensor], placement, leader: bool) -> None:
        self.params, self.placement, self.leader = params, placement, leader
        self.bytes_between_ranks = 0
        """Bytes of Θ, pushes and answers this rank sent or received over the learner's group."""
        self.scatter_peak = 0
        """The most bytes of one fragment's rows this rank received at once (an answer, or Θ)."""
        self.held = HeldBytes()

    def gather(self, names: list[str], local: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Rank 0 gets each tensor whole, one at a time; the other ranks send their rows (`local`, default
        their rows of the parameter)."""
        group, shards, whole = self.placement.shard_group, self.placement.shards, {}
        if not self.placement.in_first_replica:
            return whole
        for name in names:
            mine = (local[name] if local is not None else self.params[name].to_local()).detach()
            shape = tuple(self.params[name].shape)
            rows = rows_per_shard(shape[0], shards)
            padded = padded_rows(mine, rows)
            out = torch.empty((rows * shards, *shape[1:]), dtype=padded.dtype, device=padded.device) \
                if self.leader else None
            if out is not None:
                self.held.track(out)
            try:
                dist.gather(padded, list(out.split(rows)) if out is not None else None, group=group, group_dst=0)
            except (RuntimeError, dist.DistBackendError) as exc:
                raise collective_error(exc) from exc
            self.bytes_between_ranks += padded.numel() * padded.element_size() * ((shards - 1) if self.leader else 1)
            if out is not None:
                whole[name] = out[:shape[0]]
        return whole

    def scatter(self, values: Mapping[str, torch.Tensor] | None, names: list[str]) -> dict[str, torch.Tensor]:
        """Each rank gets its own rows of rank 0's `values` (HSDP: over the first replica's shard group,
        then from there to the other replicas)."""
        placement, local, held = self.placement, {}, 0
        group, shards = placement.shard_group, placement.shards
        for name in names:
            param = self.params[name]
            rows = rows_per_shard(param.shape[0], shards)
            buffer = torch.empty((rows, *param.shape[1:]), dtype=torch.float32, device=param.to_local().device)
            try:
                if placement.in_first_replica:
                    pieces = row_pieces(values[name].to(torch.float32), rows, shards) if self.leader else None
                    dist.scatter(buffer, pieces, group=group, group_src=0)
                if placement.hsdp:
                    dist.broadcast(buffer, group=placement.mesh.get_group(0), group_src=0)
            except (RuntimeError, dist.DistBackendError) as exc:
                raise collective_error(exc) from exc
            self.bytes_between_ranks += buffer.numel() * 4 * ((shards - 1) if self.leader else 1)
            local[name] = buffer[:param.to_local().shape[0]]
            held += buffer.numel() * 4
        self.scatter_peak = max(self.scatter_peak, held)
        return local
