"""Render a syncer shard's status snapshot as one self-contained HTML page.

The page has no external assets: CSS is inline, the round timeline is inline SVG. It keeps itself
current with a tiny inline script that fetches the page again every two seconds and swaps in the new
`#content`; with scripts off, a `<noscript>` meta refresh reloads the whole page every five seconds.
Every string taken from the snapshot is escaped with `html.escape`.

Snapshot shape (times in seconds; object keys are strings, as after a JSON round trip)::

    {"shard": 0, "shards": 1, "strategy": "decoupled", "uptime_s": 12.3, "finished": False,
     "fragments": [0, 1], "versions": {"0": 5, "1": 4},
     "learners": {"0": {"name": "learner 0", "host": "vm", "state": "training", "tokens": 12345,
                        "steps": 120, "pushes": 10, "duplicates": 0, "tokens_merged": 9000,
                        "tokens_stale": 1000, "last_seen_s": 0.4, "held_versions": {"0": 5}}},
     "rounds": [{"fragment": 0, "version": 5, "opened_at": 10.1, "closed_at": 10.3,
                 "participants": [0, 2], "stale": 1, "staleness": [0, 1], "held_s": 0.2}],
     "regions": [{"name": "us-east", "syncer": True, "learners": [0, 1]}]}

`regions` is optional: with it, the membership table groups learners under their region. `tokens` is what
a learner trained; `tokens_merged` and `tokens_stale` are in the same unit (`shard/snapshot.py`,
`learner_share`: each fragment weighted by its size, not summed over fragments).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable
from typing import Any

TIMELINE_ROUNDS = 50
"""The timeline shows at most this many of the most recent rounds."""

REFRESH_MS = 2000
FALLBACK_REFRESH_S = 5


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _int_key(key: Any) -> tuple[int, Any]:
    """Sort numeric ids numerically ("10" after "9"), anything else after them."""
    try:
        return (0, int(key))
    except (TypeError, ValueError):
        return (1, str(key))


def _num(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:,.0f}" if value == int(value) else f"{value:,.2f}"
    return str(value)


def _duration(seconds: Any) -> str:
    """12.3 -> '12.3 s', 125 -> '2 m 05 s', 3725 -> '1 h 02 m'."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "—"
    if not math.isfinite(s) or s < 0:
        return "—"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} m {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} m"


def _ago(seconds: Any) -> str:
    d = _duration(seconds)
    return d if d == "—" else f"{d} ago"


def _slug(text: Any) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "unknown"


