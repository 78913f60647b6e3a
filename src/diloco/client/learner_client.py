"""`diloco.Learner`: a user's training loop joins a Decoupled DiLoCo run with a few lines.

    model = MyModel(); optimizer = torch.optim.AdamW(model.parameters())
    learner = diloco.Learner(model, syncer="syncer-host:7070")   # joins, takes the current Θ
    while not learner.should_stop:
        loss = model(inputs, targets); loss.backward(); optimizer.step(); optimizer.zero_grad()
        learner.step(tokens=inputs.numel())                      # never waits on the network
    learner.close()

The training thread only reports steps and applies merges between them. Everything else runs on
background threads: encoding pushes, sending them (through the emulated link when one is given),
receiving and decoding new versions, heartbeats. Under torchrun, rank 0 talks to the syncer and
broadcasts each merge to the other ranks of the learner; token counts are summed over ranks.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.codecs import Encoded
from diloco.core.learner_core import LearnerCore
from diloco.core.messages import MESSAGE_HEADER_BYTES, Progress, Push, Update
from diloco.errors import DilocoError
from diloco.fragments import Fragment, embedding_names, partition
from diloco.core.liveness import HEARTBEAT_S
from diloco.transport.calls import SyncerUnavailable, with_retries
from diloco.transport.frames import tensor_header
from diloco.client.answers import update_of
from diloco.client.joining import ShardLink, join_run
from diloco.transport.run_settings import spec_of
from diloco.client.staging import DeviceStaging
from diloco.transport.security import TransportSecurity
from diloco.network.shaping import DeliveryQueue, ShapedDirection
from diloco.v1 import diloco_pb2 as pb

if TYPE_CHECKING:
    from diloco.config import LinkConfig

log = logging.getLogger("diloco.learner")



RECONNECT_S = 0.5
"""How long the learner waits before opening a broken or ended update stream again."""
CLOSE_BOUND_S = 60.0
"""How long `close()` keeps trying to hand its last pushes to a syncer that does not answer."""


@dataclass(frozen=True)
class LinkShape:
    """An emulated link: per direction, a bandwidth and a one-way latency."""

    bandwidth_mbit: float
    latency_ms: float


@dataclass(frozen=True)
class HomeLink:
    """Where one syncer shard runs (a region's name, for the report's per-home bytes) and the emulated link
    a learner's traffic with it crosses (None: the network as it is)."""

    home: str
    shape: LinkShape | None


