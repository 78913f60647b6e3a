"""Data-parallel in the simulator: gradients averaged over every learner each step, timed as a ring
all-reduce over the slowest link."""

from __future__ import annotations

import torch

from diloco.sim.learners import SimLearner
from diloco.sim.sim_events import AllReduceDone
from diloco.sim.sim_state import SimState


def all_reduce(learners: list[SimLearner]) -> float:
    """Average the learners' gradients in place; return how long the all-reduce takes, and count its
    bytes on every link."""
    count = len(learners)
    grad_bytes = 0
    with torch.no_grad():
        for params in zip(*(lr.replica.model.parameters() for lr in learners)):
            if params[0].grad is None:
                continue
            mean = torch.stack([p.grad for p in params]).mean(dim=0)
            for p in params:
                p.grad.copy_(mean)
            grad_bytes += mean.numel() * mean.element_size()
    if count < 2:
        return 0.0
    share = 2 * (count - 1) * grad_bytes // count
    bandwidth = min(min(lr.link.up.bandwidth_bps, lr.link.down.bandwidth_bps) for lr in learners)
    latency = max(lr.link.up.latency_s for lr in learners)
    for learner in learners:
        learner.link.up.record(share)
        learner.link.down.record(share)
    return 2 * (count - 1) * (latency + grad_bytes / count * 8 / bandwidth)


class DataParallelSteps(SimState):
    def _on_allreduce_done(self, _: AllReduceDone) -> None:
        self._gradients_in.clear()
        self.last_event_s = max(self.last_event_s, self.now)
        for learner in self.learners:
            if not learner.alive:
                continue  # it crashed after handing in its gradients; it takes a peer's state when back
            learner.resume(self.now)
            learner.replica.apply_gradients()
            self._meter(learner)
            if learner.replica.steps < learner.last_step:
                self._start_step(learner)
            else:
                learner.finished = True
        self._count_tokens(sum(lr.replica.sampler.batch_size * lr.replica.sampler.seq_len for lr in self.learners))
