"""Answering: what each learner is sent after a round, from the version it holds, and what it then holds.

Both ends must agree bit for bit on what a learner holds (`downlink.py` keeps it once per version), so
every answer made is recorded in the membership's `held_versions`. The real syncer, whose answers wait
on streams, gets notices (`answers_when_taken`) and has each answer made when its stream takes it.
"""

from __future__ import annotations

import torch

from diloco.core.actions import Publish
from diloco.core.membership import Membership
from diloco.core.messages import Update
from diloco.core.refusals import ProtocolError
from diloco.core.rounds import FragmentState


class Answering:
    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.answers_when_taken = False
        """Publish notices, and make each answer when the driver takes it (`events.AnswerTaken`): the real
        syncer, whose answers wait on streams. The simulator takes answers as rounds close."""

    def answer(self, state: FragmentState, theta: dict[str, torch.Tensor], acks: dict[int, int],
               next_push: dict[int, float | None]) -> dict[int, Update]:
        """Each learner's answer (by learner: the seq it acknowledges): the fragment's current version, from
        the one it holds; what it holds from now on is recorded, so both ends agree bit for bit."""
        members = self.membership
        p = state.fragment.index
        held = {m: members.held(m, p) for m in acks}
        answers = state.downlink.answers(held, state.version, theta)
        updates = {}
        for m, ack in acks.items():
            a = answers[m]
            members.hold(m, {p: state.version})
            updates[m] = Update(p, state.version, a.values, ack_seq=ack, payload_bytes=a.payload_bytes, wire=a.wire,
                                relative=a.relative, next_push_at=next_push.get(m), base_version=held[m])
        state.downlink.forget_before(min((members.held(m, p) for m in members.alive), default=state.version))
        return updates

    def answers(self, state: FragmentState, theta: dict[str, torch.Tensor], acks: dict[int, int],
                next_push: dict[int, float | None]) -> dict[int, Update]:
        """The answers to `acks` now: notices for a driver that makes each when its stream takes it, else made."""
        if self.answers_when_taken:
            return {m: Update(state.fragment.index, state.version, {}, ack_seq=ack, next_push_at=next_push.get(m))
                    for m, ack in acks.items()}
        return self.answer(state, theta, acks, next_push)

    def owed(self, acks: dict[int, int]) -> dict[int, int]:
        """Those of `acks` that acknowledge a push of the learner's current life (earlier ones get none)."""
        return {m: ack for m, ack in acks.items() if ack > self.membership.session_start.get(m, 0)}

    def answers_lost(self, learner: int, holds: tuple[tuple[int, int], ...], fragments: dict[int, FragmentState],
                     theta: dict[str, torch.Tensor]) -> list[Publish]:
        """A learner says what it holds (it opened its update stream again): each fragment it holds an older
        version of than it was sent lost its answer on the way, so it counts as holding what it says and
        gets that answer again (a notice, or the answer itself), made from there. A claim of a version it
        was never sent is refused whole (ProtocolError), with nothing changed."""
        members = self.membership
        if not members.holds_state(learner):
            raise ProtocolError(f"learner {learner} holds nothing of this shard: it must rejoin first")
        lowered = {}
        for p, version in holds:
            if p not in fragments:
                raise ProtocolError(f"learner {learner} claims fragment {p}, which is not held here")
            sent = members.held(learner, p)
            if version > sent:
                raise ProtocolError(f"learner {learner} claims version {version} of fragment {p}; it was sent "
                                    f"version {sent}")
            if version < sent:
                lowered[p] = version
        ack = members.last_seq(learner)
        if ack <= members.session_start.get(learner, 0):
            ack = 0  # nothing pushed in this life: no answer is owed
        publishes = []
        for p, version in lowered.items():
            members.hold(learner, {p: version})
            if not ack:
                continue
            state = fragments[p]
            if self.answers_when_taken:
                updates = {learner: Update(p, state.version, {}, ack_seq=ack)}
            else:
                updates = self.answer(state, theta, {learner: ack}, {})
            publishes.append(Publish(p, state.version, updates))
        return publishes
