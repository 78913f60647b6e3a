"""Which fragments a syncer shard owns, and the layout of their tensors a learner brings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.errors import DilocoError
from diloco.fragments import Fragment
from diloco.transport.frames import FrameError


@dataclass(frozen=True)
class ShardPlan:
    index: int
    count: int
    addresses: tuple[str, ...]
    """Every shard's address, by index: the map learners get when they join."""

    def owns(self, fragment: int) -> bool:
        return fragment % self.count == self.index

    def fragments(self, total: int) -> list[int]:
        return [p for p in range(total) if self.owns(p)]


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
