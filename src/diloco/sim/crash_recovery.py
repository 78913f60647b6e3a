"""Crashes and recovery in the simulator: a process dies with its step in progress and unpushed
progress, comes back after its recovery time, and rejoins from Θ and its own checkpoint: its optimizer,
data position and step (`core/recovery.py`) and its own unpushed progress (`core/own_progress.py`), as
the real learner does."""

from __future__ import annotations

import copy

import torch

from diloco.core.events import LearnerRejoined, StreamLost
from diloco.core.own_progress import export_progress, resume_progress
from diloco.core.recovery import restore_plan
from diloco.sim.learners import Checkpoint, SimLearner
from diloco.sim.sim_events import Crash, Recover, StateArrives
from diloco.sim.sim_state import SimState
from diloco.training import make_optimizer


class CrashRecovery(SimState):
    def _schedule_random_crash(self, learner: SimLearner) -> None:
        at = self.crash_plan.next_random(learner.index, self.now)
        if at is not None:
            self.queue.schedule(at, Crash(learner.index))

    def _save_checkpoint(self, learner: SimLearner) -> None:
        r = learner.replica
        own = export_progress(learner.core) if learner.core is not None else None
        learner.checkpoint = Checkpoint(copy.deepcopy(r.optimizer.state_dict()), r.sampler.state_dict(), r.steps, own)

    def _on_crash(self, event: Crash) -> None:
        """The process dies: its step in progress and its unpushed progress are gone. The syncer finds
        out as it would for real: its connection ends (`StreamLost`, one trip later), as a killed process's
        does. One already down when its region goes down is back no earlier than the region."""
        learner = self.learners[event.learner]
        if learner.finished:
            return
        back_at = self.now + self.config.failures.recovery_s if event.until is None else event.until
        if not learner.alive:
            if event.until is not None and back_at > learner.back_at:
                learner.incarnation += 1  # its recovery under way is void
                self._recover_at(learner, back_at)
            return
        learner.abort_step(self.now)
        learner.resume(self.now)
        learner.alive = False
        learner.down_since = self.now
        learner.crashes += 1
        if learner.core is not None:
            for p, tokens in enumerate(learner.core.unpushed_tokens()):
                learner.lost_tokens[p] += tokens
            learner.core = None
        self._gradients_in.pop(learner.index, None)
        if self.syncer is not None:
            self.queue.schedule(learner.link.up.signal(self.now),
                                self._to_syncer(learner, StreamLost(learner.index), life=learner.rejoins))
        self._recover_at(learner, back_at)

    def _recover_at(self, learner: SimLearner, at: float) -> None:
        learner.back_at = at
        self.queue.schedule(at, Recover(learner.index, learner.incarnation))

    def _on_recover(self, event: Recover) -> None:
        """The learner's process is back: it asks for the current Θ, which takes a full download."""
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.finished:
            return
        if self.syncer is None:  # data-parallel: take the parameters of a live peer
            arrival = learner.link.down.send(self.now, self.parameters * 4)
            self.queue.schedule(arrival, StateArrives(learner.index, learner.incarnation, None))
            return
        self._rejoin(learner)

    def _rejoin(self, learner: SimLearner) -> None:
        """It asks its syncer for the current Θ (its region's, with the regional tier: once that is back)."""
        home = self._home(learner)
        learner.rejoins += 1
        event = LearnerRejoined(learner.index, after_seq=learner.last_seq)
        if home is None:
            self._handle(self.syncer.handle(event, self.now))
        elif home.syncer is None:
            home.waiting.append(learner.index)
        else:
            self._handle(home.syncer.handle(event, self.now), home)

    def _on_state(self, event: StateArrives) -> None:
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.finished:
            return
        if event.state is None:
            self._take_peer_state(learner)
        else:
            self._restart_from(learner, *event.state)
        self._mark_down_until_now(learner)
        learner.alive = True
        home = self._home(learner)
        syncer = self.syncer if home is None else home.syncer.down if home.syncer is not None else None
        if syncer is not None and syncer.stopped:  # the run ended while it was down
            self._finish(learner)
            return
        self._schedule_random_crash(learner)
        self._start_step(learner)
        self._schedule_beat(learner)

    def _take_peer_state(self, learner: SimLearner) -> None:
        """Data-parallel: the job's state is that of the replica furthest along (a live one if any): all
        took the same steps, so it is what a checkpoint taken at its last step would hold."""
        r = learner.replica
        peer = max(self.learners, key=lambda lr: (lr.replica.steps, lr.alive))
        if peer is not learner:
            r.model.load_state_dict(peer.replica.model.state_dict())
            r.optimizer.load_state_dict(copy.deepcopy(peer.replica.optimizer.state_dict()))
            r.steps = peer.replica.steps
        r.model.zero_grad(set_to_none=True)

    def _restart_from(self, learner: SimLearner, theta: dict[str, torch.Tensor], versions: list[int],
                      push_at: dict[int, float]) -> None:
        """Θ as the syncer sent it, and its first pushes on the syncer's grid; what else comes from its own
        checkpoint is `core/recovery.py`'s call."""
        r = learner.replica
        with torch.no_grad():
            for name, p in r.named_params().items():
                p.copy_(theta[name])
        r.optimizer = make_optimizer(r.model, r.cfg)
        ckpt = learner.checkpoint
        plan = restore_plan(self.config.failures.restore, ckpt is not None)
        if plan.optimizer:
            r.optimizer.load_state_dict(copy.deepcopy(ckpt.optimizer))
        if plan.data:
            r.sampler.load_state_dict(ckpt.data)
        if plan.steps:
            r.steps = ckpt.steps
        learner.core = self._learner_core(learner, versions=versions, step=r.steps)
        learner.core.push_at(push_at)
        self._resume_own_progress(learner)

    def _resume_own_progress(self, learner: SimLearner) -> None:
        """Its checkpoint's unpushed progress back on top of Θ where `core/own_progress.usable` allows, as a
        real learner does at its join; what it resumes was not lost. The shard has taken (or will: the link
        delivers it) every push the learner sent, so a push in flight at the checkpoint is never carried again."""
        own = learner.checkpoint.own if learner.checkpoint is not None else None
        outcome = resume_progress(learner.core, own, learner.sent_seqs, self.config.failures.resume)
        for p, why in outcome.items():
            if why is None:
                learner.lost_tokens[p] -= own["fragments"][p]["tokens"]

    def _mark_down_until_now(self, learner: SimLearner) -> None:
        if learner.down_since is not None:
            learner.down_s += self.now - learner.down_since
            learner.down_since = None