def _float(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


STYLE = """
:root { color-scheme: light; --fg:#1d2329; --muted:#66717c; --line:#d9dee3; --bg:#f6f7f9; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
       background: var(--bg); }
header { display: flex; flex-wrap: wrap; gap: .4rem 1.2rem; align-items: baseline; padding: .8rem 1.2rem;
         background: #fff; border-bottom: 1px solid var(--line); }
header h1 { font-size: 1.15rem; margin: 0; }
header .meta { color: var(--muted); }
main { padding: .8rem 1.2rem 2rem; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: .6rem .9rem;
          margin-bottom: 1rem; overflow-x: auto; }
h2 { font-size: 1rem; margin: .2rem 0 .6rem; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: .25rem .6rem; border-bottom: 1px solid var(--line); white-space: nowrap; }
th { color: var(--muted); font-weight: 600; }
td.num, th.num { text-align: right; }
.badge { display: inline-block; padding: 0 .45rem; border-radius: 9px; font-size: .85em; font-weight: 600; }
.state-training { background: #d7f2dd; color: #14632a; }
.state-left { background: #e4e6ea; color: #4a525a; }
.state-silent { background: #fde2c8; color: #8a4600; }
.state-not-joined { background: #eef0f3; color: #7b848d; }
.finished { background: #d9e8ff; color: #1b4f9c; }
.syncer { background: #d9e8ff; color: #1b4f9c; }
tr.region-heading th { color: var(--fg); background: var(--bg); }
.running { background: #d7f2dd; color: #14632a; }
.muted { color: var(--muted); }
.legend span { margin-right: 1rem; }
.swatch { display: inline-block; width: .8rem; height: .8rem; border-radius: 2px; vertical-align: -1px;
          margin-right: .3rem; }
#conn.stale { color: #a4262c; font-weight: 600; }
svg text { font: 11px system-ui, sans-serif; fill: var(--fg); }
svg .axis { stroke: var(--line); }
svg .round { stroke: #fff; stroke-width: .5; }
svg .open { stroke: #333; stroke-dasharray: 3 2; }
"""

# Tries the page again every REFRESH_MS and swaps in its #content; it never runs twice at once and
# marks the page stale when the server stops answering. Markup from the server is already escaped.
SCRIPT = """
(function () {
  var busy = false, refreshes = 0;
  function tick() {
    if (busy) return;
    busy = true;
    fetch(location.href, {cache: "no-store"}).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.text();
    }).then(function (text) {
      var doc = new DOMParser().parseFromString(text, "text/html");
      var fresh = doc.getElementById("content");
      if (!fresh) throw new Error("no #content");
      document.getElementById("content").replaceWith(document.adoptNode(fresh));
      refreshes += 1;
      document.body.setAttribute("data-refreshes", String(refreshes));
      var c = document.getElementById("conn");
      c.className = ""; c.textContent = "live";
    }).catch(function (err) {
      var c = document.getElementById("conn");
      c.className = "stale"; c.textContent = "stale: " + err.message;
    }).then(function () { busy = false; });
  }
  setInterval(tick, %d);
})();
""" % REFRESH_MS


def _colour(participants: int, learners: int) -> str:
    """Green when every joined learner took part, amber when two or more did, red for one or none."""
    if learners > 0 and participants >= learners:
        return "#2e9d4f"
    if participants >= 2:
        return "#e0a526"
    return "#d0453f"


def _header(s: dict) -> str:
    shard, shards = s.get("shard", "?"), s.get("shards", "?")
    finished = bool(s.get("finished"))
    state = ('<span class="badge finished" id="finished">finished</span>' if finished
             else '<span class="badge running" id="finished">running</span>')
    return (
        f'<header id="header"><h1>diloco syncer · shard <span id="shard">{_e(shard)}</span>'
        f' of <span id="shards">{_e(shards)}</span></h1>'
        f'<span class="meta">strategy <b id="strategy">{_e(s.get("strategy", "?"))}</b></span>'
        f'<span class="meta">up <b id="uptime">{_e(_duration(s.get("uptime_s")))}</b></span>'
        f"{state}"
        f'<span class="meta" id="conn">live</span></header>'
    )


def _fragments(s: dict) -> str:
    versions = {str(k): v for k, v in (s.get("versions") or {}).items()}
    fragments = [str(f) for f in (s.get("fragments") or [])]
    for k in sorted(versions, key=_int_key):
        if k not in fragments:
            fragments.append(k)
    if not fragments:
        return '<section id="fragments"><h2>Fragments</h2><p class="muted">No fragments.</p></section>'
    head = "".join(f'<th class="num">{_e(f)}</th>' for f in fragments)
    cells = "".join(f'<td class="num">{_e(_num(versions.get(f)))}</td>' for f in fragments)
    return (
        '<section id="fragments"><h2>Fragments owned by this shard</h2><table>'
        f'<thead><tr><th>fragment</th>{head}</tr></thead>'
        f'<tbody><tr><th>version</th>{cells}</tr></tbody></table></section>'
    )


def _held(held: Any) -> str:
    if not isinstance(held, dict) or not held:
        return "—"
    return " ".join(f"{k}:{v}" for k, v in sorted(((str(k), v) for k, v in held.items()),
                                                    key=lambda kv: _int_key(kv[0])))


_MEMBERSHIP_COLUMNS = 11
_MERGED_UNIT = ("trained tokens whose progress this shard merged on time (merged) or in a later round (stale), "
                "each of its fragments weighted by its share of their parameters: the unit of tokens")
_NO_LEARNERS = f'<tr><td colspan="{_MEMBERSHIP_COLUMNS}" class="muted">No learners.</td></tr>'


def _learner_row(key: str, l: dict) -> str:
    """One learner's row of the membership table; missing fields show as a dash."""
    name = l.get("name") or f"learner {key}"
    state = l.get("state", "unknown")
    return (
        f'<tr class="learner" data-learner="{_e(key)}">'
        f'<td class="name">{_e(name)}</td>'
        f'<td class="host">{_e(l.get("host", "—"))}</td>'
        f'<td class="state"><span class="badge state-{_e(_slug(state))}">{_e(state)}</span></td>'
        f'<td class="num">{_e(_num(l.get("tokens")))}</td>'
        f'<td class="num">{_e(_num(l.get("steps")))}</td>'
        f'<td class="num">{_e(_num(l.get("pushes")))}</td>'
        f'<td class="num">{_e(_num(l.get("duplicates")))}</td>'
        f'<td class="num">{_e(_num(l.get("tokens_merged")))}</td>'
        f'<td class="num">{_e(_num(l.get("tokens_stale")))}</td>'
        f'<td class="num">{_e(_ago(l.get("last_seen_s")))}</td>'
        f'<td class="held">{_e(_held(l.get("held_versions")))}</td></tr>'
    )


def _region_groups(s: dict, keys: list[str]) -> list[tuple[dict, list[str]]]:
    """The snapshot's regions (in its order) with the keys of their learners; learners in no region (an
    elastic run's extras) last, under a group without a name. Empty without regions."""
    regions = [r for r in (s.get("regions") or []) if isinstance(r, dict)]
    if not regions:
        return []
    groups, placed = [], set()
    for region in regions:
        ids = {str(m) for m in (region.get("learners") or [])}
        mine = [k for k in keys if k in ids and k not in placed]
        placed.update(mine)
        groups.append((region, mine))
    rest = [k for k in keys if k not in placed]
    return groups + ([({}, rest)] if rest else [])


def _region_heading(region: dict, count: int) -> str:
    """A group's first row: the region's name, `syncer` on the syncer's region, how many learners."""
    name = region.get("name")
    title = _e(name) if name is not None else '<span class="muted">no region</span>'
    syncer = ' <span class="badge syncer">syncer</span>' if region.get("syncer") else ""
    return (f'<tr class="region-heading"><th colspan="{_MEMBERSHIP_COLUMNS}">{title}{syncer} '
            f'<span class="muted">{count} learner{"s" if count != 1 else ""}</span></th></tr>')


def _membership(s: dict) -> str:
    """One row per learner; with regions, grouped under their region, each group its own `tbody`."""
    learners = s.get("learners") or {}
    keys = sorted(learners, key=_int_key)
    groups = _region_groups(s, keys)
    if groups:
        body = "".join(
            f'<tbody class="region" data-region="{_e(region.get("name", ""))}">{_region_heading(region, len(mine))}'
            + "".join(_learner_row(k, learners[k] or {}) for k in mine) + "</tbody>"
            for region, mine in groups)
    else:
        rows = "".join(_learner_row(k, learners[k] or {}) for k in keys)
        body = f"<tbody>{rows or _NO_LEARNERS}</tbody>"
    return (
        '<section><h2>Membership</h2><table id="membership">'
        "<thead><tr><th>learner</th><th>host</th><th>state</th><th class=num>tokens</th>"
        "<th class=num>steps</th><th class=num>pushes</th><th class=num>duplicates</th>"
        "<th class=num>tokens merged</th><th class=num>tokens stale</th><th class=num>last seen</th>"
        "<th>held versions</th></tr></thead>"
        f'{body}</table><p class="muted">tokens merged, tokens stale: {_MERGED_UNIT}.</p></section>'
    )


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


def _timeline(s: dict) -> str:
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
    uptime = _float(s.get("uptime_s"))
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
        opened = _float(r.get("opened_at"))
        closed = _float(r.get("closed_at"))
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
                     f"fragment {_e(f)}</text>")
        parts.append(f'<line class="axis" x1="{_SVG_LEFT}" x2="{_SVG_WIDTH - _SVG_RIGHT}" '
                     f'y1="{y + _SVG_ROW_H - 4:.1f}" y2="{y + _SVG_ROW_H - 4:.1f}"/>')
    for t in ticks:
        parts.append(f'<line class="axis" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{_SVG_TOP}" y2="{axis_y + 4}"/>')
        parts.append(f'<text x="{x(t):.1f}" y="{axis_y + 18}" text-anchor="middle">{_e(_num(round(t, 2)))} s</text>')
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
    bar = (f'<g class="round-bar" data-fragment="{_e(frag)}" data-version="{_e(r.get("version", ""))}" '
           f'data-participants="{count}"><title>{_e(tip)}</title>'
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
        f'<span id="rounds-shown">{_e(counted)}</span>'
        '<span><i class="swatch" style="background:#2e9d4f"></i>all joined learners</span>'
        '<span><i class="swatch" style="background:#e0a526"></i>some</span>'
        '<span><i class="swatch" style="background:#d0453f"></i>one or none</span>'
        "<span>bar label: participants; hover for details</span></p>"
    )


def render_content(snapshot: dict) -> str:
    """The part of the page that the refresh script replaces: `<div id="content">…</div>`."""
    s = snapshot if isinstance(snapshot, dict) else {}
    return (f'<div id="content">{_header(s)}<main>{_membership(s)}{_timeline(s)}{_fragments(s)}'
            "</main></div>")


def render_page(snapshot: dict) -> str:
    """The whole self-contained page for one snapshot."""
    s = snapshot if isinstance(snapshot, dict) else {}
    title = f"diloco syncer shard {s.get('shard', '?')} of {s.get('shards', '?')}"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<noscript><meta http-equiv="refresh" content="{FALLBACK_REFRESH_S}"></noscript>'
        f"<title>{_e(title)}</title><style>{STYLE}</style></head>"
        f'<body data-refreshes="0">{render_content(s)}<script>{SCRIPT}</script></body></html>\n'
    )
