"""`diloco.Learner`: a user's training loop joins a Decoupled DiLoCo run with a few lines.

    model = MyModel(); optimizer = torch.optim.AdamW(model.parameters())
    learner = diloco.Learner(model, syncer="syncer-host:7070")   # joins, takes the current Θ
    while not learner.should_stop:
        loss = model(inputs, targets); loss.backward(); optimizer.step(); optimizer.zero_grad()
        learner.step(tokens=inputs.numel())                      # never waits on the network
    learner.close()

The training thread only reports steps and applies merges between them. Everything else runs on
background threads: encoding pushes, sending them (through the emulated link when one is given),
receiving and decoding new versions, heartbeats. Under torchrun, rank 0 talks to the syncer; how
merges and pushes cross the learner's ranks depends on where its parameters live (`rank_sync.py`:
broadcast whole for plain and DDP models, row by row for FSDP2 and HSDP ones); token counts are summed
over ranks.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.core.learner_core import LearnerCore
from diloco.core.learner_events import (Advance, Finished, LearnerAction, LearnerEvent, PushRefused, SendProgress,
                                        SendPush, StepDone, Tick, UpdateArrived, WaitFor)
from diloco.core.messages import Push
from diloco.core.own_progress import ResumePolicy, export_progress, resume_progress
from diloco.errors import DilocoError
from diloco.fragments import Fragment, embedding_names, partition
from diloco.client.joining import Joined, ShardLink, join_run
from diloco.client.link import (CLOSE_BOUND_S, Arrival, ClientLink, HeartbeatOut, LeaveOut, LinkHandlers, LinkShape,
                                ProgressOut, PushOut, ShardWays, UpEvent, bytes_by_home)
from diloco.transport.wire_messages import spec_of
from diloco.client.param_shards import is_sharded
from diloco.client.collective_bound import BOUND
from diloco.client.rank_sync import ReplicatedRanks, ShardedRanks, sharded_settings_problem
from diloco.client.sharded_progress import agree_over_ranks
from diloco.client.staging import DeviceStaging
from diloco.transport.security import TransportSecurity
from diloco.v1 import diloco_pb2 as pb

__all__ = ["HomeLink", "Learner", "LinkShape"]

log = logging.getLogger("diloco.learner")


@dataclass(frozen=True)
class HomeLink:
    """Where one syncer shard runs (a region's name, for the report's per-home bytes) and the emulated link
    a learner's traffic with it crosses (None: the network as it is)."""

    home: str
    shape: LinkShape | None


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameter names both ends agree on (DDP adds a `module.` prefix)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class Learner:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, syncer: str,
                 learner: int | None = None, link: LinkShape | None = None, connect_timeout_s: float = 30.0,
                 host: str = "", security: TransportSecurity | None = None, tokens_per_step: int | None = None,
                 homes: Sequence[HomeLink] | None = None, owners: Sequence[int] | None = None,
                 host_params: Mapping[str, torch.Tensor] | None = None,
                 own_progress: Mapping[str, Any] | None = None, resume: ResumePolicy = "own",
                 stop: threading.Event | None = None) -> None:
        """Join the run served at `syncer` (any shard's HOST:PORT) and load its current Θ into `model`.
        `learner` asks for an id (a restart keeps its own); by default the syncer picks one, or the one
        named by the learner's own credential (`security`, or $DILOCO_LEARNER_TOKEN). `tokens_per_step`:
        what one inner step trains on this rank (batch × sequence), declared to the syncer at join.
        `homes`: per shard, where it runs and the link to it, when the shards run in different regions
        (`placement = "links"`): each shard's traffic is shaped and counted on its own link, instead of
        all on `link` (give `owners` with it: their shard indices are the same). `owners`: per fragment,
        the shard the learner's config says owns it; a run whose shards say otherwise is refused (None:
        the shards' own map). `host_params`: the tensors to read and merge into instead of the module's
        own (the JAX learner's host mirror, which copies a tensor from its device when it is read).
        `own_progress`: what this learner's checkpoint saved of its unpushed progress (`export_progress`;
        a sharded learner: each rank its rows), resumed on top of Θ where `resume` and
        `core/own_progress.usable` allow. `stop`: set while the learner still joins (SIGTERM, Ctrl-C), it
        ends the wait for an unreachable syncer in one line rather than after `connect_timeout_s`."""
        self._give_up = stop
        self.model = model
        self.own_progress, self.resume_policy = own_progress, resume
        self.resumed: dict[int, str | None] = {}
        """Per fragment: None where the saved progress was resumed, else why Θ was taken."""
        self.optimizer = optimizer
        self.module = _unwrap(model)
        self.params = host_params if host_params is not None else {
            n: p for n, p in self.module.named_parameters() if p.requires_grad}
        self.staging = DeviceStaging(next(iter(self.params.values())).device)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.link_shape = link
        self.security = security
        self.homes = list(homes) if homes is not None else None
        links = [h.shape for h in self.homes] if self.homes is not None else [link]
        self.up, self.down = (ShardWays(links, per_shard=self.homes is not None) for _ in range(2))
        self.owners = owners
        self.tokens = self.steps = self.merges = 0
        self._claim = (0, 0)
        """(tokens, the core's step) as of the last step's end: what a heartbeat claims (`_mark_claim`)."""
        self.busy_s = self.waiting_s = 0.0
        self._stop_requested = False
        self._stop_shared = False
        """The stop request every rank ended the last step with (rank 0's link may set `_stop_requested` at
        any time, on its own thread: a rank that read it mid-step would stop a step before the others)."""
        self._closed = False
        self.core: LearnerCore | None = None
        self.link: ClientLink | None = None
        """Rank 0's link to the syncer's shards (the other ranks have none)."""
        self.shards: list[ShardLink] = []
        self.settings: pb.Settings | None = None
        self.id = -1
        self.declared_tokens_per_step = (tokens_per_step or 0) * self.world
        self._refused: queue.Queue[Push] = queue.Queue()
        self.ranks: ReplicatedRanks | ShardedRanks = (ShardedRanks if is_sharded(self.params) else ReplicatedRanks)(
            self.params, self.rank, self.world)
        if isinstance(self.ranks, ShardedRanks):
            self._join_sharded(syncer, learner, connect_timeout_s, host)
        else:
            self._join_replicated(syncer, learner, connect_timeout_s, host)
        self.ranks.core, self.ranks.fragments = self.core, self.fragments
        self._mark_claim()
        if self.link is not None:
            self.link.start(LinkHandlers(encode=self.core.encode, anchors=lambda p: self.core.anchors[p],
                                         refused=self._refused.put, stop=self.request_stop, beat=self._beat),
                            name="learner")
        self.started = self._last_step_end = clock.monotonic()

    # ------------------------------------------------------------ joining

    def _partition(self, count: int) -> list[Fragment]:
        return partition(self.module, count, embedding_names(self.module))

    def _join_replicated(self, syncer: str, learner: int | None, timeout_s: float, host: str) -> None:
        """Rank 0 joins and takes Θ whole, then broadcasts it: every rank holds the whole model."""
        header = torch.zeros(2, dtype=torch.int64)
        if self.rank == 0:
            joined = self._connect(syncer, learner, timeout_s, host, self.params, None)
            with torch.no_grad():
                for name, value in joined.theta.items():
                    self.params[name].copy_(value)
            self._build(joined.settings, joined.fragments, joined.versions, joined.last_seq, self.params, joined.push_at)
            self.resumed = resume_progress(self.core, self.own_progress, joined.last_seqs, self.resume_policy)
            header[0], header[1] = self.id, self.settings.fragments
        if self.world > 1:
            dist.broadcast(header, 0)
            for p in self.params.values():
                dist.broadcast(p.data, 0)
        self.id = int(header[0])
        self.fragments = self.core.fragments if self.core else self._partition(int(header[1]))

    def _join_sharded(self, syncer: str, learner: int | None, timeout_s: float, host: str) -> None:
        """Rank 0 joins; Θ reaches each rank's rows fragment by fragment; every rank builds its own core
        over its rows (`rank_sync.ShardedRanks`)."""
        ranks = self.ranks
        info = None
        if self.rank == 0:
            joined = ranks.lead_join(lambda params, take: self._connect(syncer, learner, timeout_s, host, params,
                                                                        take))
            info = (joined.learner, joined.settings.SerializeToString(), joined.versions, joined.last_seq,
                    joined.last_seqs, joined.push_at)
        else:
            ranks.follow_join()
        self.id, settings, versions, last_seq, last_seqs, push_at = ranks.end_join(info)
        self.settings = pb.Settings.FromString(settings)
        self._build(self.settings, self._partition(self.settings.fragments), versions, last_seq, ranks.local(),
                    push_at)  # every rank the same times: their cores decide the same pushes
        self.resumed = resume_progress(self.core, self.own_progress, last_seqs, self.resume_policy,
                                       agree=agree_over_ranks)  # each rank its rows, the same fragments

    def _connect(self, address: str, learner: int | None, timeout_s: float, host: str, params: Mapping[str, Any],
                 take: Callable[[int, dict[str, torch.Tensor]], None] | None) -> Joined:
        """Join every shard, seed or check Θ's layout, take Θ, and open this learner's link."""
        joined = join_run(address, learner, timeout_s, host, params, self._partition, self.security,
                          self.declared_tokens_per_step, self.owners, take=take,
                          track=self.ranks.rows.held.track if isinstance(self.ranks, ShardedRanks) else None,
                          give_up=self._give_up)
        self.id, self.settings, self.shards = joined.learner, joined.settings, joined.shards
        self.join_s = joined.pull_s
        if take is not None:
            problem = sharded_settings_problem(joined.settings)
            if problem:
                for shard in joined.shards:  # refused: not counted alive
                    shard.client.leave(joined.learner)
                    shard.client.close()
                raise DilocoError(problem)
        self.link = ClientLink(self.id, f"learner {self.id}", self.shards, joined.versions, self.up, self.down,
                               self.staging)
        log.info("learner %d joined %d shard(s); %d fragments", self.id, len(self.shards), len(joined.fragments))
        return joined

    def _build(self, settings: pb.Settings, fragments: list[Fragment], versions: dict[int, int], last_seq: int,
               params: dict[str, torch.Tensor], push_at: dict[int, float]) -> None:
        """This rank's learner core, over the parameters (or rows of them) it holds, with its first pushes on
        the syncer's grid where the syncer named times (`push_at`)."""
        self._first_seq = last_seq  # numbers before it belong to this learner's earlier lives
        self.fragments = fragments
        self.core = spec_of(settings).learner_core(
            self.id, params, fragments, versions=[versions[p] for p in range(len(fragments))],
            first_seq=last_seq, encode_later=True)
        self.core.push_at(push_at)

    # ------------------------------------------------------------ the training thread

    @property
    def should_stop(self) -> bool:
        """The run's shared token budget is spent (as the syncer counts it)."""
        return self._stop_shared if self.world > 1 else self._stop_requested

    def resume(self, step: int) -> None:
        """The user's loop restored its own checkpoint taken at inner step `step`: the fragment schedule
        continues from there. Call before the first `step()`."""
        if self.core is not None:
            self.core.resume_at(step)
        self._mark_claim()

    def own_progress_state(self, deferred: bool = False) -> dict[str, Any] | None:
        """What a checkpoint keeps to resume this learner's unpushed progress (None on a rank without a core:
        a replicated learner's other ranks; a sharded learner's ranks each give their rows). `deferred`:
        for a packed copy, which computes the progress as it copies (`export_progress`)."""
        return export_progress(self.core, deferred) if self.core is not None else None

    def request_stop(self) -> None:
        """Stop at the end of this step (e.g. on Ctrl-C); under torchrun, rank 0's request counts."""
        self._stop_requested = True

    def step(self, tokens: int) -> None:
        """One inner step is done (after optimizer.step()): push what is due, merge what has arrived.
        Waits only where the strategy is synchronous (DiLoCo), for the answer it needs."""
        if self._closed:
            raise DilocoError("Learner.step() after close()")
        now = clock.monotonic()
        self.busy_s += now - self._last_step_end
        step_time = now - self._last_step_end
        tokens = self.ranks.total(tokens)
        if self.ranks.leader:  # the step sequence every learner follows (`LearnerCore.handle`)
            self._lead(lambda: self._step_sequence(tokens, step_time))
        else:
            self._follow()
        self.tokens += tokens
        self.steps += 1
        self._mark_claim()
        self._last_step_end = clock.monotonic()

    def _step_sequence(self, tokens: int, step_time: float) -> None:
        self._raise_if_failed()
        self._carry_out(self._feed(StepDone(tokens, step_time)))
        self._hand_over()
        if self._carry_out(self._feed(Advance(last=self._stop_requested))):
            self._wait()

    def _lead(self, sequence: Callable[[], None]) -> None:
        """Rank 0 runs `sequence` through its core, then ends the step on every rank: merges shared, and
        its stop request; a failure is told to the other ranks before it is raised here."""
        self.ranks.open_step()
        try:
            sequence()
        except DilocoError as exc:
            self.ranks.close_step(self._stop_requested, str(exc))
            raise
        stop, merges = self.ranks.close_step(self._stop_requested)
        self._stop_shared, self.merges = stop, self.merges + merges

    def _follow(self) -> None:
        self.ranks.open_step()
        stop, merges = self.ranks.follow()
        self._stop_requested = self._stop_shared = stop
        self.merges += merges

    def _raise_if_failed(self) -> None:
        error = self.link.error if self.link is not None else None
        if error is not None:
            raise DilocoError(f"learner {self.id}: syncing failed: {error}") from error

    def _feed(self, event: LearnerEvent) -> Iterable[LearnerAction]:
        actions = self.ranks.feed(event, clock.now())
        if self.core.finished and self.link is not None:  # its last pushes are made: it merges no answer now
            self.link.stop_answers()
        return actions

    def _carry_out(self, actions: Iterable[LearnerAction]) -> bool:
        """Send what the core says to send, in order; True if it says to wait before the next step. Taken in
        one pass: a sharded learner gathers each push only as it is reached (`ShardedRanks.feed`)."""
        wait = False
        for action in actions:
            if isinstance(action, SendPush):
                self._send(action.push)
            elif isinstance(action, SendProgress):  # behind this step's pushes, on the same link
                self.link.send(ProgressOut(action.progress))
            wait = wait or isinstance(action, WaitFor)
            del action  # a gathered push is let go here, before the next is gathered
        return wait

    def _hand_over(self) -> None:
        """What came back since the last step: refused pushes, then answers the link has delivered."""
        while not self._refused.empty():
            self._carry_out(self._feed(PushRefused(self._refused.get())))
        for arrival in self.link.arrivals.ready():
            self._carry_out(self._take(arrival))

    def _wait(self) -> None:
        """Take answers as they come until the core says to go on (synchronous strategies). A learner
        told to stop does not wait for an answer it will not merge."""
        while self.core.waiting and not self._stop_requested:
            waited_from = clock.monotonic()
            arrival = self.link.arrivals.get(timeout=1.0)
            self.waiting_s += clock.monotonic() - waited_from
            if arrival is not None:
                self._carry_out(self._take(arrival))
            else:
                self.ranks.tick()
                self._carry_out(self._feed(Tick()))  # an answer overdue past its bound is given up
            self._raise_if_failed()

    def _take(self, arrival: Arrival) -> Iterable[LearnerAction]:
        self.staging.wait_in_training(arrival.ready)
        return self._feed(UpdateArrived(arrival.update))

    def _send(self, push: Push) -> None:
        self.link.send(PushOut(push, self.staging.hand_off(push.deltas.values())))

    def _mark_claim(self) -> None:
        """What a heartbeat claims from now on, taken as one pair between steps: its thread reading the tokens
        and the core's step apart could pair a step's tokens with the step before (a sharded leader's core
        takes the step only once its ranks hear of it), which the syncer refuses as tokens risen with no step."""
        self._claim = (self.tokens, self.core.step if self.core is not None else self.steps)  # resumed steps too

    def _beat(self) -> list[UpEvent]:
        tokens, step = self._claim
        return [HeartbeatOut(tokens, step)]

    def close(self, finished: bool = True) -> dict[str, Any]:
        """Push what no push has carried yet, leave, stop the threads; return this learner's report.
        `finished`: it trained its share of the run (False: it was interrupted and may come back)."""
        if self._closed:
            return self.report()
        self._closed = True
        self.wall_s = clock.monotonic() - self.started
        BOUND.relax()  # leaving, the last evaluation and checkpoint may part the ranks for longer than a step
        if isinstance(self.ranks, ShardedRanks):  # one fragment gathered at rank 0 at a time, each sent first
            self.ranks.leaving(self._settle if self.link is not None else None)
        if self.ranks.leader:  # may merge answers that have arrived
            self._lead(self._finish_sequence)
        else:
            self._follow()
        if self.link is not None:
            self.link.send(LeaveOut(finished))
            self.link.close()
        return self.report()

    def _finish_sequence(self) -> None:
        """The last pushes (`Finished`): a learner that waits for its answers takes its last ones first,
        unless it was told to stop."""
        if self._carry_out(self._feed(Finished())):
            self._wait()
            if self.core.waiting:  # told to stop while it waited: it pushes without them
                self._carry_out(self._feed(Finished(wait=False)))

    def _settle(self) -> None:
        """Leaving: the last push sent has left (for at most what the other ranks wait at a gather)."""
        if not self.link.drain(min(CLOSE_BOUND_S, BOUND.floor() / 2)):
            log.warning("learner %d: a last push is still on its way; gathering the next one anyway", self.id)

    def report(self) -> dict[str, Any]:
        wall = getattr(self, "wall_s", clock.monotonic() - self.started)
        core = self.core
        by_home = bytes_by_home(self.up, self.down, [h.home for h in self.homes] if self.homes is not None else None)
        return {"learner": self.id, "rank": self.rank, "world": self.world, "tokens": self.tokens,
                "steps": self.steps, "busy_s": self.busy_s, "waiting_s": self.waiting_s, "wall_s": wall,
                "busy_fraction": self.busy_s / wall if wall else 1.0, "merges": self.merges,
                "pushes": core.seq - self._first_seq if core else 0, "stale_updates": core.stale_updates if core else 0,
                "merge_lag_steps": sum(core.merge_lags) / len(core.merge_lags) if core and core.merge_lags else None,
                "bytes_up": self.up.bytes_sent, "bytes_down": self.down.bytes_sent,
                "messages_up": self.up.messages, "messages_down": self.down.messages,
                "peak_message_bytes_up": self.up.peak_message_bytes, "join_s": getattr(self, "join_s", None),
                **by_home,
                "bytes_between_ranks": getattr(self.ranks, "bytes_between_ranks", 0),
                "peak_staging_bytes": getattr(self.ranks, "peak_staging_bytes", 0),
                "peak_gathered_bytes": getattr(self.ranks, "peak_gathered_bytes", {})}