class ShardWays:
    """One direction of a sender's traffic with the syncer's shards: a single shaped link all shards share
    (they run in one place), or one per shard (`placement = "links"` homes them in different regions). A
    message about one fragment takes its shard's way; one meant for every shard crosses each way once. The
    counters are the totals over the ways."""

    def __init__(self, links: Sequence[LinkShape | LinkConfig | None], per_shard: bool) -> None:
        self.ways = [ShapedDirection(link.bandwidth_mbit if link else None, link.latency_ms if link else 0.0)
                     for link in links]
        self.per_shard = per_shard

    def to(self, shard: int) -> ShapedDirection:
        return self.ways[shard] if self.per_shard else self.ways[0]

    def send_to_all(self, nbytes: int) -> float:
        """A message for every shard (a progress report): when it has arrived over the slowest way."""
        return max(way.send(nbytes) for way in self.ways)

    @property
    def bytes_sent(self) -> int:
        return sum(way.bytes_sent for way in self.ways)

    @property
    def messages(self) -> int:
        return sum(way.messages for way in self.ways)

    @property
    def peak_message_bytes(self) -> int:
        return max(way.peak_message_bytes for way in self.ways)


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameter names both ends agree on (DDP adds a `module.` prefix)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class Learner:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, syncer: str,
                 learner: int | None = None, link: LinkShape | None = None, connect_timeout_s: float = 30.0,
                 host: str = "", security: TransportSecurity | None = None, tokens_per_step: int | None = None,
                 homes: Sequence[HomeLink] | None = None, owners: Sequence[int] | None = None) -> None:
        """Join the run served at `syncer` (any shard's HOST:PORT) and load its current Θ into `model`.
        `learner` asks for an id (a restart keeps its own); by default the syncer picks one, or the one
        named by the learner's own credential (`security`, or $DILOCO_LEARNER_TOKEN). `tokens_per_step`:
        what one inner step trains on this rank (batch × sequence), declared to the syncer at join.
        `homes`: per shard, where it runs and the link to it, when the shards run in different regions
        (`placement = "links"`): each shard's traffic is shaped and counted on its own link, instead of
        all on `link` (give `owners` with it: their shard indices are the same). `owners`: per fragment,
        the shard the learner's config says owns it; a run whose shards say otherwise is refused (None:
        the shards' own map)."""
        self.model = model
        self.optimizer = optimizer
        self.module = _unwrap(model)
        self.params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        self.staging = DeviceStaging(next(iter(self.params.values())).device)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.link = link
        self.security = security
        self.homes = list(homes) if homes is not None else None
        links = [h.shape for h in self.homes] if self.homes is not None else [link]
        self.up, self.down = (ShardWays(links, per_shard=self.homes is not None) for _ in range(2))
        self.owners = owners
        self.tokens = self.steps = self.merges = 0
        self.busy_s = self.waiting_s = 0.0
        self._stop_requested = False
        self._error: BaseException | None = None
        self._closed = False
        self.core: LearnerCore | None = None
        self.shards: list[ShardLink] = []
        self.settings: pb.Settings | None = None
        self.id = -1
        self.declared_tokens_per_step = (tokens_per_step or 0) * self.world
        header = torch.zeros(2, dtype=torch.int64)
        if self.rank == 0:
            self._connect(syncer, learner, connect_timeout_s, host)
            header[0], header[1] = self.id, self.settings.fragments
        if self.world > 1:
            dist.broadcast(header, 0)
            for p in self.params.values():
                dist.broadcast(p.data, 0)
        self.id, fragment_count = int(header[0]), int(header[1])
        self.fragments = self.core.fragments if self.core else self._partition(fragment_count)
        self._inbox: DeliveryQueue[tuple[Update, Any]] = DeliveryQueue()
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._refused: queue.Queue[Push] = queue.Queue()
        self._wire: DeliveryQueue[Any] = DeliveryQueue()
        self._threads: list[threading.Thread] = []
        if self.rank == 0:
            self._start_threads()
        self.started = self._last_step_end = clock.monotonic()

    # ------------------------------------------------------------ joining

    def _partition(self, count: int) -> list[Fragment]:
        return partition(self.module, count, embedding_names(self.module))

    def _connect(self, address: str, learner: int | None, timeout_s: float, host: str) -> None:
        """Join every shard, seed or check Θ's layout, take Θ, and build this learner's core."""
        joined = join_run(address, learner, timeout_s, host, self.params,
                          self._partition, self.security, self.declared_tokens_per_step, self.owners)
        self.id, self.settings, self.shards = joined.learner, joined.settings, joined.shards
        with torch.no_grad():
            for name, value in joined.theta.items():
                self.params[name].copy_(value)
        self._first_seq = joined.last_seq  # numbers before it belong to this learner's earlier lives
        fragments = joined.fragments
        self.core = spec_of(self.settings).learner_core(
            self.id, self.params, fragments, versions=[joined.versions[p] for p in range(len(fragments))],
            first_seq=joined.last_seq, encode_later=True)
        self._shard_of = {p: shard for shard in self.shards for p in shard.fragments}
        self._received = dict(joined.versions)
        """Per fragment, the version of the last answer received whole: what a reopened stream claims."""
        log.info("learner %d joined %d shard(s); %d fragments", self.id, len(self.shards), len(fragments))

    # ------------------------------------------------------------ the training thread

    @property
    def should_stop(self) -> bool:
        """The run's shared token budget is spent (as the syncer counts it)."""
        return self._stop_requested

    def resume(self, step: int) -> None:
        """The user's loop restored its own checkpoint taken at inner step `step`: the fragment schedule
        continues from there. Call before the first `step()`."""
        if self.core is not None:
            self.core.resume_at(step)

    def request_stop(self) -> None:
        """Stop at the end of this step (e.g. on Ctrl-C); under torchrun, rank 0's request counts."""
        self._stop_requested = True

    def step(self, tokens: int) -> None:
        """One inner step is done (after optimizer.step()): push what is due, merge what has arrived.
        Waits only where the strategy is synchronous (DiLoCo), for the answer it needs."""
        if self._closed:
            raise DilocoError("Learner.step() after close()")
        if self._error is not None:
            raise DilocoError(f"learner {self.id}: syncing failed: {self._error}") from self._error
        now = clock.monotonic()
        self.busy_s += now - self._last_step_end
        step_time = now - self._last_step_end
        if self.world > 1:
            count = torch.tensor([tokens], dtype=torch.int64)
            dist.all_reduce(count)
            tokens = int(count)
        self.tokens += tokens
        self.steps += 1
        before = list(self.core.anchor_versions) if self.rank == 0 else []
        if self.rank == 0:
            core = self.core
            for push in core.on_step(tokens, step_time_s=step_time, now=clock.now()):
                self._send(push)
            self._merge_arrived(wait=True)
            self._outbox.put(("progress", core.progress()))  # behind this step's pushes, on the same link
        self._share_merges(before)
        self._last_step_end = clock.monotonic()

    def _share_merges(self, before: list[int]) -> None:
        """Every rank ends a step (or the run) with rank 0's parameters: the fragments whose anchor
        moved since `before` are broadcast, with rank 0's stop request. A collective: all ranks call it."""
        flags = torch.zeros(len(self.fragments) + 1, dtype=torch.int64)
        if self.rank == 0:
            for p, (old, new) in enumerate(zip(before, self.core.anchor_versions)):
                flags[p] = int(new != old)
            flags[-1] = int(self._stop_requested)
        if self.world > 1:
            dist.broadcast(flags, 0)
            with torch.no_grad():
                for p in flags[:-1].nonzero().flatten().tolist():
                    for name in self.fragments[p].names:
                        dist.broadcast(self.params[name].data, 0)
            self._stop_requested = bool(flags[-1])
        self.merges += int(flags[:-1].sum())

    def _merge_arrived(self, wait: bool) -> None:
        core = self.core
        while not self._refused.empty():
            core.on_refused(self._refused.get())
        while True:
            for update, ready in self._inbox.ready():
                self.staging.wait_in_training(ready)
                core.on_update(update)
            poll = core.poll(clock.now())
            for push in poll.pushes:
                self._send(push)
            if not (wait and poll.waiting_for) or self._stop_requested:
                return  # a learner told to stop does not wait for an answer it will not merge
            waited_from = clock.monotonic()
            arrived = self._inbox.get(timeout=1.0)
            self.waiting_s += clock.monotonic() - waited_from
            if arrived is not None:
                update, ready = arrived
                self.staging.wait_in_training(ready)
                core.on_update(update)
            if self._error is not None:
                raise DilocoError(f"learner {self.id}: syncing failed: {self._error}") from self._error

    def close(self, finished: bool = True) -> dict[str, Any]:
        """Push what no push has carried yet, leave, stop the threads; return this learner's report.
        `finished`: it trained its share of the run (False: it was interrupted and may come back)."""
        if self._closed:
            return self.report()
        self._closed = True
        self.wall_s = clock.monotonic() - self.started
        before = list(self.core.anchor_versions) if self.rank == 0 else []
        if self.rank == 0:
            for push in self.core.finish(clock.now()):  # may merge answers that have arrived
                self._send(push)
        self._share_merges(before)
        if self.rank == 0:
            self._outbox.put(("leave", finished))
            self._outbox.put(None)
            for thread in self._threads:
                if thread.name.startswith(("learner-encode", "learner-deliver")):
                    thread.join(timeout=CLOSE_BOUND_S)
                    if thread.is_alive():  # the syncer stayed away: what is left unsent is lost
                        log.warning("learner %d: syncer unreachable for %g s at close; giving up", self.id,
                                    CLOSE_BOUND_S)
                        self._give_up.set()
                        thread.join()
            self._halt.set()
            for shard in self.shards:
                shard.client.close()
            for thread in self._threads:
                thread.join(timeout=5)
        return self.report()

    def report(self) -> dict[str, Any]:
        wall = getattr(self, "wall_s", clock.monotonic() - self.started)
        core = self.core
        return {"learner": self.id, "rank": self.rank, "world": self.world, "tokens": self.tokens,
                "steps": self.steps, "busy_s": self.busy_s, "waiting_s": self.waiting_s, "wall_s": wall,
                "busy_fraction": self.busy_s / wall if wall else 1.0, "merges": self.merges,
                "pushes": core.seq - self._first_seq if core else 0, "stale_updates": core.stale_updates if core else 0,
                "merge_lag_steps": sum(core.merge_lags) / len(core.merge_lags) if core and core.merge_lags else None,
                "bytes_up": self.up.bytes_sent, "bytes_down": self.down.bytes_sent,
                "messages_up": self.up.messages, "messages_down": self.down.messages,
                "peak_message_bytes_up": self.up.peak_message_bytes, **self._bytes_by_home()}

    def _bytes_by_home(self) -> dict[str, Any]:
        """With shards in several regions, the bytes to and from each: what each of its links carried."""
        if self.homes is None:
            return {}
        return {"bytes_by_home": {h.home: {"bytes_up": self.up.to(i).bytes_sent,
                                           "bytes_down": self.down.to(i).bytes_sent}
                                  for i, h in enumerate(self.homes)}}

    # ------------------------------------------------------------ background threads

    def _start_threads(self) -> None:
        self._halt = threading.Event()
        self._give_up = threading.Event()
        targets = [("learner-encode", self._encode_loop), ("learner-deliver", self._deliver_loop),
                   ("learner-heartbeat", self._heartbeat_loop)]
        targets += [(f"learner-receive-{s.index}", lambda s=s: self._receive_loop(s)) for s in self.shards]
        for name, target in targets:
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _guard(self, target):
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # surfaced in the training thread at the next step
                if not self._halt.is_set():
                    log.exception("learner %d: %s failed", self.id, threading.current_thread().name)
                    self._error = exc
                    self._wire.close()
        return run

    def _send(self, push: Push) -> None:
        self._outbox.put(("push", (push, self.staging.hand_off(push.deltas.values()))))

    def _encode_loop(self) -> None:
        """Encode pushes in order (error feedback carries over) and put them on the link."""
        while (item := self._outbox.get()) is not None:
            kind, payload = item
            if kind == "leave":
                for shard in self.shards:
                    self._wire.put(self.up.to(shard.index).send(MESSAGE_HEADER_BYTES), ("leave", shard, payload, None))
                continue
            if kind == "progress":
                self._wire.put(self.up.send_to_all(payload.wire_bytes()), ("progress", None, payload, None))
                continue
            push, handed_off = payload
            with self.staging.side(handed_off):  # encoded on the device, then copied to the host
                encoded = self.core.encode(push.deltas)
            header = pb.PushHeader(learner=self.id, fragment=push.fragment, base_version=push.base_version,
                                   seq=push.seq, tokens=push.tokens, steps=push.steps,
                                   step_time_s=push.step_time_s, sent_at=push.sent_at or clock.now(),
                                   tensors=[tensor_header(n, e) for n, e in encoded.items()], step=push.step,
                                   final=push.final)
            nbytes = MESSAGE_HEADER_BYTES + sum(e.wire_bytes() for e in encoded.values())
            shard = self._shard_of[push.fragment]
            self._wire.put(self.up.to(shard.index).send(nbytes), ("push", shard, header, (encoded, push)))
        self._wire.close()

    def _deliver_loop(self) -> None:
        """Hand each message to its shard once the emulated link has carried it; retry while a shard is
        unavailable (the syncer counts a retried push once)."""
        while (item := self._wire.get()) is not None:
            kind, shard, header, encoded = item
            if kind == "progress":
                self._report(header)
                continue
            if kind == "leave":
                try:
                    with_retries(lambda: shard.client.leave(self.id, finished=header), what="leave")
                except SyncerUnavailable as exc:
                    log.warning("learner %d: could not announce leaving: %s", self.id, exc)
                continue
            # A shard that restarts comes back with everything it acknowledged: keep trying (the
            # learner trains on meanwhile); a push it took before it went down is counted once.
            tensors, push = encoded
            try:
                reply = with_retries(lambda: shard.client.push(header, tensors), attempts=None, what="push",
                                     give_up=self._give_up)
                if reply.clipped:
                    log.warning("learner %d: push of fragment %d was larger than the syncer's outlier bound and "
                                "merged scaled down to it", self.id, push.fragment)
            except SyncerUnavailable:
                raise
            except DilocoError as exc:  # refused with a reason (an outlier, a non-finite value)
                log.warning("learner %d: push of fragment %d refused: %s", self.id, push.fragment, exc)
                self._refused.put(push)

    def _report(self, progress: Progress) -> None:
        """Where this learner stands, to every shard (their predictions and the shared budget). A report
        that does not get through is not retried: the next one says more."""
        for shard in self.shards:
            try:
                reply = shard.client.heartbeat(self.id, progress.tokens, progress.step, progress.step_time_s,
                                               progress.due_in_s)
            except DilocoError as exc:
                log.debug("progress report to shard %d failed: %s", shard.index, exc)
                continue
            if reply.stop:
                self._stop_requested = True

    def _receive_loop(self, shard: ShardLink) -> None:
        """New versions from one shard: decoded here, handed over when the emulated link delivers them.
        A stream that ends or breaks is opened again (a learner without updates would train on alone);
        one the shard refuses is this learner's error."""
        while not self._halt.is_set():
            partial: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
            """Per fragment, an answer's differences applied so far (and their bytes), until its last."""
            holds = {p: self._received[p] for p in shard.fragments}
            try:
                for header, tensors in shard.client.updates(self.id, holds):
                    base, nbytes = partial.pop(header.fragment, (None, 0))
                    nbytes += MESSAGE_HEADER_BYTES + sum(e.wire_bytes() for e in tensors.values())
                    update, ready = self._decode_update(header, tensors, nbytes, base)
                    if header.continued:
                        partial[header.fragment] = (update.values, nbytes)
                        continue
                    self._received[header.fragment] = header.version
                    self._inbox.put(self.down.to(shard.index).send(nbytes), (update, ready))
                reason = "the update stream ended"
            except (SyncerUnavailable, ValueError) as exc:  # ValueError: a LostAnswer, or a bad frame
                reason = str(exc)
                shard.client.cancel_updates()
            if self._halt.wait(RECONNECT_S):
                return
            log.warning("learner %d: %s (shard %d); reconnecting", self.id, reason, shard.index)

    def _decode_update(self, header: pb.UpdateHeader, tensors: dict[str, Encoded], nbytes: int,
                       base: dict[str, torch.Tensor] | None = None) -> tuple[Update, torch.cuda.Event | None]:
        with self.staging.side():
            update = update_of(header, tensors, self.core.anchors[header.fragment], self._received[header.fragment],
                               nbytes, base, self.staging.to_device)
            ready = self.staging.done()
        return update, ready

    def _heartbeat_loop(self) -> None:
        while not self._halt.wait(HEARTBEAT_S):
            for shard in self.shards:
                try:
                    reply = shard.client.heartbeat(self.id, self.tokens, self.steps)
                except DilocoError as exc:
                    log.debug("heartbeat to shard %d failed: %s", shard.index, exc)
                    continue
                if reply.stop:
                    self._stop_requested = True

