"""How the Ray launcher judges its children's ends, without a cluster: a learner taken away with its node
is a loss the run survives; anything else that ends badly ends the run, with the child's log."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Iterable

import pytest

pytest.importorskip("ray")
from diloco.cluster.host import LOST  # noqa: E402
from diloco.cluster.ray_launcher import RayLauncher  # noqa: E402
from diloco.errors import DilocoError  # noqa: E402


class RemoteChild:
    """A child whose code is asked of its node on every look, so that two looks can disagree."""

    def __init__(self, name: str, codes: Iterable[int | None]) -> None:
        self.name, self.codes, self.log_path = name, iter(codes), Path("child.log")

    @property
    def returncode(self) -> int | None:
        return next(self.codes)

    def log_tail(self) -> str:
        return "its last line"


def launcher_with(*children: RemoteChild, expected_down: set[str] | None = None, seen: bool = True) -> RayLauncher:
    """`seen`: `_tend` has already looked at the children's ends (and restarted or replaced what it could)."""
    launcher = RayLauncher.__new__(RayLauncher)  # no cluster: only the judgement is under test
    launcher.children = SimpleNamespace(children={c.name: c for c in children})
    launcher.expected_down = expected_down or set()
    launcher.handled = {id(c) for c in children} if seen else set()
    return launcher


def test_a_learner_whose_node_goes_between_two_looks_is_a_loss_not_a_failure() -> None:
    launcher_with(RemoteChild("learner-1", [None, LOST])).\
        _check_children()  # the first look saw it running: nothing to judge yet
    launcher_with(RemoteChild("learner-1", [LOST, None])).\
        _check_children()  # lost: `_tend` replaces it, the run goes on


def test_a_learner_that_fails_or_a_shard_that_is_lost_ends_the_run_with_its_log() -> None:
    with pytest.raises(DilocoError, match="(?s)learner-1 exited with code 3.*its last line"):
        launcher_with(RemoteChild("learner-1", [3, 3]))._check_children()
    with pytest.raises(DilocoError, match=f"syncer-0 exited with code {LOST}"):
        launcher_with(RemoteChild("syncer-0", [LOST, LOST]))._check_children()
    launcher_with(RemoteChild("syncer-0", [LOST]), expected_down={"syncer-0"})._check_children()  # restarting


def test_a_shard_lost_after_tend_looked_is_left_to_tend_not_ended_on() -> None:
    launcher_with(RemoteChild("syncer-0", [LOST]), seen=False)._check_children()  # `_tend` restarts it next turn
