"""How far a learner's counters may move: steps, tokens and sequence numbers are claims, kept plausible.

- Steps may rise no faster than the learner's measured rate allows: before RATE_KNOWN_S of its claims
  are seen, at most 1/MIN_STEP_S steps per second (a generous bootstrap); after, RATE_FACTOR× its
  measured rate. Either way plus RATE_SLACK_STEPS. The rate is measured from its first claim of a step
  (not from its join: the minutes a large model takes to load and compile are not its pace). Claims come
  from progress reports, heartbeats and pushes, on the core's own clock (`now`), so a replayed journal
  decides the same.
- A progress report or heartbeat above that bound, but not above what 1/FASTEST_STEP_S steps per
  second since its join could reach (`impossible_step`, refused), is clipped, not refused
  (`plausible`): the learner is heard, and its step and tokens count as far as the bound allows, the
  rest on later reports. Refusing it would lock out an honest learner that sped up past RATE_FACTOR×
  its average (a paused learner resuming, a region whose learners came back): its rate is measured
  from accepted claims only, so it would never catch up, and with its heartbeats refused it would be
  found silent. Clipped claims raise the measured rate as accepted ones do, so the bound catches up
  with an honest learner within seconds, while a liar gains nothing beyond it. A push above the bound
  is still refused: its tokens weigh in the merge and are counted as merged, so they cannot be
  believed in part.
- Tokens may rise by at most the steps risen × the learner's tokens per step (what it `declare`d at
  join, else DEFAULT_TOKENS_PER_STEP; for a clipped report, the steps believed), and one claim may add
  at most MAX_CLAIM_SHARE of the shared budget: no single message can spend it.
- A declared tokens per step is itself a claim: at most PLAUSIBLE_STEP_FACTOR × the run's own batch ×
  sequence (`tokens_per_step_ceiling`), which also caps the default of a learner that declared none.
- A push's sequence number may be at most MAX_SEQ_JUMP above the learner's last one, and the steps it
  claims may not overlap those of the learner's earlier pushes of the fragment in this life.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from diloco.core.refusals import ProtocolError
from diloco.core.undo import UndoLog

MIN_STEP_S = 1e-4
"""Shortest inner step believed before a learner's rate is measured."""
FASTEST_STEP_S = 1e-6
"""Shortest inner step possible at all, on average since a learner joined: a step count above it is refused,
not clipped. Far below any real step, since a regional syncer's count sums its learners' steps and its
merged ones: honest claims must never reach it."""
RATE_KNOWN_S = 1.0
"""Time a learner's step claims must span before its measured rate is used."""
RATE_FACTOR = 4.0
"""How much faster than measured a learner may claim to step (a faster chip, a burst)."""
RATE_SLACK_STEPS = 64
"""Steps a claim may add beyond what the rate allows (reports cross on the wire, clocks jitter)."""
DEFAULT_TOKENS_PER_STEP = 1 << 24
"""Tokens per inner step of a learner that declared none: above any real batch × sequence × ranks."""
MAX_TOKENS_PER_STEP = 1 << 40
"""Largest tokens per step a learner may declare."""
PLAUSIBLE_STEP_FACTOR = 64
"""Most a learner's tokens per step may exceed the run's configured batch × sequence (its ranks, a larger
local batch): a declared rate above it is a lie that would let one learner spend the shared budget."""
MAX_SEQ_JUMP = 1 << 16
"""Most a push's sequence number may be above the learner's last (pushes are numbered consecutively;
this leaves room for many refused in a row)."""
MAX_BURST_STEPS = 1 << 24
"""Most steps a regional syncer may declare one of its claims can add at once."""
MAX_CLAIM_SHARE = 0.25
"""Most of the shared budget one progress report or heartbeat may add."""


def tokens_per_step_ceiling(batch_tokens: int | None) -> int:
    """The most tokens per step a learner of a run whose batch × sequence is `batch_tokens` may declare
    (None: the run does not say; only the absolute cap applies)."""
    if batch_tokens is None:
        return MAX_TOKENS_PER_STEP
    return max(1, min(MAX_TOKENS_PER_STEP, PLAUSIBLE_STEP_FACTOR * batch_tokens))


