"""What the simulated driver's parts share: the run's state, and who a learner's syncer is.

`Simulation` (`driver.py`) is composed of one part per concept (learner steps, the syncer shell, the
regional tier, crashes and recovery, data-parallel); each part reads and writes this state.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from diloco.config import Config
from diloco.core.learner_core import LearnerCore
from diloco.core.syncer_core import SyncerCore
from diloco.data.shards import Batch
from diloco.fragments import Fragment
from diloco.metrics.log import MetricsLog
from diloco.metrics.records import LearnerMeter, RoundMeter
from diloco.network.links import Network
from diloco.sim.failures import CrashPlan
from diloco.sim.learners import SimLearner
from diloco.sim.sim_events import ToSyncer
from diloco.sim.tier import SimRegion
from diloco.strategies import StrategySpec
from diloco.virtual_run.event_queue import EventQueue
from diloco.virtual_run.push_order import InOrder

ProgressCallback = Callable[[int, int], None]
"""Called with (tokens trained so far, token budget) as the run goes."""


class SimState:
    config: Config
    spec: StrategySpec
    metrics: MetricsLog
    meters: list[LearnerMeter]
    round_meter: RoundMeter
    queue: EventQueue
    network: Network
    crash_plan: CrashPlan
    learners: list[SimLearner]
    syncer: SyncerCore | None
    """The global syncer's core (None: data-parallel)."""
    regions: list[SimRegion]
    """With the regional tier, the regions with learners: their syncers are the global syncer's learners."""
    fragments: list[Fragment]
    home_of: list[str]
    """Per fragment, the region of its home shard (`placement`): its pushes and answers go there."""
    parameters: int
    tokens_trained: int
    last_event_s: float
    _gradients_in: dict[int, float]
    _in_order: InOrder
    """The global core takes each sender's pushes in the order they were numbered (see `InOrder`)."""
    _embeddings: set[str]
    eval_model: nn.Module
    """Θ is loaded into it to be evaluated."""
    eval_batches: list[Batch]
    eval_curve: list[dict[str, float]]
    host_started: float
    """When `run` began, on the host's clock."""

    @property
    def now(self) -> float:
        return self.queue.now

    def _home(self, learner: SimLearner) -> SimRegion | None:
        """The region whose syncer is the learner's (None: the global syncer is)."""
        return next((r for r in self.regions if learner.index in r.members), None)

    def _to_syncer(self, learner: SimLearner, event, life: int | None = None) -> ToSyncer:
        home = self._home(learner)
        return ToSyncer(event, life=life) if home is None else ToSyncer(event, home.index, home.incarnation, life)

    def _learner_core(self, learner: SimLearner, versions: list[int] | None, step: int) -> LearnerCore:
        return self.spec.learner_core(learner.index, learner.replica.named_params(), self.fragments,
                                      versions=versions, step=step, first_seq=learner.last_seq)

    def ledger_of(self, learner: int) -> tuple[dict[int, int], dict[int, int]]:
        """Per fragment, a learner's tokens merged on time and merged stale: by the global syncer, or with the
        regional tier by its region's syncer over every life, less what died there before going up."""
        home = self._home(self.learners[learner])
        if home is not None:
            merged, stale = home.ledger(learner, len(self.fragments))
            return dict(enumerate(merged)), dict(enumerate(stale))
        entry = self.syncer.ledger[learner]
        return ({p: entry.merged[p] for p in range(len(self.fragments))},
                {p: entry.stale[p] for p in range(len(self.fragments))})

    def rounds_of(self, learner: int) -> list:
        """The rounds a learner could take part in: its syncer's."""
        home = self._home(self.learners[learner])
        return self.syncer.rounds if home is None else home.rounds()

    def token_ledger(self, learner: int) -> dict[str, list[int]]:
        """Per fragment: tokens merged on time, merged stale, and lost, for one learner."""
        merged, stale = self.ledger_of(learner)
        fragments = range(len(self.fragments))
        return {"merged": [merged[p] for p in fragments], "stale": [stale[p] for p in fragments],
                "lost": list(self.learners[learner].lost_tokens)}
