"""Membership, the syncer core's part that knows who is in: who is alive (by silence, `liveness.py`),
who finished or was lost, what each learner holds and has pushed (its ledger), and the shared token
budget its progress reports spend.

A learner is alive once it joined, until it leaves or is silent past its allowance; one found dead by
silence (lost) counts again when it speaks. One that finished its share still counts in the rounds'
shares. The budget adds up every life of every learner: a restart banks the tokens of the life before.
"""

from __future__ import annotations

from typing import Iterable

from diloco.core.actions import Timer
from diloco.core.liveness import Liveness
from diloco.core.rounds import LedgerEntry
from diloco.core.undo import UndoLog


class Membership:
    def __init__(self, members: Iterable[int], fragments: Iterable[int], *, budget: int | None, detect_s: float,
                 undo: UndoLog) -> None:
        self.undo = undo
        """Where a change made in a transaction keeps what it replaced (`undo.py`)."""
        self.alive = set(members)
        self.finished: set[int] = set()
        """Learners that left having trained their share."""
        self.lost: set[int] = set()
        """Learners found dead by silence (not announced): they count again when they speak."""
        self.cut: set[int] = set()
        """Those of `lost` found dead by their connection ending: a push they sent before it ended may still
        arrive, and is no sign of life; a heartbeat or a new join is."""
        self.over = False
        """Every learner has left and the last rounds are merged."""
        self.ledger = {m: LedgerEntry() for m in self.alive}
        self.held_versions: dict[int, dict[int, int]] = {m: dict.fromkeys(fragments, 0) for m in self.alive}
        """Per learner, the version of each fragment it holds: the starters hold the first, the others
        what they took (`SyncerCore.rejoin_state`) or were answered. What it holds is kept once per
        version, not per learner (`downlink.py`)."""
        self.session_start: dict[int, int] = {m: 0 for m in self.alive}
        """Per learner, the last sequence number of its previous life: answers to those pushes are not sent."""
        self.budget = budget
        self.tokens: dict[int, int] = {}
        """Per learner, tokens trained in its current life (its latest progress report)."""
        self.tokens_banked: dict[int, int] = {}
        """Per learner, tokens trained in its earlier lives."""
        self.stopped = False
        """The shared budget is spent: the run is ending."""
        self.liveness = Liveness(detect_s=detect_s, undo=undo)
        self.wake_at: float | None = None
        """The liveness check the driver was asked to wake the core for."""

    # ------------------------------------------------------------ what it knows

    def tokens_reported(self, learner: int | None = None) -> int:
        """Tokens the learners reported over all their lives (one learner's, or everyone's)."""
        if learner is not None:
            return self.tokens.get(learner, 0) + self.tokens_banked.get(learner, 0)
        return sum(self.tokens.values()) + sum(self.tokens_banked.values())

    @property
    def budget_spent(self) -> bool:
        return self.budget is not None and self.tokens_reported() >= self.budget

    def holds_state(self, learner: int) -> bool:
        """It took Θ (`SyncerCore.rejoin_state`) or started from its first version."""
        return learner in self.held_versions

    def held(self, learner: int, fragment: int) -> int:
        """The version of `fragment` it holds (0: none yet)."""
        return self.held_versions.get(learner, {}).get(fragment, 0)

    def last_seq(self, learner: int) -> int:
        return self.ledger[learner].last_seq if learner in self.ledger else 0

    # ------------------------------------------------------------ changes

    def entry(self, learner: int) -> LedgerEntry:
        """Its ledger entry, about to change."""
        self.undo.keep(self.ledger, learner, LedgerEntry.copy)
        return self.ledger[learner]

    def hold(self, learner: int, versions: dict[int, int]) -> None:
        """It holds these versions of these fragments from now on."""
        self.undo.keep(self.held_versions, learner, dict)
        self.held_versions.setdefault(learner, {}).update(versions)

    def new_life(self, learner: int, after_seq: int) -> None:
        """It (re)starts: its pushes from now on are numbered above `after_seq`, and its tokens count from
        zero (the earlier lives' still count)."""
        for mapping in (self.session_start, self.tokens, self.tokens_banked):
            self.undo.keep(mapping, learner)
        self.undo.keep(self.ledger, learner, LedgerEntry.copy)
        self.session_start[learner] = after_seq
        self.ledger.setdefault(learner, LedgerEntry())
        if learner in self.tokens:
            self.tokens_banked[learner] = self.tokens_banked.get(learner, 0) + self.tokens.pop(learner)

    def count_tokens(self, learner: int, tokens: int) -> bool:
        """Its tokens in this life, as it reported them; True when they spend the shared budget."""
        self.undo.keep(self.tokens, learner)
        self.tokens[learner] = tokens
        return self.budget_spent and self.stop()

    def stop(self) -> bool:
        """The run ends; True the first time."""
        if self.stopped:
            return False
        self.undo.keep_attrs(self, "stopped")
        self.stopped = True
        return True

    def join(self, learner: int, now: float) -> None:
        """It counts for rounds again."""
        for members in (self.alive, self.finished, self.lost, self.cut):
            self.undo.keep_member(members, learner)
        self.undo.keep_attrs(self, "over")
        self.alive.add(learner)
        self.finished.discard(learner)
        self.lost.discard(learner)
        self.cut.discard(learner)
        self.over = False
        self.liveness.hear(learner, now)

    def leave(self, learner: int, finished: bool) -> None:
        """Rounds stop waiting for it; one that `finished` its share still counts in their shares."""
        self.undo.keep_member(self.alive, learner)
        self.alive.discard(learner)
        if finished and self.holds_state(learner):  # only one that took part has a share to keep
            self.undo.keep_member(self.finished, learner)
            self.finished.add(learner)

    def end(self) -> bool:
        """Nobody is left: True the first time (the last rounds are to be merged)."""
        if self.alive or self.over:
            return False
        self.undo.keep_attrs(self, "over")
        self.over = True
        return True

    # ------------------------------------------------------------ liveness

    def heard(self, learner: int, now: float, heartbeat: bool) -> bool:
        """Something of it arrived; True when it was lost and now counts again (one whose connection ended:
        only on a heartbeat, which a killed process no longer sends)."""
        self.liveness.hear(learner, now, heartbeat=heartbeat)
        if learner in self.cut and not heartbeat:
            return False
        return learner in self.lost and self.holds_state(learner) and not self.over

    def found_dead(self, now: float) -> list[int]:
        """Those alive that are silent past their allowance, if the check is due; now lost."""
        if self.wake_at is not None and now < self.wake_at:
            return []
        self.undo.keep_attrs(self, "wake_at")
        self.wake_at = None
        dead = self.liveness.silent(self.alive, now)
        for m in dead:
            self.undo.keep_member(self.lost, m)
            self.lost.add(m)
        return dead

    def lose(self, learner: int) -> bool:
        """Its connection ended without a goodbye: lost now, as if silent past its allowance. True if it was
        alive (a learner already lost, gone or never joined changes nothing)."""
        if learner not in self.alive or learner in self.lost:
            return False
        for members in (self.lost, self.cut):
            self.undo.keep_member(members, learner)
            members.add(learner)
        return True

    def next_check(self) -> Timer | None:
        """A Timer for the next liveness check, unless one as early is already asked for."""
        due = self.liveness.next_check(self.alive)
        if due is None or (self.wake_at is not None and self.wake_at <= due):
            return None
        self.undo.keep_attrs(self, "wake_at")
        self.wake_at = due
        return Timer(due)

    def resumed(self, now: float) -> None:
        """The syncer itself was away: silence says nothing, everyone counts as heard now."""
        self.liveness.refresh(now)
        self.undo.keep_attrs(self, "wake_at")
        self.wake_at = None

    # ------------------------------------------------------------ saved state

    def state_dict(self) -> dict:
        return {"alive": sorted(self.alive), "finished": sorted(self.finished), "lost": sorted(self.lost),
                "cut": sorted(self.cut), "over": self.over, "ledger": {m: e.plain() for m, e in self.ledger.items()},
                "held_versions": {m: dict(v) for m, v in self.held_versions.items()},
                "session_start": dict(self.session_start), "tokens": dict(self.tokens),
                "tokens_banked": dict(self.tokens_banked), "stopped": self.stopped,
                "liveness": self.liveness.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.alive, self.finished, self.lost = set(state["alive"]), set(state["finished"]), set(state["lost"])
        self.cut = set(state.get("cut", ()))  # a state saved before connections were watched has none
        self.over, self.stopped = state["over"], state["stopped"]
        self.ledger = {m: LedgerEntry.of(e) for m, e in state["ledger"].items()}
        self.held_versions = {m: dict(v) for m, v in state["held_versions"].items()}
        self.session_start = dict(state["session_start"])
        self.tokens, self.tokens_banked = dict(state["tokens"]), dict(state["tokens_banked"])
        self.liveness.load_state_dict(state["liveness"])
        self.wake_at = None
