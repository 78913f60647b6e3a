"""Which fragments a syncer shard owns, and the layout of their tensors a learner brings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.config import Config, Topology
from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.transport.frames import FrameError
from diloco.v1 import diloco_pb2 as pb


@dataclass(frozen=True)
class ShardPlan:
    index: int
    count: int
    addresses: tuple[str, ...]
    """Every shard's address, by index: the map learners get when they join."""
    owners: tuple[int, ...] | None = None
    """Per fragment, the shard that owns it (`placement = "links"`: shard i homes the fragments of the
    config's i-th home region); None: fragment p is shard p mod count's."""

    def owner(self, fragment: int) -> int:
        return self.owners[fragment] if self.owners is not None else fragment % self.count

    def owns(self, fragment: int) -> bool:
        return self.owner(fragment) == self.index

    def fragments(self, total: int) -> list[int]:
        return self.owned_by(self.index, total)

    def owned_by(self, shard: int, total: int) -> list[int]:
        """The fragments shard `shard` owns: what a learner's shard map says of it."""
        return [p for p in range(total) if self.owner(p) == shard]


def fragment_owners(config: Config) -> tuple[int, ...] | None:
    """Per fragment, the index of its home shard when `placement = "links"` spreads the homes over the
    regions (shard i runs for `Topology(config).homes(F)[i]`); None otherwise (the modulo rule, any shard count).
    Every shard and learner derives it from the config alone, so all agree without asking."""
    if config.placement != "links":
        return None
    from diloco.strategies import build_strategy

    count = build_strategy(config).fragments
    homes = Topology(config).homes(count)
    return tuple(homes.index(home) for home in Topology(config).fragment_homes(count))


def placed_shard_count(config: Config, asked: int) -> int:
    """How many global shards the run has: `asked`, or with `placement = "links"` one per home region
    (`asked` may then be left at 1 or match it)."""
    owners = fragment_owners(config)
    if owners is None:
        return asked
    homes = max(owners) + 1
    if asked not in (1, homes):
        raise DilocoError(f'placement = "links" runs one syncer shard per home region ({homes}), not {asked}: '
                          f"drop --shards")
    return homes


def global_shard_plan(config: Config, index: int, count: int, addresses: tuple[str, ...]) -> ShardPlan:
    """Shard `index` of the run's `count` global shards, owning what the config's placement gives it."""
    owners = fragment_owners(config)
    if owners is not None and count != max(owners) + 1:
        raise DilocoError(f'placement = "links" homes fragments in {max(owners) + 1} regions '
                          f"({', '.join(Topology(config).homes(len(owners)))}): run that many shards, not {count}")
    return ShardPlan(index, count, addresses, owners)


def check_shard_map(reported: Sequence[pb.ShardInfo], expected: dict[int, list[int]], address: str) -> None:
    """A learner's check of the shard map a shard sent at join (`ShardInfo`s) against its own: shards that
    disagree with it on who owns what would each miss pushes the others got."""
    theirs = {int(info.index): sorted(info.fragments) for info in reported}
    if theirs != expected:
        raise DilocoError(f"the shard map from {address} ({shard_map_text(theirs)}) disagrees with this learner's "
                          f"({shard_map_text(expected)}): every shard and learner must run the same config "
                          f"(placement, outer.fragments)")


def shard_map_text(owned: dict[int, list[int]]) -> str:
    return "; ".join(f"shard {i}: fragments {owned[i]}" for i in sorted(owned))


def parse_shard(text: str) -> tuple[int, int]:
    """`i/N` → (i, N), with a one-line error for anything else."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise DilocoError(f"--shard expects i/N such as 0/2, got {text!r}") from None
    if not (count >= 1 and 0 <= index < count):
        raise DilocoError(f"--shard {text}: need 0 <= i < N")
    return index, count


def fragments_of(plan: ShardPlan, owned: list[int], layout, tensors: dict | None = None
                 ) -> tuple[list[Fragment], set[str]]:
    """The fragments a layout describes, checked against this shard (and against the values, at Init)."""
    indices = sorted(f.index for f in layout)
    if indices != owned:
        raise FrameError(f"layout has fragments {indices}; shard {plan.index}/{plan.count} owns {owned}")
    fragments, embeddings, names = [], set(), set()
    for f in sorted(layout, key=lambda f: f.index):
        specs = list(f.tensors)
        for t in specs:
            if t.name in names:
                raise FrameError(f"tensor {t.name!r} is in two fragments")
            names.add(t.name)
            got = tensors.get(t.name) if tensors is not None else None
            if tensors is not None and (got is None or got.codec != "fp32" or list(got.shape) != list(t.shape)):
                raise FrameError(f"tensor {t.name!r}: values missing or not fp32 of shape {list(t.shape)}")
            if t.embedding:
                embeddings.add(t.name)
        numel = sum(int(torch.Size(t.shape).numel()) for t in specs)
        fragments.append(Fragment(f.index, tuple(t.name for t in specs), numel,
                                  bool(specs) and all(t.embedding for t in specs)))
    if tensors is not None and names != set(tensors):
        raise FrameError(f"values for tensors outside the layout: {sorted(set(tensors) - names)[:3]}")
    return fragments, embeddings
