"""What makes a syncer shard a region's syncer in the real runtime (`diloco syncer --region NAME
--upstream ADDR`): the same `SyncerShard` serves the region's learners, with a `RegionalSyncer`
(`core/regional.py`) deciding in place of the plain core, and an `Uplink` to the global shards.

The region's first learner seeds it as it would seed any syncer; the regional syncer then joins the
global syncer with those values (seeding it if nobody has), takes the global Θ and starts from it, so
every learner of every region starts from the same Θ. A regional syncer keeps no journal: if it dies, it
loses what it merged and had not sent up yet (as in a regional outage) and starts again from the global
Θ. What went up in earlier lives is kept in a small ledger file, so that the run's accounting still
counts it as merged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from diloco.config import Config, LinkConfig, Topology
from diloco.core.events import PushArrived, SyncerEvent
from diloco.core.messages import Push, Update
from diloco.core.regional import RegionalSyncer, Upstream
from diloco.core.refusals import ProtocolError, RoundRefused
from diloco.core.syncer_core import SyncerCore
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.outputs import write_output
from diloco.shard.ownership import fragment_owners
from diloco.client.uplink import HomeRoute, Uplink, UplinkHandlers
from diloco.transport.security import TransportSecurity

if TYPE_CHECKING:
    from diloco.shard.shard_view import ShardView

log = logging.getLogger("diloco.region")


class RegionTier:
    def __init__(self, config: Config, name: str, upstream: str, security: TransportSecurity | None, *,
                 emulate_link: bool = False, out: Path | None = None) -> None:
        names = [r.name for r in Topology(config).tier_regions()]
        if not Topology(config).tiered:
            raise DilocoError("--region needs topology = \"regional\" and [[regions]] in the config")
        if name not in names:
            raise DilocoError(f"--region {name!r} is not a region with learners ({', '.join(names)})")
        self.config, self.name, self.index = config, name, names.index(name)
        up, down = self._wan_link(None, emulate_link)
        owners = fragment_owners(config)
        homes = None if owners is None else [HomeRoute(home, *self._wan_link(home, emulate_link))
                                             for home in Topology(config).homes(len(owners))]
        self.uplink = Uplink(upstream, self.index, security, up=up, down=down, homes=homes, owners=owners)
        self.region: RegionalSyncer | None = None
        self.ledger_path = out / "syncer" / f"region-{name}.ledger.json" if out is not None else None
        self.banked = self._load_banked()
        """Per learner and fragment, tokens (on time, stale) earlier lives sent up."""

    def _wan_link(self, home: str | None, emulate: bool) -> tuple[LinkConfig | None, LinkConfig | None]:
        """The region's WAN link to the shards in region `home` (None: the syncer's), each way, to emulate
        (none from that region itself, or without emulation)."""
        hops = Topology(self.config).region_route(self.name, home)
        return (hops[0].up, hops[0].down) if hops and emulate else (None, None)

    def _load_banked(self) -> dict[int, dict[int, list[int]]]:
        if self.ledger_path is None or not self.ledger_path.is_file():
            return {}
        try:
            plain = json.loads(self.ledger_path.read_text())
            return {int(m): {int(p): [int(t[0]), int(t[1])] for p, t in by_fragment.items()}
                    for m, by_fragment in plain.items()}
        except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise DilocoError(f"the region's ledger {self.ledger_path} is unreadable ({exc}): move it away to "
                              f"start the region's accounting afresh") from None

    # ------------------------------------------------------------ seeding

    def seed(self, shard: ShardView, values: dict[str, torch.Tensor], fragments: list[Fragment],
             embeddings: set[str]) -> SyncerCore:
        """The region's first learner brought `values`: join the global syncer with them and start from the
        global Θ. Called under the shard's lock."""
        tokens_per_step = max(shard.declared.values(), default=self.config.train.batch_size * self.config.train.seq_len)
        joined = self.uplink.join(values, fragments, tokens_per_step)
        self.region = shard.spec.regional_syncer(
            self.index, joined.theta, [joined.versions[p] for p in range(len(fragments))], fragments,
            Topology(self.config).learners_of(self.name), embeddings=embeddings, settings=self.config.regional,
            period=Topology(self.config).region_period(self.name), first_seq=joined.last_seq, encode_later=True)
        core = self.region.down
        core.liveness.start(shard.clock.now())
        core.answers_when_taken = True
        self.shard = shard
        self.uplink.start(UplinkHandlers(answer=self._answer, stop=self._stop, refused=self._refused,
                                         encode=self.region.up.encode, anchors=lambda p: self.region.up.anchors[p],
                                         beat=self._beat))
        log.info("region %s (%d) joined the global syncer at %s: Θ from its versions %s", self.name, self.index,
                 self.uplink.address, dict(joined.versions))
        return core

    # ------------------------------------------------------------ what comes back (uplink threads)

    def _answer(self, update: Update) -> None:
        self._under_lock(lambda: self.region.on_upstream(update, self.shard.clock.now()), "the global answer")

    def _stop(self) -> None:
        self._under_lock(self.region.on_stop, "the word to stop")

    def _refused(self, push: Push) -> None:
        self._under_lock(lambda: self.region.on_refused(push), "a refused push")

    def _beat(self) -> list[SyncerEvent]:
        with self.shard.lock:
            return [a.event for a in self.region.beat(self.shard.clock.now())]

    def _under_lock(self, act, what: str) -> None:
        with self.shard.lock:
            try:
                self.shard.carry_out(act())
            except (ProtocolError, RoundRefused) as exc:
                log.warning("region %s: %s changed nothing: %s", self.name, what, exc)

    # ------------------------------------------------------------ what goes up, and the accounting

    def sent(self, action: Upstream) -> None:
        """An event is on its way up; a push's tokens are now the global syncer's to merge: kept on disk."""
        self.uplink.send(action.event)
        if isinstance(action.event, PushArrived) and self.ledger_path is not None:
            write_output(self.ledger_path, json.dumps(self.sent_up()) + "\n", durable=True)

    def sent_up(self) -> dict[int, dict[int, list[int]]]:
        """Per learner and fragment, tokens (on time, stale) sent up in every life."""
        total = {m: {p: list(t) for p, t in by_fragment.items()} for m, by_fragment in self.banked.items()}
        for m, by_fragment in (self.region.sent_total if self.region is not None else {}).items():
            for p, (on_time, stale) in by_fragment.items():
                kept = total.setdefault(m, {}).setdefault(p, [0, 0])
                kept[0], kept[1] = kept[0] + on_time, kept[1] + stale
        return total

    def report(self, ledger: dict[int, dict]) -> dict:
        """The region's part of its shard's report: the earlier lives' tokens added to the ledger, and the
        uplink's bytes (the region's WAN traffic)."""
        for m, by_fragment in self.banked.items():
            entry = ledger.setdefault(m, {"pushes": 0, "duplicates": 0, "last_seq": 0, "steps_merged": 0,
                                          "merged": {}, "stale": {}})
            for p, (on_time, stale) in by_fragment.items():
                entry["merged"][p] = entry["merged"].get(p, 0) + on_time
                entry["stale"][p] = entry["stale"].get(p, 0) + stale
        return {"region": self.name, "region_index": self.index, "uplink": self.uplink.report(),
                "left_upstream": self.region is not None and self.region.left}

    def close(self) -> None:
        self.uplink.close()
