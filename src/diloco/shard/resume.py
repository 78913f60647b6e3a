"""A shard resuming from disk: its saved state, checked (saved by this shard of this run, with a Θ that
fits the layout and is finite; each refusal is one line naming the file), then its journal replayed
through the core."""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

import torch

from diloco.core.checks import theta_problem
from diloco.core.events import SyncerResumed
from diloco.core.refusals import ProtocolError
from diloco.errors import DilocoError
from diloco.shard.journal import JournalCorrupt
from diloco.shard.ownership import ShardPlan, fragments_of
from diloco.shard.store import update_of
from diloco.v1 import diloco_pb2 as pb

if TYPE_CHECKING:
    from diloco.shard.shard_view import ShardView

log = logging.getLogger("diloco.syncer")


def shard_identity(plan: ShardPlan, owned: list[int], settings: pb.Settings) -> dict:
    """What a saved state must match to be resumed here: this shard, its fragments, the run's settings."""
    encoded = settings.SerializeToString(deterministic=True)
    return {"shard": plan.index, "shards": plan.count, "fragments": list(owned),
            "settings": torch.frombuffer(bytearray(encoded), dtype=torch.uint8) if encoded
            else torch.empty(0, dtype=torch.uint8)}


def check_identity(state: dict, mine: dict, where: str) -> None:
    """Refuse a state saved by another shard, shard count or config."""
    identity = state.get("identity")
    if not isinstance(identity, dict):
        raise DilocoError(f"{where} does not say which shard saved it: it cannot be resumed here")
    for key in ("shard", "shards", "fragments"):
        if identity.get(key) != mine[key]:
            raise DilocoError(f"{where} was saved by a shard with {key} {identity.get(key)!r}, but this one has "
                              f"{mine[key]!r}: resume with the --shard and config of the run that saved it")
    saved, current = pb.Settings(), pb.Settings()
    current.ParseFromString(bytes(mine["settings"].numpy()))
    try:
        saved.ParseFromString(bytes(identity["settings"].numpy()))
    except Exception:  # noqa: BLE001 — anything unparsable is a foreign file
        raise DilocoError(f"{where} holds settings that cannot be read: it cannot be resumed here") from None
    differing = [f.name for f in pb.Settings.DESCRIPTOR.fields if getattr(saved, f.name) != getattr(current, f.name)]
    if differing:
        raise DilocoError(f"{where} was saved by a run with other settings ({', '.join(differing)} differ): "
                          f"resume with the config of the run that saved it")


def check_theta(state: dict, layout: list[pb.FragmentLayout], where: str) -> None:
    """Refuse a Θ that cannot be this shard's: tensors missing or of other shapes than the layout says,
    values that are not finite, what the learners hold not fitting it."""
    theta = state["core"]["theta"]
    shapes = {t.name: list(t.shape) for f in layout for t in f.tensors}
    if not isinstance(theta, dict) or set(theta) != set(shapes):
        raise DilocoError(f"{where}: Θ holds other tensors than its layout names")
    for name, value in theta.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or list(value.shape) != shapes[name]:
            raise DilocoError(f"{where}: Θ tensor {name!r} is not a float tensor of shape {shapes[name]}")
    problem = theta_problem(theta)  # the same bound as a seeded Θ: a rewritten file is no way around it
    if problem:
        raise DilocoError(f"{where}: Θ {problem}: refusing to resume from it")
    for p, fragment in state["core"]["fragments"].items():
        for name, value in fragment["downlink"]["published"].items():
            if name not in shapes or not isinstance(value, torch.Tensor) or list(value.shape) != shapes[name]:
                raise DilocoError(f"{where}: what the learners hold of {name!r} (fragment {p}) does not fit Θ")


