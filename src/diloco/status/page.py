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

from diloco.status.html_text import duration, esc, int_key, number
from diloco.status.membership_table import membership_section
from diloco.status.timeline import TIMELINE_ROUNDS, timeline_section

__all__ = ["TIMELINE_ROUNDS", "render_content", "render_page"]

REFRESH_MS = 2000
FALLBACK_REFRESH_S = 5


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


def _header(s: dict) -> str:
    shard, shards = s.get("shard", "?"), s.get("shards", "?")
    finished = bool(s.get("finished"))
    state = ('<span class="badge finished" id="finished">finished</span>' if finished
             else '<span class="badge running" id="finished">running</span>')
    return (
        f'<header id="header"><h1>diloco syncer · shard <span id="shard">{esc(shard)}</span>'
        f' of <span id="shards">{esc(shards)}</span></h1>'
        f'<span class="meta">strategy <b id="strategy">{esc(s.get("strategy", "?"))}</b></span>'
        f'<span class="meta">up <b id="uptime">{esc(duration(s.get("uptime_s")))}</b></span>'
        f"{state}"
        f'<span class="meta" id="conn">live</span></header>'
    )


def _fragments(s: dict) -> str:
    versions = {str(k): v for k, v in (s.get("versions") or {}).items()}
    fragments = [str(f) for f in (s.get("fragments") or [])]
    for k in sorted(versions, key=int_key):
        if k not in fragments:
            fragments.append(k)
    if not fragments:
        return '<section id="fragments"><h2>Fragments</h2><p class="muted">No fragments.</p></section>'
    head = "".join(f'<th class="num">{esc(f)}</th>' for f in fragments)
    cells = "".join(f'<td class="num">{esc(number(versions.get(f)))}</td>' for f in fragments)
    return (
        '<section id="fragments"><h2>Fragments owned by this shard</h2><table>'
        f'<thead><tr><th>fragment</th>{head}</tr></thead>'
        f'<tbody><tr><th>version</th>{cells}</tr></tbody></table></section>'
    )



def render_content(snapshot: dict) -> str:
    """The part of the page that the refresh script replaces: `<div id="content">…</div>`."""
    s = snapshot if isinstance(snapshot, dict) else {}
    return (f'<div id="content">{_header(s)}<main>{membership_section(s)}{timeline_section(s)}{_fragments(s)}'
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
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>"
        f'<body data-refreshes="0">{render_content(s)}<script>{SCRIPT}</script></body></html>\n'
    )
