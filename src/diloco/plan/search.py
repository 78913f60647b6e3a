"""What would make the deployment keep up: each knob moved alone, the others as given.

- the smallest H that keeps up with the given codec (a longer period carries the same bytes in more
  time, and spaces the fragments' pushes further apart);
- the least compression that keeps up at the given H: the first of fp32, bf16, int8, int4, fp4 (fewer
  bytes each) that fits, used both ways;
- the smallest τ (a fragment's round trip does not depend on τ: τ only sets the time it may take);
- the fewest fragments (smaller messages, each one's round trip shorter), for the strategies that stagger
  fragments.

When none of them fits alone, `combination` searches the three together (codec both ways, fragment count
on a ladder, the smallest H for each) and keeps the smallest H (syncing as often as the links allow),
then the least compression, then the fewest fragments; τ stays as given (it sets how stale a merge is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from diloco.plan.deployment import Deployment
from diloco.plan.plan_model import site_reports
from diloco.plan.network import network_report

H_MAX = 1_000_000
FRAGMENTS_MAX = 1024
CODECS_BY_SIZE = ("fp32", "bf16", "int8", "int4", "fp4")
"""Registered codecs from the most bytes to the fewest (int4 and fp4 take the same)."""
FRAGMENT_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
"""Fragment counts `combination` tries (besides the given one)."""


@dataclass(frozen=True)
class Combination:
    """Knobs moved together that keep up, the others as given."""

    H: int
    fragments: int
    codec: str
    """Both ways."""

    def describe(self) -> str:
        return f"H = {self.H:,}, {self.fragments} fragments, {self.codec} both ways"


@dataclass(frozen=True)
class Advice:
    smallest_H: int | None
    least_codec: str | None
    smallest_tau: int | None
    fewest_fragments: int | None
    lines: tuple[str, ...]
    combination: Combination | None = None


def keeps_up(d: Deployment) -> bool:
    """Every learner's link keeps up; with the config's regions, every link and route of theirs."""
    if d.network is not None and d.exchange == "outer":
        return network_report(d).keeps_up
    return all(s.keeps_up for s in site_reports(d))


def round_trips(d: Deployment) -> list[tuple[str, float, float]]:
    """Each learner's (with the config's regions: each route's) longest round trip and its τ budget."""
    if d.network is not None and d.exchange == "outer":
        return [(r.name, r.round_trip_s, r.budget_s) for r in network_report(d).routes]
    return [(s.name, s.round_trip_s, s.budget_s) for s in site_reports(d)]


def smallest_H(d: Deployment) -> int | None:
    """Binary search between the smallest H allowed and the first power of two that keeps up. A longer H
    keeps up wherever a shorter one does (the search's premise), so one that fails at H_MAX fails at
    every H: said in one trial rather than ~20 doublings (most of `combination`'s trials)."""
    low = max(d.tau + 1, len(d.layout.fragments) if d.staggered else 1)
    if keeps_up(replace(d, H=low)):
        return low
    if not keeps_up(replace(d, H=H_MAX)):
        return None
    high = low
    while not keeps_up(replace(d, H=high)):
        high = min(H_MAX, high * 2)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if keeps_up(replace(d, H=mid)) else (mid, high)
    return high


def least_codec(d: Deployment) -> str | None:
    for codec in CODECS_BY_SIZE:
        if keeps_up(replace(d, codec_up=codec, codec_down=codec)):
            return codec
    return None


def smallest_tau(d: Deployment) -> int | None:
    """τ steps of every site must cover its longest round trip (which does not depend on τ)."""
    reports = round_trips(replace(d, tau=1))
    if any(math.isinf(rt) for _, rt, _ in reports):
        return None
    tau = max(1, *(math.ceil(rt / budget) for _, rt, budget in reports))  # budget: one step at τ = 1
    return tau if tau < d.H and keeps_up(replace(d, tau=tau)) else None


def fewest_fragments(d: Deployment) -> int | None:
    top = min(d.H, d.layout.tensor_count if d.layout.exact else FRAGMENTS_MAX, FRAGMENTS_MAX)
    for count in range(1, top + 1):
        if keeps_up(replace(d, layout=d.layout.with_fragments(count))):
            return count
    return None


def combination(d: Deployment) -> Combination | None:
    """The smallest H that keeps up over codecs and fragment counts; ties go to the least compression,
    then the fewest fragments. Fragment counts are tried only for the strategies that stagger them."""
    counts = [len(d.layout.fragments)]
    if d.staggered:
        top = min(d.layout.tensor_count if d.layout.exact else FRAGMENTS_MAX, FRAGMENTS_MAX)
        counts = sorted({*counts, *(f for f in FRAGMENT_LADDER if f <= top)})
    best: tuple[int, int, int] | None = None
    for rank, codec in enumerate(CODECS_BY_SIZE):
        for count in counts:
            if best is not None and count > best[0]:
                break  # a staggered schedule needs H >= fragments: no better H from here
            trial = replace(d, codec_up=codec, codec_down=codec, layout=d.layout.with_fragments(count))
            h = smallest_H(trial)
            if h is not None and (best is None or (h, rank, count) < best):
                best = (h, rank, count)
    return Combination(best[0], best[2], CODECS_BY_SIZE[best[1]]) if best else None


def _bare_round_trip(d: Deployment) -> str:
    """Why no H helps: a fragment's round trip with nothing queued ahead of it (as at a huge H)."""
    name, rt, budget = max(round_trips(replace(d, H=H_MAX)), key=lambda r: r[1] / r[2])
    if rt <= budget:
        return ""
    return f" (at any H, a fragment's round trip from {name} takes {rt:.3g} s, τ steps {budget:.3g} s)"


def advise(d: Deployment) -> Advice:
    """Each knob's value that keeps up, and what to say about it."""
    if d.exchange == "gradients":
        return Advice(None, None, None, None, ("data-parallel syncs every step and overlaps nothing: a DiLoCo "
                                               "strategy with τ > 0 is what can hide the link",))
    if d.tau == 0:
        return Advice(None, None, None, None, (f"τ = 0 ({d.strategy}): every sync waits for its round trip; no H "
                                               "or codec hides it. Streaming or decoupled with τ > 0 can",))
    h, codec, tau = smallest_H(d), least_codec(d), smallest_tau(d)
    fragments = fewest_fragments(d) if d.staggered else None
    lines = [f"smallest H that keeps up with {d.codec_up} up / {d.codec_down} down: "
             + (f"{h:,}" if h else f"none up to {H_MAX:,}{_bare_round_trip(d)}"),
             f"least compression that keeps up at H = {d.H:,}: " + (f"{codec} both ways" if codec else "none"),
             f"smallest τ that keeps up at H = {d.H:,}: "
             + (f"{tau} step{'s' if tau > 1 else ''}" if tau else f"none below H = {d.H:,}")]
    if d.staggered:
        lines.append(f"fewest fragments that keep up at H = {d.H:,}: " + (str(fragments) if fragments else "none"))
    combo = None
    if not any((h, codec, tau, fragments)):
        combo = combination(d)
        lines.append("nothing fits by moving one knob; " + (
            f"moved together: {combo.describe()}" if combo else
            "nor by moving H, fragments and codec together: more bandwidth or a longer step (larger batches)"))
    return Advice(h, codec, tau, fragments, tuple(lines), combo)
