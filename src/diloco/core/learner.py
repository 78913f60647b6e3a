"""The learner's side of outer synchronisation, as a sans-I/O state machine.

The driver runs inner steps and reports each one (`on_step`), hands over updates that arrive
(`on_update`) and asks what to do next between steps (`poll`). The core decides which fragments are
due, computes their outer gradients Δ = anchor − θ, merges answers τ steps after sending with
θ ← α·θ + (1 − α)·Θ̃, and re-anchors on exactly the values received.

- Counters for a fragment restart when it is *sent*, not when its answer is merged: the τ steps
  taken in between belong to the next push of that fragment, so each token is reported once.
- A fragment has at most one push in flight. If it falls due again before its answer came back
  (a slow syncer or link), it is pushed as soon as that answer is merged; the learner does not stop.
- A learner that waits (`wait_for_updates`, synchronous strategies) stops at step t + τ until the
  answer to what it sent at t is in. One that does not wait merges answers whenever they arrive.
- `finish` never waits: what was trained since each fragment's last push is pushed as it is; for a
  fragment still in flight, only the progress made since sending it (θ_sent − θ), so nothing is
  counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.codecs import Codec, Encoded, ErrorFeedback, get_codec
from diloco.core.messages import Push, Update
from diloco.fragments import Fragment, Schedule

STEP_TIME_EMA = 0.2


@dataclass
class InFlight:
    push: Push
    merge_at_step: int
    update: Update | None = None


@dataclass(frozen=True)
class Poll:
    """What the driver should do now: send `pushes`, then wait for `waiting_for` or take the next step."""

    pushes: list[Push] = field(default_factory=list)
    waiting_for: tuple[int, ...] = ()
    """Fragments whose answer the learner must merge before its next step (waiting strategies)."""


class LearnerCore:
    def __init__(self, learner: int, params: dict[str, torch.Tensor], fragments: list[Fragment],
                 schedule: Schedule, *, tau: int, alpha: float, wait_for_updates: bool,
                 versions: list[int] | None = None, step: int = 0, first_seq: int = 0,
                 codec: Codec | None = None, error_feedback: bool = False, encode_later: bool = False) -> None:
        """`params` are the live model tensors; they are the anchors too, at `versions` (a fresh start
        or a rejoin from the syncer's current Θ). `step` resumes the fragment schedule.

        With `encode_later`, pushes carry the raw outer gradients and the driver encodes them with
        `encode` off the training thread (the real driver); otherwise they carry what the syncer will
        decode (the simulator)."""
        self.learner = learner
        self.params = params
        self.fragments = fragments
        self.schedule = schedule
        self.tau, self.alpha, self.wait_for_updates = tau, alpha, wait_for_updates
        self.codec = codec or get_codec("fp32")
        self.feedback = ErrorFeedback(self.codec) if error_feedback else None
        self.encode_later = encode_later
        self.step = step
        self.seq = first_seq
        self.anchors = [{n: params[n].detach().to(torch.float32).clone() for n in f.names} for f in fragments]
        self.anchor_versions = list(versions) if versions is not None else [0] * len(fragments)
        self.tokens_since = [0] * len(fragments)
        self.steps_since = [0] * len(fragments)
        self.in_flight: dict[int, InFlight] = {}
        self.overdue: set[int] = set()
        self.step_time_s = 0.0
        self.now: float | None = None
        self.finished = False
        self.stale_updates = 0
        self.refused = 0
        self._last_push_norm: torch.Tensor | None = None
        self.last_staleness: int | None = None
        """Versions the fragment had moved on by others when the latest merge arrived."""

    # ------------------------------------------------------------ events

    def on_step(self, tokens: int, *, step_time_s: float = 0.0, now: float | None = None) -> list[Push]:
        """One inner step is done: count it, and push every fragment that is now due."""
        if self.finished:
            raise RuntimeError(f"learner {self.learner} reported a step after finish()")
        self.step += 1
        self.now = now
        if step_time_s > 0:
            old = self.step_time_s
            self.step_time_s = step_time_s if old == 0 else old + STEP_TIME_EMA * (step_time_s - old)
        for p in range(len(self.fragments)):
            self.tokens_since[p] += tokens
            self.steps_since[p] += 1
        pushes = []
        for p in self.schedule.due(self.step):
            if p in self.in_flight:
                self.overdue.add(p)
            else:
                pushes.append(self._push(p))
        return pushes

    def on_update(self, update: Update) -> bool:
        """Keep an answer to the push in flight; drop (and return False) one that answers none, such as
        an answer to a push sent before a crash and restart."""
        flight = self.in_flight.get(update.fragment)
        if flight is None or flight.update is not None or update.ack_seq < flight.push.seq:
            self.stale_updates += 1
            return False
        flight.update = update
        return True

    def poll(self, now: float | None = None) -> Poll:
        """Merge every answer whose time has come; push what fell due meanwhile; say whether to wait."""
        if now is not None:
            self.now = now
        pushes = []
        for p, flight in sorted(self.in_flight.items()):
            if flight.update is not None and self.step >= flight.merge_at_step:
                self._merge(p, flight.update)
                del self.in_flight[p]
                if p in self.overdue:
                    self.overdue.discard(p)
                    pushes.append(self._push(p))
        if self.wait_for_updates:
            blocking = tuple(p for p, f in sorted(self.in_flight.items()) if self.step >= f.merge_at_step)
            return Poll(pushes, waiting_for=blocking)
        return Poll(pushes)

    def finish(self, now: float | None = None) -> list[Push]:
        """No more inner steps: push whatever progress no push has carried yet."""
        if now is not None:
            self.now = now
        pushes = []
        for p in range(len(self.fragments)):
            if self.steps_since[p] == 0:
                continue
            flight = self.in_flight.get(p)
            if flight is None:
                pushes.append(self._push(p))
            else:
                sent = flight.push
                deltas = {n: d - sent.deltas[n] for n, d in self._deltas(p).items()}
                pushes.append(self._make_push(p, sent.base_version, deltas))
        self.finished = True
        return pushes

    def on_refused(self, push: Push) -> None:
        """The syncer refused `push` (an outlier, a non-finite value): its progress is not merged. The
        fragment is free to be pushed again, and that push carries this progress (Δ is measured from
        the anchor) and its tokens."""
        flight = self.in_flight.get(push.fragment)
        if flight is not None and flight.push.seq == push.seq:
            del self.in_flight[push.fragment]
            self.overdue.discard(push.fragment)
        self.tokens_since[push.fragment] += push.tokens
        self.steps_since[push.fragment] += push.steps
        self.refused += 1

    @property
    def last_push_norm(self) -> float | None:
        """L2 norm of the latest push's outer gradient (before encoding)."""
        return None if self._last_push_norm is None else float(self._last_push_norm)

    def unpushed_tokens(self) -> list[int]:
        """Per fragment, tokens trained that no push has carried: what a crash now would lose."""
        return list(self.tokens_since)

    # ------------------------------------------------------------ tensor work

    @torch.no_grad()
    def _deltas(self, p: int) -> dict[str, torch.Tensor]:
        anchor = self.anchors[p]
        return {n: anchor[n] - self.params[n].detach().to(torch.float32) for n in self.fragments[p].names}

    def encode(self, deltas: dict[str, torch.Tensor]) -> dict[str, Encoded]:
        """The uplink's encoding of one push, with error feedback when it is on. Calls must come in
        push order (the residuals carry over), from one thread at a time."""
        if self.feedback:
            return {name: self.feedback.encode(name, delta) for name, delta in deltas.items()}
        return {name: self.codec.encode(delta) for name, delta in deltas.items()}

    def _encode(self, deltas: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """What the syncer will decode, and the bytes it takes; or, encoding later, the raw deltas and
        the bytes they will take."""
        if self.encode_later:
            return deltas, sum(self.codec.wire_bytes(d.numel()) for d in deltas.values())
        encoded = self.encode(deltas)
        decoded = {name: self.codec.decode(e, device=deltas[name].device) for name, e in encoded.items()}
        return decoded, sum(e.wire_bytes() for e in encoded.values())

    def _make_push(self, p: int, base_version: int, deltas: dict[str, torch.Tensor]) -> Push:
        self.seq += 1
        # Kept on the device and read only when asked: reading it would wait for the device.
        self._last_push_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d)
                                                                     for d in deltas.values()]))
        decoded, nbytes = self._encode(deltas)
        push = Push(self.learner, p, base_version, self.seq, decoded, self.tokens_since[p], self.steps_since[p],
                    step_time_s=self.step_time_s, sent_at=self.now, payload_bytes=nbytes)
        self.tokens_since[p] = self.steps_since[p] = 0
        return push

    def _push(self, p: int) -> Push:
        push = self._make_push(p, self.anchor_versions[p], self._deltas(p))
        self.in_flight[p] = InFlight(push, merge_at_step=self.step + self.tau)
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
        self.last_staleness = max(0, update.version - self.anchor_versions[p] - 1)
        self.anchor_versions[p] = update.version
