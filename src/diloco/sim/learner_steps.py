"""The simulated learners' side: steps in virtual time, heartbeats, progress reports, pushes, and the end
of a learner's run, as a real learner does them (`client/learner_client.py`)."""

from __future__ import annotations

from diloco.core.events import HeartbeatArrived, LearnerLeft, ProgressArrived, PushArrived
from diloco.core.learner_events import (Advance, Finished, LearnerAction, SendProgress, SendPush, StepDone,
                                        UpdateArrived, WaitFor)
from diloco.core.liveness import HEARTBEAT_S
from diloco.core.messages import MESSAGE_HEADER_BYTES, Progress, Push
from diloco.sim.data_parallel import all_reduce
from diloco.sim.learners import SimLearner
from diloco.sim.sim_events import AllReduceDone, Beat, StepEnds, StopArrives, UpdateArrives
from diloco.sim.sim_state import SimState


class LearnerSteps(SimState):
    def _start_step(self, learner: SimLearner) -> None:
        duration = learner.timer.next()
        learner.busy_s += duration
        learner.step_ends_at = self.now + duration
        self.queue.schedule(learner.step_ends_at, StepEnds(learner.index, learner.incarnation))

    def _schedule_beat(self, learner: SimLearner) -> None:
        if self.syncer is not None:
            self.queue.schedule(self.now + HEARTBEAT_S, Beat(learner.index, learner.incarnation))

    def _on_beat(self, event: Beat) -> None:
        """A learner alive says so every HEARTBEAT_S, training or waiting, until it has left."""
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.gone:
            return
        report = learner.core.progress()
        beat = HeartbeatArrived(learner.index, step=report.step, tokens=report.tokens)
        self.queue.schedule(learner.link.up.signal(self.now), self._to_syncer(learner, beat))
        self._schedule_beat(learner)

    def _on_step_end(self, event: StepEnds) -> None:
        m = event.learner
        learner = self.learners[m]
        if event.incarnation != learner.incarnation:
            return  # the step was cut short by a crash or by the end of the run
        learner.step_ends_at = None
        self.last_event_s = max(self.last_event_s, self.now)
        if self.spec.exchange == "gradients":
            learner.tokens += learner.replica.compute_gradients()
            self._gradients_in[m] = self.now
            learner.wait(self.now)
            if len(self._gradients_in) == len(self.learners):
                duration = all_reduce(self.learners)
                self.queue.schedule(max(self._gradients_in.values()) + duration, AllReduceDone())
            return
        tokens = learner.replica.train_step()
        learner.tokens += tokens
        # The step sequence every learner follows (`LearnerCore.handle`), as `Learner.step` does for real.
        pushes = learner.core.handle(StepDone(tokens, learner.timer.last_s), self.now)
        self._meter(learner)
        self._carry_out(learner, pushes)
        if self.crash_plan.any and learner.replica.steps % self.config.failures.checkpoint_every == 0:
            self._save_checkpoint(learner)
        self._count_tokens(tokens)
        last = learner.stop_requested or learner.replica.steps >= learner.last_step
        self._carry_out(learner, learner.core.handle(Advance(last=last), self.now))
        if last:
            self._finish(learner)

    def _carry_out(self, learner: SimLearner, actions: list[LearnerAction]) -> None:
        """What the learner's core asks, in order: pushes and reports on the link, wait or step on."""
        for action in actions:
            if isinstance(action, SendPush):
                self._send_push(learner, action.push)
            elif isinstance(action, SendProgress):
                self._send_progress(learner, action.progress)
            elif isinstance(action, WaitFor):
                if not learner.finished:  # a closing learner's wait is not training's: not in `waiting_s`
                    learner.wait(self.now)
            else:
                learner.resume(self.now)
                self._start_step(learner)

    def _send_progress(self, learner: SimLearner, report: Progress) -> None:
        """Every step, as the paper's learners do: where it stands, for the syncer's predictions and budget."""
        arrival = learner.link.up.send(self.now, report.wire_bytes())
        self.queue.schedule(arrival, self._to_syncer(learner, ProgressArrived(report)))

    def _on_stop(self, event: StopArrives) -> None:
        """The syncer's word that the budget is spent reached a learner: it stops after this step."""
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.finished or not learner.alive:
            return
        learner.stop_requested = True
        if learner.waiting_since is not None:  # waiting for an answer: no step to finish first
            self._finish(learner)

    def _finish(self, learner: SimLearner) -> None:
        """The learner trains no more: push what it has not pushed yet (a learner that waits for its answers
        takes its last ones first: `_on_update` goes on), then leave the syncer."""
        learner.finished = True
        learner.resume(self.now)
        if learner.core is not None and learner.alive:
            self._carry_out(learner, learner.core.handle(Finished(wait=not learner.stop_requested), self.now))
            if learner.closing:
                return
        self._leave(learner)

    def _leave(self, learner: SimLearner) -> None:
        learner.resume(self.now)
        if self.syncer is not None:
            # Announced on the same link, so it lands after the last pushes.
            arrival = learner.link.up.send(self.now, MESSAGE_HEADER_BYTES)
            self.queue.schedule(arrival, self._to_syncer(learner, LearnerLeft(learner.index, finished=True)))

    def _send_push(self, learner: SimLearner, push: Push) -> None:
        learner.last_seq = push.seq
        learner.sent_seqs[push.fragment] = push.seq
        if self._home(learner) is None:
            self._in_order.sent(learner.index, push.seq)
        arrival = learner.link.up.send(self.now, push.wire_bytes(), push.fragment)
        self.queue.schedule(arrival, self._to_syncer(learner, PushArrived(push)))

    def _on_update(self, event: UpdateArrives) -> None:
        learner = self.learners[event.learner]
        if event.incarnation != learner.incarnation or learner.gone:
            return  # meant for a learner that crashed or stopped since
        self._carry_out(learner, learner.core.handle(UpdateArrived(event.update), self.now))  # merges if it waited
        if learner.finished and not learner.closing:  # its last answers came: its last pushes went
            self._leave(learner)

    def _meter(self, learner: SimLearner, final: bool = False) -> None:
        r = learner.replica
        self.meters[learner.index].step(
            self.now, steps=r.steps, tokens=learner.tokens, busy_fraction=learner.busy_s / self.now if self.now else 1.0,
            step_time_s=learner.timer.last_s, bytes_up=learner.link.up.bytes_sent,
            bytes_down=learner.link.down.bytes_sent, loss=lambda: r.last_loss, core=learner.core, final=final)