@dataclass
class Counters:
    """One learner's latest claims, and where its rate is measured from."""

    joined_at: float
    origin_step: int | None = None
    origin_at: float = 0.0
    step: int = 0
    """The highest step it claimed (in any life: a restart resumes from a checkpoint at most this)."""
    at: float = 0.0
    life_step: int | None = None
    """The step of its latest report in this life (None: none yet), with the tokens it claimed then."""
    life_tokens: int = 0
    burst: int = 0
    """Steps one claim may add beyond the rate (`Claims.bursts`)."""
    clipped: int = 0
    """Progress reports and heartbeats counted only in part (`plausible`)."""
    covered: dict[int, int] = field(default_factory=dict)
    """Per fragment, the highest inner step a push of this life covered: a push covers the steps since
    the learner's previous push of the fragment, so two pushes never cover the same step."""

    def allowed_steps(self, now: float) -> float:
        """Most the step count may rise to by `now`."""
        if self.origin_step is None:
            return RATE_SLACK_STEPS + self.burst + max(0.0, now - self.joined_at) / MIN_STEP_S
        span = self.at - self.origin_at
        elapsed = max(0.0, now - self.at)
        if span < RATE_KNOWN_S:
            rate = 1.0 / MIN_STEP_S
        else:
            rate = RATE_FACTOR * (self.step - self.origin_step) / span
        return self.step + RATE_SLACK_STEPS + self.burst + elapsed * rate

    def possible_steps(self, now: float) -> float:
        """Most the step count can have reached by `now` at all: a step every FASTEST_STEP_S since it
        joined. A claim above it is a lie or a broken counter, refused; one below it but above
        `allowed_steps` is believed in part (`plausible`)."""
        return RATE_SLACK_STEPS + self.burst + max(0.0, now - self.joined_at) / FASTEST_STEP_S

    def plain(self) -> dict:
        return asdict(self)

    def copy(self) -> Counters:
        return replace(self, covered=dict(self.covered))


def step_problem(counters: Counters, step: int, now: float) -> str | None:
    """Why claiming `step` at `now` is implausible, or None."""
    allowed = counters.allowed_steps(now)
    if step > allowed:
        return f"step {step} is above the {int(allowed)} its rate allows"
    return None


def impossible_step(counters: Counters, step: int, now: float) -> str | None:
    """Why claiming `step` at `now` is impossible for any learner, or None."""
    possible = counters.possible_steps(now)
    if step > possible:
        return f"step {step} is above the {int(possible)} any learner could have taken since it joined"
    return None


def token_problem(counters: Counters, step: int, tokens: int, tokens_per_step: int, budget: int | None) -> str | None:
    """Why claiming `tokens` (this life) at `step` is implausible even if the step is believed, or None."""
    base_step, base_tokens = (0, 0) if counters.life_step is None else (counters.life_step, counters.life_tokens)
    rise = tokens - base_tokens
    if rise > max(0, step - base_step) * tokens_per_step:
        return f"tokens {tokens} rose by more than {tokens_per_step} per step risen since step {base_step}"
    if budget is not None and rise > max(tokens_per_step, int(MAX_CLAIM_SHARE * budget)):
        return f"tokens {tokens} add more than {MAX_CLAIM_SHARE:g} of the shared budget at once"
    return None


def plausible(counters: Counters, step: int, tokens: int, tokens_per_step: int, now: float) -> tuple[int, int]:
    """The step and tokens (this life) of a report that passed `token_problem`, as far as they are
    believed: the step no higher than its rate allows, the tokens risen by no more than the steps
    believed risen allow."""
    step = min(step, max(counters.step, int(counters.allowed_steps(now))))
    base_step, base_tokens = (0, 0) if counters.life_step is None else (counters.life_step, counters.life_tokens)
    return step, min(tokens, base_tokens + max(0, step - base_step) * tokens_per_step)


def overlap_problem(counters: Counters, fragment: int, step: int, steps: int) -> str | None:
    """Why a push of `steps` steps ending at inner step `step` claims steps already pushed, or None
    (a push replayed under a new number would count its tokens twice)."""
    covered = counters.covered.get(fragment)
    if covered is not None and step - steps < covered:
        return (f"it claims steps {step - steps + 1} to {step}, but this life's pushes of the fragment "
                f"already covered steps up to {covered}")
    return None


def record(counters: Counters, step: int, now: float, tokens: int | None = None) -> None:
    """An accepted claim: the rate and the life's tokens go on from it. The rate is measured from the
    first claim of a step."""
    if step > counters.step:
        if counters.origin_step is None:
            counters.origin_step, counters.origin_at = step, now
        counters.step, counters.at = step, now
    if tokens is not None:
        counters.life_step, counters.life_tokens = step, tokens


