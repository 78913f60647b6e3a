"""The status page's "Rounds" section: one SVG row per fragment, one bar per recent round, coloured by
how many of the joined learners took part."""

from __future__ import annotations

import math
from collections.abc import Callable

from diloco.status.html_text import as_float, esc, number

TIMELINE_ROUNDS = 50
"""The timeline shows at most this many of the most recent rounds."""


def _colour(participants: int, learners: int) -> str:
    """Green when every joined learner took part, amber when two or more did, red for one or none."""
    if learners > 0 and participants >= learners:
        return "#2e9d4f"
    if participants >= 2:
        return "#e0a526"
    return "#d0453f"



def _ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / count
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * step:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


_SVG_LEFT, _SVG_RIGHT, _SVG_TOP, _SVG_WIDTH = 80, 16, 8, 960
"""Timeline geometry in SVG units: the left margin holds the row labels, the space below the rows the
time axis labels."""
_SVG_ROW_H, _SVG_BAR_H = 26, 18
"""Height of one fragment row, and of the round bars drawn in it."""

_Span = tuple[dict, float, float | None]
"""A round with its open time and its close time (None: still open)."""


def timeline_section(s: dict) -> str:
    """The "Rounds" section: one SVG row per fragment, one bar per recent round, coloured by turnout.

    Only the last TIMELINE_ROUNDS rounds are drawn, so the page stays small however long the run.
    """
    rounds_all = [r for r in (s.get("rounds") or []) if isinstance(r, dict)]
    total = len(rounds_all)
    rounds = rounds_all[-TIMELINE_ROUNDS:]
    title = "<h2>Rounds</h2>"
    if not rounds:
        return f'<section id="timeline">{title}<p class="muted">No rounds yet.</p></section>'

    learners = s.get("learners") or {}
    names = {str(k): (v or {}).get("name") or f"learner {k}" for k, v in learners.items()}
    # "Everyone" means every learner that has joined at some point (left ones included).
    n_learners = sum(1 for v in learners.values() if (v or {}).get("state") != "not joined")
    uptime = as_float(s.get("uptime_s"))
    fragments = _timeline_fragments(s, rounds)
    spans = _round_spans(rounds)
    if not spans:
        return f'<section id="timeline">{title}<p class="muted">No rounds with times.</p></section>'

    svg = _timeline_svg(spans, fragments, uptime, names, n_learners)
    return f'<section id="timeline">{title}{_timeline_legend(len(rounds), total)}{svg}</section>'


def _timeline_fragments(s: dict, rounds: list[dict]) -> list[str]:
    """The timeline's rows: the shard's fragments in its order, then any other fragment a round names,
    so that every round has a row even when the snapshot does not list its fragment."""
    fragments = [str(f) for f in (s.get("fragments") or [])]
    for r in rounds:
        if str(r.get("fragment")) not in fragments:
            fragments.append(str(r.get("fragment")))
    return fragments


def _round_spans(rounds: list[dict]) -> list[_Span]:
    """The rounds that can be placed in time: those with an open time, with their open and close times."""
    spans: list[_Span] = []
    for r in rounds:
        opened = as_float(r.get("opened_at"))
        closed = as_float(r.get("closed_at"))
        if opened is None:
            continue
        spans.append((r, opened, closed))
    return spans


def _time_range(spans: list[_Span], uptime: float | None) -> tuple[float, float]:
    """The time axis: from the first opening to the last close, or to now for a round still open.

    Never empty, so that the scale never divides by zero.
    """
    lo = min(o for _, o, _ in spans)
    hi = max(max(o, c if c is not None else (uptime if uptime is not None else o)) for _, o, c in spans)
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def _timeline_svg(spans: list[_Span], fragments: list[str], uptime: float | None, names: dict[str, str],
                  n_learners: int) -> str:
    """The inline SVG: fragment rows and time axis, then a bar per round, drawn up to now while open."""
    lo, hi = _time_range(spans, uptime)
    row_of = {f: i for i, f in enumerate(fragments)}
    axis_y = _SVG_TOP + _SVG_ROW_H * len(fragments)
    height = axis_y + 28
    plot_w = _SVG_WIDTH - _SVG_LEFT - _SVG_RIGHT

    def x(t: float) -> float:
        return _SVG_LEFT + (t - lo) / (hi - lo) * plot_w

    parts = [f'<svg id="timeline-svg" viewBox="0 0 {_SVG_WIDTH} {height}" width="100%" '
             f'preserveAspectRatio="xMinYMin meet" role="img" aria-label="round timeline">']
    parts += _timeline_grid(row_of, axis_y, _ticks(lo, hi), x)
    for r, opened, closed in spans:
        end = closed if closed is not None else max(opened, uptime if uptime is not None else opened)
        y = _SVG_TOP + row_of[str(r.get("fragment"))] * _SVG_ROW_H
        parts.append(_round_bar(r, opened, closed, x(opened), x(end), y, names, n_learners))
    parts.append("</svg>")
    return "".join(parts)


