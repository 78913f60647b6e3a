"""What a syncer shard tells about itself: the report runs' summaries are made of, and the snapshot the
status page shows. Read-only views of the shard (`syncer.py`); callers hold its lock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco.config import Topology
from diloco.core.accounting import by_parameters
from diloco.core.syncer_core import RoundRecord

if TYPE_CHECKING:
    from diloco.config import Config
    from diloco.shard.shard_view import ShardView

SILENT_AFTER_S = 5.0
"""A learner not heard from (heartbeats, pushes) for this long shows as silent on the status page."""


def shard_report(shard: ShardView) -> dict:
    """What this shard counted, for run summaries and reports."""
    core = shard.core
    out = {"shard": shard.plan.index, "shards": shard.plan.count, "fragments": shard.owned,
           "finished": shard.finished, "push_errors": shard.push_errors, "tokens_reported": {},
           "answers_sent": shard.answers_sent, "answer_bytes_sent": shard.answer_bytes_sent,
           "joined": sorted(shard.joined), "left": sorted(shard.left), "told_to_stop": shard.stop_said}
    if shard.bulk is not None:
        out["bulk"] = {"sent": shard.bulk.served, "received": shard.bulk.received, "refused": shard.bulk.refused}
    if core is None:
        return out
    out["tokens_reported"] = {m: core.tokens_reported(m) for m in core.tokens.keys() | core.tokens_banked.keys()}
    out["fragment_numel"] = {p: s.fragment.numel for p, s in core.fragments.items()}
    out["memory"] = core.memory()
    out["versions"] = {p: s.version for p, s in core.fragments.items()}
    out["ledger"] = {m: {"pushes": e.pushes, "duplicates": e.duplicates, "last_seq": e.last_seq,
                         "steps_merged": e.steps_merged, "merged": dict(e.merged), "stale": dict(e.stale),
                         "claims_clipped": core.claims.of(m, core.claims.clock).clipped}
                     for m, e in core.ledger.items()}
    out["rounds"] = [round_view(shard, r) for r in core.rounds]
    if shard.tier is not None:
        out.update(shard.tier.report(out["ledger"]))
    return out


def round_view(shard: ShardView, r: RoundRecord) -> dict:
    """One round for reports and the status page, on the shard's own time axis."""
    return {"fragment": r.fragment, "version": r.version, "opened_at": r.opened_at - shard.started,
            "closed_at": r.closed_at - shard.started, "participants": list(r.participants),
            "stale": r.stale, "staleness": list(r.staleness), "held_s": r.held_s, "final": r.final}


def learner_state(shard: ShardView, m: int, now: float) -> str:
    core = shard.core
    heard = core.liveness.heard.get(m) if core is not None else None
    if m in shard.left:
        return "left"
    if core is not None and m in core.lost:
        return "lost"
    if m not in shard.joined:
        return "not joined"
    if heard is not None and now - heard > SILENT_AFTER_S:
        return "silent"
    return "training"


def snapshot(shard: ShardView) -> dict:
    """Membership, each learner's state, the recent rounds and the regions, for the status page."""
    core, now = shard.core, shard.clock.now()
    numel = {p: s.fragment.numel for p, s in core.fragments.items()} if core else {}
    learners = {}
    for m in sorted(set(range(shard.settings.learners)) | shard.joined):
        entry = core.ledger.get(m) if core else None
        heard = core.liveness.heard.get(m) if core else None
        learners[str(m)] = {
            "name": f"learner {m}", "host": shard.hosts.get(m, ""), "state": learner_state(shard, m, now),
            "tokens": core.tokens_reported(m) if core else 0, "steps": shard.steps.get(m, 0),
            "pushes": entry.pushes if entry else 0, "duplicates": entry.duplicates if entry else 0,
            "tokens_merged": learner_share(entry.merged, numel) if entry else 0,
            "tokens_stale": learner_share(entry.stale, numel) if entry else 0,
            "last_seen_s": now - heard if heard is not None else None,
            "held_versions": {str(p): v for p, v in core.held_versions.get(m, {}).items()} if core else {}}
    rounds = [round_view(shard, r) for r in (core.rounds[-200:] if core else [])]
    return {"shard": shard.plan.index, "shards": shard.plan.count, "strategy": shard.spec.name,
            "uptime_s": now - shard.started, "finished": shard.finished, "fragments": shard.owned,
            "versions": {str(p): s.version for p, s in core.fragments.items()} if core else {},
            "learners": learners, "rounds": rounds, "regions": snapshot_regions(shard)}


def learner_share(per_fragment: dict[int, int], numel: dict[int, int]) -> int:
    """A learner's tokens counted per fragment, in the unit of the tokens it trained: each of this shard's
    fragments weighted by its share of their parameters (`by_parameters`, as the run summary does), not
    summed over fragments, which would count every trained token once per fragment."""
    parameters = sum(numel.values())
    owned = {p: tokens for p, tokens in per_fragment.items() if p in numel}
    return round(by_parameters(owned, numel, parameters)) if parameters else 0


def snapshot_regions(shard: ShardView) -> list[dict]:
    """The regions the status page groups the shard's learners by: every region on a flat run's syncer,
    its own on a region's syncer; none on the regional tier's global syncer, whose members are the
    regions' syncers, not learners."""
    if Topology(shard.config).tiered and shard.tier is None:
        return []
    own = shard.tier.name if shard.tier is not None else None
    return region_groups(shard.config, only=own)


def region_groups(config: Config, only: str | None = None) -> list[dict]:
    """Per region (in config order, or just the one named `only`): its name, whether it holds the syncer,
    and its learners' ids. Empty without regions."""
    return [{"name": r.name, "syncer": r.syncer, "learners": list(Topology(config).learners_of(r.name))}
            for r in config.regions if only in (None, r.name)]
