"""Decoupled DiLoCo: learners never wait; the syncer merges whatever has arrived, a fragment at a time.

P fragments on staggered offsets (as Streaming DiLoCo), answers merged τ steps after sending with α,
a minimum quorum K per round, token-weighted merging and radial-directional averaging (`outer.merge`).

Rounds gather the learners that are about to arrive (`outer.pacing`): the syncer predicts each
learner's next push from its progress reports, holds a round open for those predicted within its bound
(γ = `outer.grace` of half a sync period), and tells each participant when to push next so that the
next round lands together. The period is in time, H steps of the fastest learner: a learner at speed v
pushes every H·v/v_max of its own steps (its first pushes follow the configured speeds; the syncer
corrects them from measured ones). A merge keeps what the learner trained since sending
(`outer.keep_progress`), and the run ends on the learners' average (`outer.consolidate`).

With `outer.reproducible`, nothing is left to timing: rounds wait for every learner, pushes follow the
step schedule, learners wait at τ for their answers and train equal shares, and the syncer sums each
round's pushes in learner order, not as they came (slower, and it holds a round's pushes; for comparisons).

Each round's step is scaled by the share of the learners it heard from, and the Nesterov momentum moves
once those shares add up to a full round (delayed Nesterov, generalised to partial rounds): with every
learner in every round it is plain Nesterov.
"""

from dataclasses import replace

from diloco.config import Config
from diloco.strategies.spec import StrategySpec


def build(config: Config) -> StrategySpec:
    o = config.outer
    speeds = config.speeds()
    periods = tuple(max(1, round(o.H * v / max(speeds))) for v in speeds) if o.pacing else ()
    spec = StrategySpec(name="decoupled", exchange="outer", H=o.H, learner_H=periods, fragments=o.fragments,
                        tau=o.tau, alpha=o.alpha, outer_lr=o.lr, outer_momentum=o.momentum,
                        optimizer="delayed-nesterov", dn_buffer=0, merge_rule=o.merge, quorum=o.quorum or None,
                        grace=o.grace, grace_cap_steps=o.grace_cap_steps, participation=True,
                        pacing=o.pacing, consolidate=o.consolidate, keep_progress=o.keep_progress,
                        stale_weight=o.stale_weight,
                        wait_for_updates=False, shared_budget=True)
    if o.reproducible:
        spec = replace(spec, learner_H=(), quorum=None, grace=0.0, grace_cap_steps=0.0, pacing=False,
                       wait_for_updates=True, shared_budget=False, in_learner_order=True)
    return spec