def _timeline_grid(row_of: dict[str, int], axis_y: int, ticks: list[float],
                   x: Callable[[float], float]) -> list[str]:
    """A label and a baseline per fragment row, then a gridline and a time label (in s) per tick."""
    parts: list[str] = []
    for f, i in row_of.items():
        y = _SVG_TOP + i * _SVG_ROW_H
        parts.append(f'<text x="{_SVG_LEFT - 8}" y="{y + _SVG_BAR_H / 2 + 4:.1f}" text-anchor="end">'
                     f"fragment {esc(f)}</text>")
        parts.append(f'<line class="axis" x1="{_SVG_LEFT}" x2="{_SVG_WIDTH - _SVG_RIGHT}" '
                     f'y1="{y + _SVG_ROW_H - 4:.1f}" y2="{y + _SVG_ROW_H - 4:.1f}"/>')
    for t in ticks:
        parts.append(f'<line class="axis" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{_SVG_TOP}" y2="{axis_y + 4}"/>')
        parts.append(f'<text x="{x(t):.1f}" y="{axis_y + 18}" text-anchor="middle">{esc(number(round(t, 2)))} s</text>')
    return parts


def _round_bar(r: dict, opened: float, closed: float | None, x0: float, x1: float, y: int,
               names: dict[str, str], n_learners: int) -> str:
    """One round's bar from ``x0`` to ``x1`` in the row at ``y``, with its details as a hover tooltip.

    At least 2 units wide so that short rounds stay visible; labelled with the participant count
    when there is room for it.
    """
    frag = str(r.get("fragment"))
    participants = list(r.get("participants") or [])
    count = len(participants)
    w = max(x1 - x0, 2.0)
    who = ", ".join(names.get(str(p), f"learner {p}") for p in participants) or "none"
    tip = (f"fragment {frag} → version {r.get('version', '?')}\n"
           f"opened {opened:.2f} s, " + (f"closed {closed:.2f} s ({closed - opened:.2f} s)"
                                         if closed is not None else "still open") + "\n"
           f"participants ({count}): {who}\n"
           f"stale pushes: {r.get('stale', 0)}, held open: {r.get('held_s', '—')} s")
    cls = "round open" if closed is None else "round"
    bar = (f'<g class="round-bar" data-fragment="{esc(frag)}" data-version="{esc(r.get("version", ""))}" '
           f'data-participants="{count}"><title>{esc(tip)}</title>'
           f'<rect class="{cls}" x="{x0:.1f}" y="{y}" width="{w:.1f}" height="{_SVG_BAR_H}" rx="2" '
           f'fill="{_colour(count, n_learners)}"/>')
    if w >= 14:
        bar += (f'<text x="{x0 + w / 2:.1f}" y="{y + _SVG_BAR_H / 2 + 4:.1f}" text-anchor="middle" '
                f'style="fill:#fff">{count}</text>')
    return bar + "</g>"


def _timeline_legend(shown: int, total: int) -> str:
    """How many rounds are drawn, what the bar colours mean, and that the bars have tooltips."""
    counted = (f"the last {shown} of {total} rounds" if total > shown
               else f"{total} round{'s' if total != 1 else ''}")
    return (
        '<p class="legend muted">'
        f'<span id="rounds-shown">{esc(counted)}</span>'
        '<span><i class="swatch" style="background:#2e9d4f"></i>all joined learners</span>'
        '<span><i class="swatch" style="background:#e0a526"></i>some</span>'
        '<span><i class="swatch" style="background:#d0453f"></i>one or none</span>'
        "<span>bar label: participants; hover for details</span></p>"
    )