class Claims:
    """Every learner's declared tokens per step and latest accepted claims, and the core's sense of
    time (the first and the latest `now` it was told): what the checks judge a new claim against."""

    def __init__(self, undo: UndoLog | None = None, ceiling: int = MAX_TOKENS_PER_STEP) -> None:
        self.undo = undo or UndoLog()
        """Where a change made in a transaction keeps what it replaced (`undo.py`)."""
        self.ceiling = ceiling
        """The most tokens per step a learner may declare (`tokens_per_step_ceiling`)."""
        self.declared: dict[int, int] = {}
        """Per learner, the tokens per inner step it declared at join."""
        self.bursts: dict[int, int] = {}
        """Per learner that declared one, steps a single claim may add beyond its rate: a regional syncer
        counts its learners' steps, and one of its rounds merges many of them at once."""
        self.counters: dict[int, Counters] = {}
        self.joined_at: dict[int, float] = {}
        self.opened_at: float | None = None
        """The first time the core was told: where the starters' rates are measured from."""
        self.clock: float = 0.0
        """The latest time the core was told: what checks made without a time use."""

    def tick(self, now: float) -> None:
        self.undo.keep_attrs(self, "opened_at", "clock")
        if self.opened_at is None:
            self.opened_at = now
        self.clock = max(self.clock, now)

    def declare(self, learner: int, tokens_per_step: int, burst_steps: int = 0) -> None:
        if not 0 < tokens_per_step <= self.ceiling:
            raise ProtocolError(f"learner {learner} declares {tokens_per_step} tokens per step, outside "
                                f"1..{self.ceiling} ({PLAUSIBLE_STEP_FACTOR}x the run's batch x sequence at most)")
        if not 0 <= burst_steps <= MAX_BURST_STEPS:
            raise ProtocolError(f"learner {learner} declares bursts of {burst_steps} steps, outside 0..{MAX_BURST_STEPS}")
        self.undo.keep(self.declared, learner)
        self.undo.keep(self.bursts, learner)
        self.undo.keep(self.counters, learner, Counters.copy)
        self.declared[learner] = int(tokens_per_step)
        if burst_steps:
            self.bursts[learner] = int(burst_steps)
        if learner in self.counters:
            self.counters[learner].burst = int(burst_steps)

    def tokens_per_step(self, learner: int) -> int:
        return self.declared.get(learner, min(DEFAULT_TOKENS_PER_STEP, self.ceiling))

    def of(self, learner: int, now: float) -> Counters:
        """Its latest accepted claims (a fresh record, not kept, for one never heard from)."""
        found = self.counters.get(learner)
        if found is not None:
            return found
        since = self.joined_at.get(learner, self.opened_at if self.opened_at is not None else now)
        return Counters(joined_at=since, burst=self.bursts.get(learner, 0))

    def accept(self, learner: int, step: int, now: float, tokens: int | None = None) -> Counters:
        """Keep an accepted claim: the learner's rate and this life's tokens go on from it."""
        self.undo.keep(self.counters, learner, Counters.copy)
        counters = self.counters.setdefault(learner, self.of(learner, now))
        record(counters, step, now, tokens)
        return counters

    def new_life(self, learner: int) -> None:
        """A learner restarted: its tokens and pushed steps count afresh; its rate and steps go on."""
        self.undo.keep(self.counters, learner, Counters.copy)
        counters = self.counters.get(learner)
        if counters is not None:
            counters.life_step, counters.life_tokens, counters.covered = None, 0, {}

    def joined(self, learner: int, now: float) -> None:
        """Its rate is measured from its first join (a rejoin goes on from there)."""
        self.undo.keep(self.joined_at, learner)
        self.joined_at.setdefault(learner, now)

    def state_dict(self) -> dict:
        return {"declared": dict(self.declared), "bursts": dict(self.bursts), "counters": {m: c.plain() for m, c in self.counters.items()},
                "joined_at": dict(self.joined_at), "opened_at": self.opened_at, "clock": self.clock}

    def load_state_dict(self, state: dict) -> None:
        self.declared = dict(state.get("declared", {}))
        self.bursts = dict(state.get("bursts", {}))
        self.counters = {m: Counters(**c) for m, c in state.get("counters", {}).items()}
        self.joined_at = dict(state.get("joined_at", {}))
        self.opened_at, self.clock = state.get("opened_at"), state.get("clock", 0.0)
