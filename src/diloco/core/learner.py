"""The learner's side of outer synchronisation, as a sans-I/O state machine.

The driver runs inner steps and reports each one (`on_step`), hands over updates that arrive
(`on_update`) and asks what to do next between steps (`poll`). The core decides which fragments are
due, computes their outer gradients Δ = anchor − θ, merges answers τ steps after sending with
θ ← α·θ + (1 − α)·Θ̃, and re-anchors on exactly the values received.

Token and step counters for a fragment restart when it is *sent*, not when its answer is merged: the
τ steps taken in between belong to the next push of that fragment, so each token is reported once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.core.messages import Push, Update
from diloco.fragments import Fragment, Schedule


@dataclass
class InFlight:
    base_version: int
    merge_at_step: int
    update: Update | None = None


@dataclass(frozen=True)
class Poll:
    """What the driver should do now: send `pushes`, then wait, stop, or take the next step."""

    pushes: list[Push] = field(default_factory=list)
    waiting_for: tuple[int, ...] = ()
    """Fragments whose answer the learner must merge before its next step (synchronous strategies)."""
    done: bool = False


class LearnerCore:
    def __init__(self, learner: int, params: dict[str, torch.Tensor], fragments: list[Fragment],
                 schedule: Schedule, *, tau: int, alpha: float, wait_for_updates: bool) -> None:
        self.learner = learner
        self.params = params
        self.fragments = fragments
        self.schedule = schedule
        self.tau, self.alpha, self.wait_for_updates = tau, alpha, wait_for_updates
        self.step = 0
        self.seq = 0
        self.anchors = [{n: params[n].detach().to(torch.float32).clone() for n in f.names} for f in fragments]
        self.anchor_versions = [0] * len(fragments)
        self.tokens_since = [0] * len(fragments)
        self.steps_since = [0] * len(fragments)
        self.in_flight: dict[int, InFlight] = {}
        self.finishing = False
        self.drained = False

    # ------------------------------------------------------------ events

    def on_step(self, tokens: int) -> list[Push]:
        """One inner step is done: count it, and push every fragment that is now due."""
        if self.finishing:
            raise RuntimeError(f"learner {self.learner} reported a step after finish()")
        self.step += 1
        for p in range(len(self.fragments)):
            self.tokens_since[p] += tokens
            self.steps_since[p] += 1
        return [self._push(p) for p in self.schedule.due(self.step)]

    def on_update(self, update: Update) -> None:
        flight = self.in_flight.get(update.fragment)
        if flight is None or flight.update is not None:
            raise RuntimeError(f"learner {self.learner} got an unexpected update of fragment {update.fragment}")
        flight.update = update

    def finish(self) -> None:
        """No more inner steps: merge what is in flight, then push whatever progress is left."""
        self.finishing = True

    def poll(self) -> Poll:
        """Merge every answer whose time has come; say whether the next step may start."""
        for p, flight in sorted(self.in_flight.items()):
            due = self.finishing or self.step >= flight.merge_at_step
            if flight.update is not None and due:
                self._merge(p, flight.update)
                del self.in_flight[p]
        if self.finishing:
            if self.in_flight:
                return Poll(waiting_for=tuple(sorted(self.in_flight)))
            if self.drained:
                return Poll(done=True)
            self.drained = True
            pushes = [self._push(p) for p in range(len(self.fragments)) if self.steps_since[p] > 0]
            return Poll(pushes=pushes, done=True)
        if self.wait_for_updates:
            blocking = tuple(p for p, f in sorted(self.in_flight.items()) if self.step >= f.merge_at_step)
            if blocking:
                return Poll(waiting_for=blocking)
        return Poll()

    # ------------------------------------------------------------ tensor work

    @torch.no_grad()
    def _push(self, p: int) -> Push:
        if p in self.in_flight:
            raise RuntimeError(f"learner {self.learner}: fragment {p} is due again before its answer was merged")
        anchor = self.anchors[p]
        deltas = {n: anchor[n] - self.params[n].detach().to(torch.float32) for n in self.fragments[p].names}
        self.seq += 1
        push = Push(self.learner, p, self.anchor_versions[p], self.seq, deltas,
                    self.tokens_since[p], self.steps_since[p])
        self.in_flight[p] = InFlight(self.anchor_versions[p], merge_at_step=self.step + self.tau)
        self.tokens_since[p] = self.steps_since[p] = 0
        return push

    @torch.no_grad()
    def _merge(self, p: int, update: Update) -> None:
        for name in self.fragments[p].names:
            value = update.values[name]
            param = self.params[name]
            if self.alpha == 0.0:
                param.copy_(value)
            else:
                param.mul_(self.alpha).add_(value.to(param.dtype), alpha=1.0 - self.alpha)
            self.anchors[p][name] = value.to(torch.float32).clone()
        self.anchor_versions[p] = update.version
