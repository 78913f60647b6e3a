"""Joining a run: every shard, the layout of Θ (seeded by the first learner, checked by the others),
and Θ itself, every fragment's pull at once (one stream per fragment, on every shard: a join takes about
the wire's time for Θ, not a fragment's time times the fragments). A learner refused on the way leaves
every shard it joined."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.shard.ownership import check_shard_map
from diloco.transport.calls import ShardClient, with_retries
from diloco.transport.security import TransportSecurity
from diloco.transport.wire_messages import fragment_layout
from diloco.v1 import diloco_pb2 as pb


@dataclass
class ShardLink:
    index: int
    client: ShardClient
    fragments: list[int]


@dataclass
class Joined:
    learner: int
    settings: pb.Settings
    shards: list[ShardLink]
    fragments: list[Fragment]
    theta: dict[str, torch.Tensor]
    versions: dict[int, int]
    last_seq: int
    """The learner's last push numbered in its earlier lives: its next pushes are numbered above."""
    last_seqs: dict[int, int]
    """Per fragment, the last push of this learner of that fragment its shard took (`fragment_seqs`)."""
    push_at: dict[int, float] = field(default_factory=dict)
    """Per fragment its shard named a time for: when (wall clock) to push it first, on the syncer's grid."""
    pull_s: float = 0.0
    """Seconds the pull of Θ took, every fragment from every shard."""


PULL_STREAMS = 8
"""Fragments pulled at once, over all shards: enough streams to fill the wire, each one fragment's memory.
A learner that takes Θ fragment by fragment (`take`: a sharded learner, which scatters each to its ranks)
pulls at most the largest fragment's bytes at once instead (`PullBudget`): its rank 0 must not hold what
8 fragments decode to while it scatters one. That costs it the streams' overlap (measured in
docs/runtime.md, "Learners larger than one device"); an unsharded learner holds the whole model anyway."""
Take = Callable[[int, dict[str, torch.Tensor]], None]


class PullBudget:
    """Bytes of Θ pulled and not yet taken, bounded: a pull waits until those in flight leave room for it
    (one pull may always go). `close` lets every waiting pull go, telling it not to pull."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.used, self.closed = limit, 0, False
        self._changed = threading.Condition()

    def acquire(self, nbytes: int) -> bool:
        with self._changed:
            while not self.closed and self.limit is not None and self.used and self.used + nbytes > self.limit:
                self._changed.wait()
            self.used += nbytes
            return not self.closed

    def release(self, nbytes: int) -> None:
        with self._changed:
            self.used -= nbytes
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()


def join_run(address: str, learner: int | None, timeout_s: float, host: str, params: dict[str, torch.Tensor],
             partition: Callable[[int], list[Fragment]], security: TransportSecurity | None,
             tokens_per_step: int = 0, owners: Sequence[int] | None = None, take: Take | None = None,
             track: Callable[[torch.Tensor], None] | None = None, give_up: threading.Event | None = None) -> Joined:
    """Join every shard as `learner` (None: the syncer picks, or the one the learner's own credential
    names), declaring `tokens_per_step` (0: not known). Every call after the first join carries the
    joined learner's own credential: the shards bind learner calls to it. `owners`: per fragment, the
    shard this learner's config says owns it (`shard_plan.fragment_owners`); every shard's map must say
    the same (None: the first shard's map, which every other shard's must match). `take`: each fragment's
    Θ is handed to take(fragment, values) on this thread as it arrives (in any order), instead of being
    collected in `Joined.theta` (a sharded learner spreads it over its ranks: no rank holds Θ whole), and
    at most the largest fragment's bytes are pulled at once; `track` is shown each pulled tensor (a sharded
    learner counts what rank 0 holds, `row_moves.HeldBytes`). `give_up`: once set (the learner was told to
    stop), waiting for a shard ends in one line instead of lasting up to `timeout_s`."""
    joined: list[tuple[ShardClient, int]] = []
    try:
        return _join_all(address, learner, timeout_s, host, params, partition, security, joined, tokens_per_step,
                         owners, take, track, give_up)
    except DilocoError:
        for client, me in joined:  # a refused learner must not stay counted as alive
            try:
                client.leave(me)
            except DilocoError:
                pass
            client.close()
        raise


def _join_all(address: str, learner: int | None, timeout_s: float, host: str, params: dict[str, torch.Tensor],
              partition: Callable[[int], list[Fragment]], security: TransportSecurity | None,
              joined: list[tuple[ShardClient, int]], tokens_per_step: int, owners: Sequence[int] | None,
              take: Take | None, track: Callable[[torch.Tensor], None] | None,
              give_up: threading.Event | None) -> Joined:
    first = ShardClient(address, security)
    first.wait_ready(timeout_s, give_up)
    reply = with_retries(lambda: first.join(learner, host, tokens_per_step), what="join", give_up=give_up)
    me, settings = reply.learner, reply.settings
    joined.append((first, me))
    fragments = partition(settings.fragments)
    replies = {reply.shard: (first, reply)}
    expected = ({i: [p for p, owner in enumerate(owners) if owner == i] for i in sorted(set(owners))}
                if owners is not None else {int(info.index): sorted(info.fragments) for info in reply.shards})
    check_shard_map(reply.shards, expected, address)  # before joining any other shard
    for info in reply.shards:
        if info.index in replies:
            continue
        client = ShardClient(info.address, security)
        client.wait_ready(timeout_s, give_up)
        replies[info.index] = (client, with_retries(lambda c=client: c.join(me, host, tokens_per_step),
                                                    what="join", give_up=give_up))
        joined.append((client, me))
    last_seq, last_seqs, shards = 0, {}, []
    for index, (client, shard_reply) in sorted(replies.items()):
        check_shard_map(shard_reply.shards, expected, client.address)
        owned = expected[index]
        if shard_reply.layout:
            _check_layout(list(shard_reply.layout), [fragments[p] for p in owned], params, client.address)
        else:
            layout = [fragment_layout(fragments[p], params) for p in owned]
            # Taken (`.detach()`: a sharded learner's rank 0 gathers it) one tensor at a time as Init's
            # frames are made, never all at once. A shard that dies mid-Init restarts unseeded: seeding it
            # again (or finding it seeded by another learner meanwhile, which the pull's layout check
            # covers) is always safe.
            values = {n: params[n] for p in owned for n in fragments[p].names}
            with_retries(lambda c=client, v=values, lay=layout: c.init(lay, v), what="init")
        last_seq = max(last_seq, shard_reply.last_seq)
        last_seqs.update(fragment_seqs(shard_reply, owned, client.address))
        shards.append(ShardLink(index, client, owned))
    theta: dict[str, torch.Tensor] = {}
    versions: dict[int, int] = {}
    push_at: dict[int, float] = {}
    started = time.monotonic()
    budget = PullBudget(max(f.numel for f in fragments) * 4 if take is not None else None)
    for p, values, fragment_versions, fragment_push_at in pull_theta(shards, me, last_seq, fragments, params, budget,
                                                                     track):
        versions.update(fragment_versions)
        push_at.update(fragment_push_at)
        if take is not None:
            take(p, values)
        else:
            theta.update(values)
        del values  # let go before the next fragment's pull: the budget is released as the loop asks for it
    return Joined(me, settings, shards, fragments, theta, versions, last_seq, last_seqs, push_at,
                  pull_s=time.monotonic() - started)


def fragment_seqs(reply: pb.JoinReply, owned: list[int], address: str) -> dict[int, int]:
    """Per fragment the shard owns, the newest push of this learner of it that the shard counted; an older
    shard that does not say (`fragment_last_seq` empty) stands by its last push for each. A claim for a
    fragment the shard does not own, or above the shard's own last push, is refused in one line."""
    claimed = dict(reply.fragment_last_seq)
    if not claimed:
        return {p: reply.last_seq for p in owned}
    wrong = sorted(set(claimed) - set(owned))
    if wrong:
        raise DilocoError(f"the shard at {address} claims pushes of fragments {wrong[:4]}, which it does not own "
                          f"(it owns {owned[:8]}): its state is not this run's")
    high = next((p for p in sorted(claimed) if claimed[p] > reply.last_seq), None)
    if high is not None:
        raise DilocoError(f"the shard at {address} claims push {claimed[high]} of fragment {high}, above the last "
                          f"push of this learner it counted ({reply.last_seq}): its state is not this run's")
    return {p: claimed.get(p, reply.last_seq) for p in owned}