def resume(shard: ShardView) -> None:
    """Load the saved state (checked: `shard_resume.py`), replay the journal after it,
    and go on journaling where it ended. A journaled event the core refuses on replay means the state is not
    the one it was journaled on (a one-line error), except the last record: a crash between
    writing it and taking it back (the core refused it live too) leaves exactly that, so it is
    dropped with a warning.

    Nothing is saved here: the saved state and the journal, which goes on after the replayed records, are
    already where the shard is, and every second before it serves is a second its learners train apart.
    The shard's next periodic save (`shard_state.SAVE_MIN_S` to `SAVE_EVERY_S` from its start) folds them
    together."""
    began = time.perf_counter()
    state = shard.store.load()
    if state is None:
        return
    loaded = time.perf_counter()
    where = f"the saved state of shard {shard.plan.index} {shard.store.state_path}"
    try:
        check_identity(state, shard_identity(shard.plan, shard.owned, shard.settings), where)
        shard.layout = [pb.FragmentLayout.FromString(bytes(t.numpy())) for t in state["layout"]]
        fragments, embeddings = fragments_of(shard.plan, shard.owned, shard.layout)
        check_theta(state, shard.layout, where)
        shard.core = shard._make_core(state["core"]["theta"], fragments, embeddings)
        shard.core.load_state_dict(state["core"])
        shard.joined, shard.left = set(state["joined"]), set(state["left"])
        shard.finished = bool(state["finished"])
        shard.stop_said = shard.core.stopped  # a Stop carried out before the state was saved
        shard.last_updates = {m: {p: update_of(plain) for p, plain in by_fragment.items()}
                             for m, by_fragment in state["last_updates"].items()}
    except DilocoError as exc:
        shard.core = None
        if str(exc).startswith(where):
            raise
        raise DilocoError(f"{where} cannot be resumed here: {exc}") from None
    except Exception as exc:  # noqa: BLE001 — missing keys, wrong types: not a state this version saved
        shard.core = None
        raise DilocoError(f"{where} does not hold a state this shard can take ({type(exc).__name__}: {exc}): "
                          f"restore a good copy, or start the run afresh in another --out") from None
    last_seq, replayed = state["journal_seq"], 0
    checked = time.perf_counter()
    journaled = shard.store.journaled_after(last_seq)
    read = time.perf_counter()
    shard._replaying = True
    try:
        for index, (record, event, now) in enumerate(journaled):
            try:
                shard.apply(event, now)
            except ProtocolError as exc:
                if index < len(journaled) - 1:
                    raise JournalCorrupt(f"journal {shard.store.journal_path}: record {record.seq} at byte "
                                         f"{record.offset} ({record.kind}) is refused on replay ({exc}) though "
                                         f"it was taken once: the saved state is not the one it was journaled "
                                         f"on") from None
                log.warning("journal %s: its last record (%d, %s) is refused on replay (%s): the shard died "
                            "before taking it back; dropped", shard.store.journal_path, record.seq, record.kind, exc)
                shard.store.drop_from(record)
                break
            last_seq = record.seq
            replayed += 1
    finally:
        shard._replaying = False
    shard.store.open(last_seq)
    shard.round_meter.seen = len(shard.core.rounds)  # the process that closed them recorded them
    replayed_at = time.perf_counter()
    shard.outboxes = {}  # only the latest answer per fragment goes out again, not every replayed one
    for m, by_fragment in shard.last_updates.items():
        if m not in shard.left:
            outbox = shard.outboxes[m] = queue.Queue()
            for update in by_fragment.values():
                outbox.put(update)
    # Nobody could reach a shard that was down: every learner gets its usual allowance from now.
    shard.apply(SyncerResumed(), shard.clock.now())
    done = time.perf_counter()
    parts = {"load_s": loaded - began, "check_s": checked - loaded, "read_s": read - checked,
             "replay_s": replayed_at - read}
    shard.metrics.record("resume", shard=shard.plan.index, resume_s=done - began, events=replayed, **parts)
    log.info("shard %d resumed: %d rounds, versions %s, %d journaled events replayed (%.2f s: state loaded %.2f, "
             "checked %.2f, journal read %.2f, replayed %.2f)", shard.plan.index, shard.core.rounds_closed,
             {p: s.version for p, s in shard.core.fragments.items()}, replayed, done - began, *parts.values())
