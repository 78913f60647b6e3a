"""Pacing: when each learner's next push of a fragment will arrive, how long a round waits for it, and
when each learner should push next so that the next round gathers everyone.

Learners never wait, so a round can only gather several of them if their pushes of a fragment land
close together. Two things make that so:

1. **Alignment in time.** Each answer names the time at which its recipient pushes that fragment next
   (`Update.next_push_at`), on the recipient's own clock: the next round's target T, less the trip its
   last push took as the two clocks stamped it (arrival on ours − sending on its), so that clock skew
   and link latency cancel. The learner pushes at the end of its step nearest to that time, so pushes
   land within about half a step of T whatever the learners' speeds and however their step times
   wandered meanwhile. Targets follow a grid, one sync period T_H = H·ξ_fast apart (H steps of the
   fastest learner alive; a fragment's first target is the mean arrival of its first round): a learner
   at a quarter of that speed pushes every H/4 of its own steps, at the same times as the others.
   Speed differences are by design, not by accident.
2. **Prediction.** Every learner reports after each step how long until it pushes each fragment next,
   by its own reckoning (`Progress.due_in_s`). A report arriving at r that says d predicts the push at
   r + d. Reports and pushes cross the same link in order, so a learner that has not reported since
   the time its push was predicted has not pushed yet either (its step ran long, its process was
   descheduled, its link is busy): it is still coming. A round therefore waits for every learner
   predicted to push before the round's bound, until its push arrives, or a later report predicts it
   past the bound, or the bound passes. No margin is guessed: the learners' own reports end the wait.

The bound: a round waits for nobody predicted later than γ·T_H/2 after its first push (γ =
`outer.grace`), nor longer than `grace_cap_steps` fastest steps, so answers come back well before the
learners' next push. A push that missed its round (it arrives long before the next target) is thus
merged alone at once, and leaves the grid where it was: the next round still gathers everyone.

A fragment's first round has no grid to lean on: its pushes come by the learners' steps, spread by
when each began training (a learner imports and joins in its own time) as well as by its speed. Its
bound is twice the others' (a whole period, γ·T_H, with the default cap): a learner that misses it is
merged alone and stale, and the fragment takes several rounds to gather everyone again (seen in real
runs: the first round of fragment 0 closed 0.44 s before the two slow learners' pushes, and its next
three rounds were split and stale).

Every wait is derived from measured step times and the learners' reports, and bounded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from diloco.core.messages import Progress
from diloco.core.undo import UndoLog

STEP_EMA = 0.1
"""Weight of the newest report in the syncer's running step time of a learner (reports come often)."""


@dataclass
class Pace:
    """What the syncer knows of one learner's progress."""

    step: int = 0
    reported_at: float = 0.0
    """When its latest report arrived (the syncer's clock)."""
    step_time: float = 0.0
    due_in: dict[int, float] = field(default_factory=dict)
    """Per fragment, how long after `reported_at` the learner said it would push it next."""

    def copy(self) -> Pace:
        return dataclasses.replace(self, due_in=dict(self.due_in))