def pull_theta(shards: list[ShardLink], me: int, last_seq: int, fragments: list[Fragment],
               params: dict[str, torch.Tensor], budget: PullBudget | None = None,
               track: Callable[[torch.Tensor], None] | None = None):
    """(fragment, values, versions, first push times) of every fragment of every shard, as each arrives: pull threads feed a
    queue, the caller's thread takes from it. Each fragment is its own pull (a broken transfer resumes
    with the fragments still missing), with retries; the first failure ends the join. A fragment's bytes
    count against `budget` from before its pull until the caller asks for the next one."""
    arrived: queue.Queue = queue.Queue()
    budget = budget or PullBudget(None)

    def pull(shard: ShardLink, p: int) -> None:
        if not budget.acquire(fragments[p].numel * 4):
            return  # the join ended while this pull waited for room
        try:
            pulled = with_retries(lambda: shard.client.pull(me, after_seq=last_seq, fragments=[p]), what="pull")
            for value in pulled.values.values() if track is not None else ():
                track(value)
            # Checked again: another learner may have seeded Θ between our join and our pull.
            _check_layout(pulled.layout, [fragments[p]], params, shard.client.address)
            arrived.put((p, pulled.values, pulled.versions, pulled.push_at))
            del pulled
        except BaseException as exc:  # noqa: BLE001 — raised again on the caller's thread
            budget.release(fragments[p].numel * 4)
            arrived.put(exc)

    work = [(shard, p) for shard in shards for p in shard.fragments]
    pool = ThreadPoolExecutor(max_workers=max(1, min(PULL_STREAMS, len(work))), thread_name_prefix="pull")
    try:
        for shard, p in work:
            pool.submit(pull, shard, p)
        for _ in work:
            item = arrived.get()
            if isinstance(item, BaseException):
                raise item
            p = item[0]
            yield item
            item = None  # the caller is done with this fragment: nothing here holds it while the next arrives
            budget.release(fragments[p].numel * 4)
    finally:
        budget.close()
        pool.shutdown(wait=True, cancel_futures=True)


def _check_layout(layout: list[pb.FragmentLayout], fragments: list[Fragment], params: dict[str, torch.Tensor],
                  address: str) -> None:
    """The syncer's fragments must be this model's, tensor for tensor."""
    theirs = {f.index: [(t.name, tuple(t.shape)) for t in f.tensors] for f in layout}
    for fragment in fragments:
        ours = [(n, tuple(params[n].shape)) for n in fragment.names]
        if theirs.get(fragment.index) != ours:
            got = theirs.get(fragment.index, [])
            diff = next(((a, b) for a, b in zip(ours, got) if a != b), (ours[len(got):][:1], got[len(ours):][:1]))
            raise DilocoError(f"this model does not match the run at {address}: fragment {fragment.index} differs "
                              f"(here {diff[0]}, there {diff[1]}); every learner must train the same model")
