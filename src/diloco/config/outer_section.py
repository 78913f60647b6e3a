"""`[outer]`: the outer loop: sync schedule, outer optimizer, quorum and grace window, merge, outlier filter;
and the strategy that reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.rules import require

Strategy = Literal["ddp", "diloco", "streaming", "async", "async-dn", "decoupled"]


@dataclass
class OuterConfig:
    H: int = 50
    """Inner steps between two syncs of the same fragment."""
    fragments: int = 4
    tau: int = 2
    """Inner steps a learner keeps training between sending a fragment and merging the answer."""
    alpha: float = 0.25
    """Mixing: θ ← α·θ + (1 − α)·Θ̃ when merging; 0 overwrites (streaming and decoupled; DiLoCo
    always overwrites)."""
    lr: float = 0.7
    momentum: float = 0.9
    quorum: int = 1
    """Minimum learners K in a round of a fragment (decoupled); 0 means all learners alive."""
    grace: float = 1.0
    """γ: how long a round may wait for more learners after its quorum, as a share of its slack (with
    pacing: of half a sync period; without: of τ steps less the measured trip); 0 turns waiting off."""
    grace_cap_steps: float = 25.0
    """Upper bound of that wait, in the fastest learner's step times (a bound, not the mechanism)."""
    pacing: bool = True
    """Decoupled: the syncer predicts each learner's next push from its progress, holds rounds for the
    learners about to land, and tells each when to push next so that rounds gather everyone."""
    keep_progress: bool = False
    """Decoupled: a merge keeps what the learner trained since sending, θ ← Θ̃ + (θ − θ_sent)."""
    stale_weight: Literal["full", "inverse"] = "full"
    """Decoupled: how a push based on an older version weighs in its round: as any other (`full`), or
    divided by 1 + the versions it is behind (`inverse`)."""
    consolidate: bool = True
    """Decoupled: the run's last round of each fragment sets Θ to the learners' weighted mean."""
    reproducible: bool = False
    """Decoupled: a run whose result does not depend on timing, to compare one build or kind of learner
    with another (a sharded learner with a DDP one, say): every round waits for every learner alive
    (quorum all, no pacing), a learner waits at τ for its answer, and each trains its equal share of the
    budget. The stragglers then set everyone's pace: a check, not a way to train."""
    merge: Literal["mean", "weighted", "rda"] = "rda"
    """How the decoupled syncer merges a round (DiLoCo and Streaming DiLoCo use the mean)."""
    dn_buffer: int = 0
    """Delayed Nesterov: arrivals per momentum update; 0 means the number of learners."""
    outlier: Literal["off", "clip", "reject"] = "clip"
    """A push larger than the fragment's own scale allows (a multiple of its norm, checked from the
    first push) is refused unless this is `off`; one larger than outlier_factor x the learners' median
    push size (core/outliers.py) is clipped to that bound (`clip`) or refused (`reject`). `clip` by
    default: an honest push can be large (a learner restarted from its own checkpoint), and a refused
    one comes back larger each time, so its learner would never be merged again; a clipped one moves Θ
    by at most the bound. In the default runs no honest push came within 1.7x of the bound."""
    outlier_factor: float = 5.0


def check_outer(o: OuterConfig, strategy: Strategy, learners: int) -> None:
    """The outer loop: sync schedule, outer optimizer, quorum and grace window, outlier filter.

    Fragments must fit in H only for the strategies that stagger them over the H steps.
    """
    require(o.fragments <= o.H or strategy not in ("streaming", "decoupled"), "outer.fragments",
            f"must be at most outer.H ({o.H}) so that fragments sync on distinct steps", o.fragments)
    require(0 <= o.tau < o.H, "outer.tau", f"must be in [0, outer.H) = [0, {o.H})", o.tau)
    require(0 <= o.alpha <= 1, "outer.alpha", "must be in [0, 1]", o.alpha)
    require(o.lr > 0, "outer.lr", "must be positive", o.lr)
    require(0 <= o.momentum < 1, "outer.momentum", "must be in [0, 1)", o.momentum)
    require(0 <= o.quorum <= learners, "outer.quorum", f"must be in [0, learners.count] = [0, {learners}]", o.quorum)
    require(o.grace >= 0, "outer.grace", "must be zero or positive (0 turns the grace window off)", o.grace)
    require(o.grace_cap_steps >= 0, "outer.grace_cap_steps", "must be zero or positive", o.grace_cap_steps)
    require(o.dn_buffer >= 0, "outer.dn_buffer", "must be zero or positive", o.dn_buffer)
    require(o.outlier_factor > 1, "outer.outlier_factor", "must be above 1", o.outlier_factor)
    require(not o.reproducible or strategy == "decoupled", "outer.reproducible",
            f"applies to strategy = decoupled only (strategy {strategy} does not depend on timing, or is "
            f"asynchronous by design)", o.reproducible)
