"""How a replicated learner's ranks end a step: with one rank there is nothing to agree on, so no flags
tensor is built (issue 30), and the step ends with the same stop request and merge count as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diloco.client import rank_sync
from diloco.client.rank_sync import ReplicatedRanks


def _ranks(world: int, versions: list[int]) -> ReplicatedRanks:
    ranks = ReplicatedRanks({"w": torch.zeros(2)}, rank=0, world=world)
    ranks.core = SimpleNamespace(anchor_versions=list(versions))
    ranks.fragments = [SimpleNamespace(names=["w"]) for _ in versions]
    return ranks


@pytest.mark.parametrize("stop", [False, True])
@pytest.mark.parametrize("error", [None, "rank 0 failed"])
def test_one_rank_ends_a_step_without_a_flags_tensor(monkeypatch: pytest.MonkeyPatch, stop: bool,
                                                     error: str | None) -> None:
    ranks = _ranks(1, [3, 5, 7])
    ranks.open_step()
    ranks.core.anchor_versions = [4, 5, 9]  # fragments 0 and 2 merged this step

    def no_flags(kind: int) -> torch.Tensor:
        raise AssertionError("a one-rank learner built a flags tensor")

    monkeypatch.setattr(ranks, "_flags", no_flags)
    assert ranks.close_step(stop, error) == (stop, 2)


def test_one_rank_agrees_with_the_flags_it_used_to_share() -> None:
    """The answer without flags is the one the flags gave (`_share` of a world of one sends nothing)."""
    for versions_after, stop in (([3, 5], False), ([4, 6], True), ([3, 6], True)):
        ranks = _ranks(1, [3, 5])
        ranks.open_step()
        ranks.core.anchor_versions = versions_after
        flags = ranks._flags(rank_sync.END)
        for p, (old, new) in enumerate(zip([3, 5], versions_after)):
            flags[p] = int(new != old)
        flags[-2] = int(stop)
        assert ranks.close_step(stop) == ranks._share(flags)
