"""The links table of a run with regions: what each WAN and LAN link carried and how busy it was, with totals.

Read from summary.json's `links` (both drivers write them, `results.link_entry`); a run without regions has
none, and gets no table. A link's `up` is the way its name points: a LAN link's and a region's WAN link to
the syncer's region towards the syncer; with `placement = "links"` a WAN link may join any two regions, and
its `up` is then from the first region named to the second (`A→B (WAN)`: bytes up A→B, bytes down B→A).
"""

from __future__ import annotations

from typing import Any, Literal

from diloco.report.run_records import number
from diloco.report.table import MISSING, markdown_row
from diloco.results import human_bytes

LinkKind = Literal["wan", "lan"]
KIND_TITLES: dict[LinkKind, str] = {"wan": "WAN", "lan": "LAN"}
"""The kinds in table order: WAN first, the scarce links."""
COLUMNS = ("bytes up", "bytes down", "bytes up+down", "busy up", "busy down")


def summary_links(summary: dict[str, Any], kind: LinkKind) -> list[dict[str, Any]]:
    """The summary's links of one kind, in its order; entries that are not links are skipped."""
    return [e for e in summary.get("links") or [] if isinstance(e, dict) and e.get("kind") == kind]


def link_bytes(entry: dict[str, Any]) -> tuple[int, int]:
    """(the way the link's name points, back): a missing count is 0, as a link that carried nothing."""
    return int(number(entry, "bytes_up") or 0), int(number(entry, "bytes_down") or 0)


def total_bytes(links: list[dict[str, Any]]) -> tuple[int, int]:
    """Bytes up and down summed over links: a kind's total is the summary's `wan_bytes` or `lan_bytes`."""
    counts = [link_bytes(e) for e in links]
    return sum(up for up, _ in counts), sum(down for _, down in counts)


def busy_share(entry: dict[str, Any], direction: Literal["up", "down"]) -> str | None:
    """A direction's share of the run spent carrying bytes, as a percentage; None where it was not
    measured (a real run's links)."""
    share = number(entry, f"utilisation_{direction}")
    if share is None:
        return None
    percent = 100 * share
    return "<0.1%" if 0 < percent < 0.1 else f"{percent:.1f}%"


def links_table(summary: dict[str, Any]) -> str | None:
    """A markdown table per kind, WAN then LAN: one row per link and a total row; None without links."""
    tables = [_kind_table(KIND_TITLES[kind], links) for kind in KIND_TITLES if (links := summary_links(summary, kind))]
    return "\n\n".join(tables) or None


def _kind_table(title: str, links: list[dict[str, Any]]) -> str:
    lines = [markdown_row([f"{title} link", *COLUMNS]), markdown_row(["---"] + ["---:"] * len(COLUMNS))]
    for entry in links:
        up, down = link_bytes(entry)
        lines.append(markdown_row([entry.get("name", MISSING), *_byte_cells(up, down),
                                   busy_share(entry, "up") or MISSING, busy_share(entry, "down") or MISSING]))
    lines.append(markdown_row(["total", *_byte_cells(*total_bytes(links)), "", ""]))
    return "\n".join(lines)


def _byte_cells(up: int, down: int) -> list[str]:
    return [human_bytes(up), human_bytes(down), human_bytes(up + down)]
