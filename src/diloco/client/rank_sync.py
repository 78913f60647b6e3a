"""How the ranks of one learner share its syncing: where its parameters live, and how Θ, pushes and
merges cross between its ranks. Only global rank 0 talks to the syncer; everything that crosses ranks
goes over the learner's own process group.

- `ReplicatedRanks` (one process, or DDP): every rank holds the whole model; rank 0 alone runs the
  learner core and broadcasts each merged fragment, with its stop request, at the end of each step.
- `ShardedRanks` (FSDP2 `fully_shard`, or HSDP's replicate × shard mesh): every rank runs its own core
  over its local slices, so no rank holds the whole model or all the anchors. Rank 0 leads: each event
  it hands its core is broadcast (an answer's values scattered, each rank getting its own rows) and
  every rank takes it in the same order at the same `now`, so all cores decide alike; each push's
  slices are gathered at rank 0, one tensor at a time, into the one fragment rank 0 sends. Pushing
  from rank 0 keeps `diloco.v1` unchanged and one learner per island on the syncer's side; the cost
  is one fragment at rank 0 while it is on its way (docs/runtime.md has the measurement). Pushes are
  gathered only as the driver reaches them (`feed` returns them lazily), and when the learner leaves
  each waits for the one before to have left (`settle`): its last pushes, one per fragment, never
  stand whole at rank 0 together. Seeding a shard gathers each tensor as its frames are due.

The leader (rank 0) calls `feed` for each event and `close_step` at the end of a step; every other rank
calls `follow` meanwhile. A failure on the leader is told to the followers, which raise the same line.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from diloco.client import fault_injection
from diloco.client.collective_bound import BOUND
from diloco.core.learner_core import LearnerCore
from diloco.core.learner_events import LearnerAction, LearnerEvent, PushRefused, SendPush, UpdateArrived
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.client.param_shards import layout_fingerprint, placement_of
from diloco.client.rank_messages import broadcast, summed
from diloco.client.row_moves import RowMoves, collective_error


def sharded_settings_problem(settings: Any) -> str | None:
    """What a sharded learner cannot do: hold state of the whole model at rank 0 (error feedback's
    residuals), or apply relative answers (a lossy downlink's differences to the whole anchor)."""
    if settings.error_feedback:
        return "a sharded learner (FSDP/HSDP) cannot sync with error feedback on (set codec.error_feedback = false)"
    if settings.codec_down not in ("", "fp32"):
        return (f"a sharded learner (FSDP/HSDP) takes fp32 answers only (codec.down = \"fp32\"); this run's is "
                f"{settings.codec_down}")
    return None


# ------------------------------------------------------------ plain and DDP models

END, TICK, FAILED = 0, 1, 2
"""What rank 0 tells the other ranks of a replicated learner at the end of a step, or while it waits."""



class ReplicatedRanks:
    """Every rank holds the whole model (today's DDP learner): rank 0's merges are broadcast."""

    def __init__(self, params: dict[str, torch.Tensor], rank: int, world: int) -> None:
        self.params, self.rank, self.world = params, rank, world
        self.leader = rank == 0
        self.core: LearnerCore | None = None
        self.fragments: list[Fragment] = []
        self._before: list[int] = []

    def local(self) -> dict[str, torch.Tensor]:
        return self.params

    def total(self, tokens: int) -> int:
        return summed(tokens, self.world)

    def open_step(self) -> None:
        BOUND.step()
        self._before = list(self.core.anchor_versions) if self.leader else []

    def feed(self, event: LearnerEvent, now: float) -> list[LearnerAction]:
        return self.core.handle(event, now)

    def close_step(self, stop: bool, error: str | None = None) -> tuple[bool, int]:
        merged = _changed(self._before, self.core.anchor_versions)
        if self.world == 1:  # nothing to agree on: no flags tensor on a plain step's training thread
            return bool(stop), sum(merged)
        flags = self._flags(END if error is None else FAILED)
        flags[:-2] = torch.tensor(merged, dtype=torch.int64)
        flags[-2] = int(stop)
        return self._share(flags)

    def tick(self) -> None:
        """Rank 0 is still waiting on the syncer: the others' wait is not a dead rank's."""
        if self.world > 1:
            self._share(self._flags(TICK))

    def follow(self) -> tuple[bool, int]:
        while True:
            flags = self._flags(END)
            stop, merges = self._share(flags)
            if int(flags[-1]) == FAILED:
                raise DilocoError("rank 0 of this learner failed while syncing (its log says why)")
            if int(flags[-1]) == END:
                return stop, merges

    def _flags(self, kind: int) -> torch.Tensor:
        """Per fragment whether it was merged, then the stop request, then what the message is."""
        flags = torch.zeros(len(self.fragments) + 2, dtype=torch.int64)
        flags[-1] = kind
        return flags

    def _share(self, flags: torch.Tensor) -> tuple[bool, int]:
        """Every rank ends a step with rank 0's parameters and stop request (a collective)."""
        if self.world > 1:
            try:
                dist.broadcast(flags, 0)
                with torch.no_grad():
                    for p in flags[:-2].nonzero().flatten().tolist():
                        for name in self.fragments[p].names:
                            dist.broadcast(self.params[name].data, 0)
            except (RuntimeError, dist.DistBackendError) as exc:
                raise collective_error(exc) from exc
        return bool(flags[-2]), int(flags[:-2].sum())


# ------------------------------------------------------------ FSDP2 and HSDP models


class ShardedRanks:
    """Every rank's core runs on its own rows of every parameter; rank 0 leads (module docstring)."""

    def __init__(self, params: dict[str, torch.Tensor], rank: int, world: int) -> None:
        self.global_params = params
        self.placement = placement_of(params, world)
        self.rank, self.world, self.leader = rank, world, rank == 0
        self.core: LearnerCore | None = None
        self.fragments: list[Fragment] = []
        self.rows = RowMoves(params, self.placement, self.leader)
        self._before: list[int] = []
        self.gathers = 0
        """Pushes gathered so far (each one fragment, one tensor at a time)."""
        self.settle: Callable[[], None] | None = None
        """Rank 0, while leaving: returns once the push before has left (the next is gathered only then)."""
        self._seeding = threading.Lock()
        """Seeding gathers run on gRPC's request thread: a retried Init's must not interleave with the
        call before it, nor with the main thread's messages."""
        self._joining = False
        self._check_agreement(layout_fingerprint(params, self.placement))

    @property
    def bytes_between_ranks(self) -> int:
        """Bytes of Θ, pushes and answers this rank sent or received over the learner's group."""
        return self.rows.bytes_between_ranks

    @property
    def peak_staging_bytes(self) -> int:
        """The most bytes of gathered tensors rank 0 held at once (`row_moves.HeldBytes`: wherever they
        were, the client link's queue included), or of one fragment's rows a rank received at once."""
        return max(self.rows.held.peak, self.rows.scatter_peak)

    @property
    def peak_gathered_bytes(self) -> dict[str, int]:
        """Per phase ("join": seeding, "train", "finish": the last pushes), the most gathered bytes rank 0
        held at once."""
        return dict(self.rows.held.peaks)

    def local(self) -> dict[str, torch.Tensor]:
        """This rank's rows of each parameter: views of the live storage, so merges land in the model."""
        return {n: p.to_local() for n, p in self.global_params.items()}

    def _check_agreement(self, fingerprint: list[tuple]) -> None:
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, fingerprint)
        for r, theirs in enumerate(everyone):
            if theirs != fingerprint:
                diff = next(((a, b) for a, b in zip(fingerprint, theirs) if a != b), (len(fingerprint), len(theirs)))
                raise DilocoError(f"ranks of this learner disagree about the model: rank {self.rank} has {diff[0]}, "
                                  f"rank {r} has {diff[1]}; every rank must build and shard the same model")

    # ------------------------------------------------------------ the leader's side

    def _tell(self, message: tuple) -> None:
        broadcast(message)

    def _hear(self) -> tuple:
        return broadcast(None)

    def total(self, tokens: int) -> int:
        return summed(tokens, self.world)

    def open_step(self) -> None:
        BOUND.step()
        self._before = list(self.core.anchor_versions)

    def feed(self, event: LearnerEvent, now: float) -> Iterator[LearnerAction]:
        """Rank 0: hand `event` to every rank's core; its actions come back in order, each push gathered
        whole only as the caller reaches it (it must take them all: the other ranks gather with it)."""
        if isinstance(event, UpdateArrived):
            update = event.update
            self._tell(("event", UpdateArrived(replace(update, values={})), now))
            local = self._scatter(update.values, self.fragments[update.fragment].names)
            event = UpdateArrived(replace(update, values=local))
        elif isinstance(event, PushRefused):
            self._tell(("event", PushRefused(replace(event.push, deltas={})), now))
        else:
            self._tell(("event", event, now))
        return self._gathered(self.core.handle(event, now))

    def _gathered(self, actions: Iterable[LearnerAction]) -> Iterator[LearnerAction]:
        """Each push gathered as it is reached, after the one before has left when leaving (`settle`)."""
        for action in actions:
            if isinstance(action, SendPush):
                if self.settle is not None:
                    self.settle()
                action = self._gather_push(action)
            yield action

    def close_step(self, stop: bool, error: str | None = None) -> tuple[bool, int]:
        self._tell(("end", stop, error))
        return stop, self._merged()

    def tick(self) -> None:
        """Rank 0 is still waiting on the syncer: the others' wait is not a dead rank's."""
        self._tell(("tick",))

    def _merged(self) -> int:
        return sum(_changed(self._before, self.core.anchor_versions))

    def leaving(self, settle: Callable[[], None] | None) -> None:
        """The learner is leaving: its core pushes every fragment at once, and rank 0 gathers each only once
        `settle` returns (the push before has left), so they never stand whole at rank 0 together."""
        self.settle, self.rows.held.phase = settle, "finish"

    # ------------------------------------------------------------ the followers' side

    def follow(self) -> tuple[bool, int]:
        """Every rank but 0: take rank 0's events until it ends the step; its stop request comes along."""
        while True:
            message = self._hear()
            if message[0] == "tick":
                continue
            if message[0] == "end":
                if message[2] is not None:
                    raise DilocoError(message[2])
                return bool(message[1]), self._merged()
            event, now = message[1], message[2]
            if isinstance(event, UpdateArrived):
                local = self._scatter(None, self.fragments[event.update.fragment].names)
                event = UpdateArrived(replace(event.update, values=local))
            for action in self.core.handle(event, now):
                if isinstance(action, SendPush):
                    self._gather_push(action)

    # ------------------------------------------------------------ joining

    def lead_join(self, join: Callable[[Mapping[str, Any], Callable[[int, dict[str, torch.Tensor]], None]], Any]
                  ) -> Any:
        """Rank 0: run `join(params, take)`: Θ reaches every rank fragment by fragment (`take`), and a
        shard that must be seeded gets its values gathered at rank 0 one tensor at a time, as its Init
        frames are made (the first learner of a run only)."""
        self._joining, self.rows.held.phase = True, "join"
        try:
            joined = join(_GatheringView(self), self._take)
        except BaseException as exc:
            self._end_join(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise
        self._end_join(None)
        return joined

    def _end_join(self, error: str | None) -> None:
        with self._seeding:  # after this, a late seeding gather (a failed Init's iterator) refuses
            self._joining, self.rows.held.phase = False, "train"
            self._tell(("end", False, error))

    def follow_join(self) -> None:
        while True:
            message = self._hear()
            if message[0] == "end":
                if message[2] is not None:
                    raise DilocoError(message[2])
                return
            if message[0] == "take":
                self._take_into(self._scatter(None, message[1]))
            else:  # "gather": rank 0 seeds a shard
                self._gather(message[1])

    def end_join(self, info: Any) -> Any:
        """Rank 0 hands what the others need to build their cores (None on the others: they get it)."""
        return broadcast(info if self.leader else None)

    def _take(self, p: int, values: dict[str, torch.Tensor]) -> None:
        names = list(values)
        with self._seeding:
            self._tell(("take", names))
            self._take_into(self._scatter(values, names))

    @torch.no_grad()
    def _take_into(self, local: dict[str, torch.Tensor]) -> None:
        for name, value in local.items():
            self.global_params[name].to_local().copy_(value)

    def gather_whole(self, name: str) -> torch.Tensor:
        """Rank 0: one parameter whole (seeding a shard), on gRPC's request thread as Init's frames are
        made; it is let go once encoded."""
        device = self.global_params[name].device
        with self._seeding, (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
            if not self._joining:
                raise DilocoError("seeding after the join ended (an Init call given up)")
            self._tell(("gather", [name]))
            return self._gather([name])[name]

    # ------------------------------------------------------------ moving rows

    def _gather_push(self, action: SendPush) -> SendPush:
        """Each rank's rows of the push's deltas, put together at rank 0 (a collective)."""
        push = action.push
        self.gathers += 1
        fault_injection.maybe_fail(fault_injection.AT_GATHER, self.rank, self.gathers)  # a test's rank dies or hangs here
        whole = self._gather(list(push.deltas), push.deltas)
        if not self.leader:
            return action
        nbytes = sum(self.core.codec.wire_bytes(d.numel()) for d in whole.values())
        return SendPush(replace(push, deltas=whole, payload_bytes=nbytes))

    def _gather(self, names: list[str], local: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return self.rows.gather(names, local)

    def _scatter(self, values: Mapping[str, torch.Tensor] | None, names: list[str]) -> dict[str, torch.Tensor]:
        return self.rows.scatter(values, names)


def _changed(before: list[int], after: list[int]) -> list[int]:
    """Per fragment, 1 where its anchor version moved this step (a merge), else 0."""
    return [int(a != b) for a, b in zip(before, after)]


class _GatheringView(Mapping):
    """The parameters as joining sees them at rank 0: global shapes for layouts, and a whole tensor only
    when a shard must be seeded with it (`.detach()`)."""

    def __init__(self, ranks: ShardedRanks) -> None:
        self.ranks = ranks

    def __getitem__(self, name: str) -> _Whole:
        return _Whole(self.ranks, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ranks.global_params)

    def __len__(self) -> int:
        return len(self.ranks.global_params)


@dataclass(frozen=True)
class _Whole:
    ranks: ShardedRanks
    name: str

    @property
    def shape(self) -> torch.Size:
        return self.ranks.global_params[self.name].shape

    def detach(self) -> torch.Tensor:
        return self.ranks.gather_whole(self.name)
