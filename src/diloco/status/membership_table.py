"""The status page's membership table: one row per learner (grouped under its region when the snapshot
has regions), with what the shard counted from it."""

from __future__ import annotations

from typing import Any

from diloco.status.html_text import ago, esc, int_key, number, slug


def _held(held: Any) -> str:
    if not isinstance(held, dict) or not held:
        return "—"
    return " ".join(f"{k}:{v}" for k, v in sorted(((str(k), v) for k, v in held.items()),
                                                    key=lambda kv: int_key(kv[0])))


_MEMBERSHIP_COLUMNS = 11
_MERGED_UNIT = ("trained tokens whose progress this shard merged on time (merged) or in a later round (stale), "
                "each of its fragments weighted by its share of their parameters: the unit of tokens")
_NO_LEARNERS = f'<tr><td colspan="{_MEMBERSHIP_COLUMNS}" class="muted">No learners.</td></tr>'


def _learner_row(key: str, l: dict) -> str:
    """One learner's row of the membership table; missing fields show as a dash."""
    name = l.get("name") or f"learner {key}"
    state = l.get("state", "unknown")
    return (
        f'<tr class="learner" data-learner="{esc(key)}">'
        f'<td class="name">{esc(name)}</td>'
        f'<td class="host">{esc(l.get("host", "—"))}</td>'
        f'<td class="state"><span class="badge state-{esc(slug(state))}">{esc(state)}</span></td>'
        f'<td class="num">{esc(number(l.get("tokens")))}</td>'
        f'<td class="num">{esc(number(l.get("steps")))}</td>'
        f'<td class="num">{esc(number(l.get("pushes")))}</td>'
        f'<td class="num">{esc(number(l.get("duplicates")))}</td>'
        f'<td class="num">{esc(number(l.get("tokens_merged")))}</td>'
        f'<td class="num">{esc(number(l.get("tokens_stale")))}</td>'
        f'<td class="num">{esc(ago(l.get("last_seen_s")))}</td>'
        f'<td class="held">{esc(_held(l.get("held_versions")))}</td></tr>'
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
    title = esc(name) if name is not None else '<span class="muted">no region</span>'
    syncer = ' <span class="badge syncer">syncer</span>' if region.get("syncer") else ""
    return (f'<tr class="region-heading"><th colspan="{_MEMBERSHIP_COLUMNS}">{title}{syncer} '
            f'<span class="muted">{count} learner{"s" if count != 1 else ""}</span></th></tr>')


def membership_section(s: dict) -> str:
    """One row per learner; with regions, grouped under their region, each group its own `tbody`."""
    learners = s.get("learners") or {}
    keys = sorted(learners, key=int_key)
    groups = _region_groups(s, keys)
    if groups:
        body = "".join(
            f'<tbody class="region" data-region="{esc(region.get("name", ""))}">{_region_heading(region, len(mine))}'
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