class Pacer:
    def __init__(self, period: float, grace: float, cap_steps: float, undo: UndoLog | None = None) -> None:
        self.undo = undo or UndoLog()
        """Where a change made in a transaction keeps what it replaced (`undo.py`)."""
        self.period, self.grace, self.cap_steps = period, grace, cap_steps
        self.paces: dict[int, Pace] = {}
        self._fastest: tuple[frozenset[int], float | None, int | None] | None = None
        """The learners last asked about (`_fastest_step`), the fastest step time among them and whose:
        kept up to date as reports come, so that a round's bound costs the same whatever their number."""

    # ------------------------------------------------------------ what learners say

    def on_progress(self, report: Progress, now: float) -> None:
        """A report of where a learner stands (one without a schedule only says it is alive)."""
        if not report.due_in_s:
            return
        self.undo.keep(self.paces, report.learner, Pace.copy)
        pace = self.paces.setdefault(report.learner, Pace())
        if report.step < pace.step:
            return  # overtaken by a newer report
        pace.step, pace.reported_at = report.step, now
        if report.step_time_s > 0:
            pace.step_time = report.step_time_s if pace.step_time <= 0 else \
                pace.step_time + STEP_EMA * (report.step_time_s - pace.step_time)
            self._moved(report.learner, pace.step_time)
        pace.due_in = dict(enumerate(report.due_in_s))

    def on_push(self, learner: int, fragment: int) -> None:
        """A push arrived: until the learner's next report, nothing is known of the one after."""
        self.undo.keep(self.paces, learner, Pace.copy)
        pace = self.paces.get(learner)
        if pace is not None:
            pace.due_in.pop(fragment, None)

    def forget(self, learner: int) -> None:
        """A learner restarts: what it reports from now on starts from its checkpoint."""
        self.undo.keep(self.paces, learner, Pace.copy)
        self.paces.pop(learner, None)
        self._moved(learner, None)

    def _moved(self, learner: int, step_time: float | None) -> None:
        """`learner`'s step time is now `step_time` (None: unknown): the fastest may have changed."""
        if self._fastest is None or learner not in self._fastest[0]:
            return
        self.undo.keep_attrs(self, "_fastest")
        asked, fastest, whose = self._fastest
        if learner == whose:
            self._fastest = None  # it slowed down or left: another may be the fastest now
        elif step_time is not None and step_time > 0 and (fastest is None or step_time < fastest):
            self._fastest = (asked, step_time, learner)

    # ------------------------------------------------------------ predictions

    def predict(self, learner: int, fragment: int) -> float | None:
        """When the learner's next push of `fragment` will arrive; None when nothing is known."""
        pace = self.paces.get(learner)
        due_in = None if pace is None else pace.due_in.get(fragment)
        return None if due_in is None else pace.reported_at + due_in

    def sync_period_s(self, learners: set[int]) -> float | None:
        """T_H: H steps of the fastest learner."""
        fastest = self._fastest_step(learners)
        return None if fastest is None else self.period * fastest

    def _fastest_step(self, learners: set[int]) -> float | None:
        if self._fastest is None or self._fastest[0] != learners:
            self.undo.keep_attrs(self, "_fastest")
            times = [(self.paces[m].step_time, m) for m in learners if m in self.paces and self.paces[m].step_time > 0]
            fastest, whose = min(times) if times else (None, None)
            self._fastest = (frozenset(learners), fastest, whose)
        return self._fastest[1]

    def bound(self, opened: float, learners: set[int], first: bool = False) -> float:
        """The latest a round opened at `opened` waits for anyone; `first`: the fragment's first round, which
        may wait twice as long (no grid has aligned its pushes yet): a whole period by default."""
        fastest = self._fastest_step(learners)
        if fastest is None or self.grace <= 0:
            return opened
        longer = 2 if first else 1
        return opened + longer * min(self.grace * self.period * fastest / 2, self.cap_steps * fastest)

    def anyone_due(self, fragment: int, missing: set[int], bound: float) -> bool:
        """Whether a round of `fragment` should wait for one of the learners in `missing`: one predicted to
        push it by the round's `bound`."""
        for m in missing:  # `predict`, inlined: this runs for every round held, over every learner missing
            pace = self.paces.get(m)
            due_in = None if pace is None else pace.due_in.get(fragment)
            if due_in is not None and pace.reported_at + due_in <= bound:
                return True
        return False

    # ------------------------------------------------------------ alignment

    def ask(self, learner: int, target: float, trip: float | None) -> float | None:
        """The time, on the learner's clock, at which to push so that the push lands at `target`;
        `trip` is its last push's arrival on our clock less its sending on the learner's."""
        return None if trip is None or learner not in self.paces else target - trip

    def state_dict(self) -> dict:
        return {m: dataclasses.asdict(p) for m, p in self.paces.items()}

    def load_state_dict(self, state: dict) -> None:
        self.paces = {m: Pace(**s) for m, s in state.items()}
        self._fastest = None
