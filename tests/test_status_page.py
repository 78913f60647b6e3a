"""The syncer's status page: the HTML renderer, its HTTP server, and the page in a real headless Chromium."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pytest

from diloco.status.page import TIMELINE_ROUNDS, render_page
from diloco.status.status_server import StatusServer

CHROMIUM = "/usr/bin/chromium"
HOSTILE = "<script>alert(1)</script>"


def learner(i: int, **over) -> dict:
    entry = {"name": f"learner {i}", "host": "vm", "state": "training", "tokens": 1000 * i + 5, "steps": 12,
             "pushes": 3, "duplicates": 0, "tokens_merged": 900, "tokens_stale": 100, "last_seen_s": 0.4,
             "held_versions": {"0": 5, "1": 4}}
    entry.update(over)
    return entry


def snapshot(n_learners: int = 3, n_rounds: int = 4, **over) -> dict:
    rounds = [{"fragment": k % 2, "version": k // 2 + 1, "opened_at": 1.0 + 0.5 * k, "closed_at": 1.3 + 0.5 * k,
               "participants": list(range(1 + k % n_learners)) if n_learners else [], "stale": k % 2,
               "held_s": 0.2} for k in range(n_rounds)]
    snap = {"shard": 0, "shards": 1, "strategy": "decoupled", "uptime_s": 12.3, "finished": False,
            "fragments": [0, 1], "versions": {"0": 5, "1": 4},
            "learners": {str(i): learner(i) for i in range(n_learners)}, "rounds": rounds}
    snap.update(over)
    return snap


class Membership(HTMLParser):
    """Collects the name cell of every `tr.learner` inside `table#membership`."""

    def __init__(self) -> None:
        super().__init__()
        self.in_table = self.in_name = False
        self.names: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id") == "membership":
            self.in_table = True
        elif self.in_table and tag == "td" and "name" in (a.get("class") or "").split():
            self.in_name = True
            self.names.append("")

    def handle_endtag(self, tag):
        if tag == "table":
            self.in_table = False
        elif tag == "td":
            self.in_name = False

    def handle_data(self, data):
        if self.in_name:
            self.names[-1] += data


def learner_names(page: str) -> list[str]:
    p = Membership()
    p.feed(page)
    return p.names


# ------------------------------------------------------------------ render_page


def test_page_lists_learners_by_name_in_the_membership_table():
    page = render_page(snapshot(3))
    assert page.startswith("<!DOCTYPE html>")
    assert learner_names(page) == ["learner 0", "learner 1", "learner 2"]
    assert page.count('class="learner"') == 3
    assert 'id="membership"' in page and "decoupled" in page and "running" in page
    assert "http://" not in page and "https://" not in page  # self-contained: no external assets
    assert '<meta http-equiv="refresh" content="5">' in page  # the no-script fallback


def test_learners_sort_numerically_and_tolerate_missing_fields():
    snap = snapshot(0, 0, learners={"10": {"state": "not joined"}, "2": learner(2), "9": {}}, finished=True)
    page = render_page(snap)
    assert learner_names(page) == ["learner 2", "learner 9", "learner 10"]
    assert "finished" in page and "state-not-joined" in page
    render_page({})  # a bare snapshot still renders


def test_every_snapshot_string_is_escaped():
    snap = snapshot(2, 3, strategy=HOSTILE)
    snap["learners"]["1"].update(host=HOSTILE, name='learner "1" <b>', state=HOSTILE)
    page = render_page(snap)
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>" not in page
    assert page.count("<script>") == 1  # only the page's own refresh script


def test_empty_rounds_show_a_note_instead_of_a_timeline():
    page = render_page(snapshot(2, 0))
    assert 'id="timeline"' in page and "No rounds yet" in page
    assert "<svg" not in page


def test_timeline_shows_one_bar_per_round_with_participants_in_the_tooltip():
    page = render_page(snapshot(3, 4))
    assert page.count('class="round-bar"') == 4
    titles = re.findall(r"<title>([^<]*)</title>", page)[1:]  # [0] is the document's title
    assert len(titles) == 4
    assert "participants (3): learner 0, learner 1, learner 2" in titles[2]


def test_many_rounds_are_truncated_to_the_most_recent():
    snap = snapshot(3, 300)
    page = render_page(snap)
    assert page.count('class="round-bar"') == TIMELINE_ROUNDS
    assert f"the last {TIMELINE_ROUNDS} of 300 rounds" in page
    assert 'data-version="150"' in page  # the last round
    assert 'data-version="1"' not in page  # the first ones are gone
    assert len(page) < 200_000


def test_an_open_round_is_drawn_up_to_now():
    snap = snapshot(2, 1)
    snap["rounds"][0]["closed_at"] = None
    page = render_page(snap)
    assert "still open" in page and 'class="round open"' in page


# ------------------------------------------------------------------ StatusServer


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


@pytest.fixture
def served():
    """A server over a snapshot the test can change (or make raise) through `state`."""
    state = {"snap": snapshot(3), "fail": False}

    def snap():
        if state["fail"]:
            raise RuntimeError("shard lock poisoned")
        return state["snap"]

    server = StatusServer(snap)
    yield server, state
    server.close()


@pytest.mark.integration  # a live HTTP server
def test_server_serves_the_page_and_the_snapshot_as_json(served, capfd):
    server, state = served
    code, ctype, body = get(f"http://{server.address}/status.json")
    assert code == 200 and ctype.startswith("application/json")
    assert json.loads(body) == state["snap"]
    code, ctype, body = get(f"http://{server.address}/?x=1")
    assert code == 200 and ctype.startswith("text/html")
    assert learner_names(body) == ["learner 0", "learner 1", "learner 2"]
    assert capfd.readouterr().err == ""  # no line per request


@pytest.mark.integration  # a live HTTP server
def test_unknown_path_is_404(served):
    server, _ = served
    assert get(f"http://{server.address}/nope")[0] == 404
    assert get(f"http://{server.address}/status.json/x")[0] == 404


@pytest.mark.integration  # a live HTTP server
def test_a_failing_snapshot_is_a_500_and_the_server_keeps_serving(served):
    server, state = served
    state["fail"] = True
    for path in ("/", "/status.json"):
        code, _, body = get(f"http://{server.address}{path}")
        assert code == 500 and "shard lock poisoned" in body and len(body) < 400
    state["fail"] = False
    assert get(f"http://{server.address}/status.json")[0] == 200


@pytest.mark.integration  # a live HTTP server
def test_close_frees_the_port_and_is_idempotent():
    server = StatusServer(lambda: {})
    address = server.address
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address) and not address.endswith(":0")
    server.close()
    server.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{address}/", timeout=2)


# ------------------------------------------------------------------ a real browser


def dump_dom(url: str, tmp_path, budget_ms: int = 3000) -> str:
    """The DOM headless Chromium holds after `budget_ms` of virtual time (timers run, the clock doesn't wait)."""
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
           "--dump-dom", url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: Chromium's helpers go with it
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-2000:]
    return out


needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is missing: run `make test`, which installs Chromium (apt-get install -y chromium)",
)


@pytest.mark.integration  # a live HTTP server
@needs_chromium
def test_page_in_headless_chromium_shows_learners_and_refreshes_itself(tmp_path):
    first = snapshot(3)
    first["learners"]["2"]["host"] = "<img src=x onerror=alert(1)>"
    state = {"serve": lambda: first, "calls": 0}

    def snap():
        state["calls"] += 1
        return state["serve"]()

    with StatusServer(snap) as server:
        # 1. The page as loaded: three learners in the table; the refresh script ran and kept them.
        dom = dump_dom(f"http://{server.address}/", tmp_path)
        assert learner_names(dom) == ["learner 0", "learner 1", "learner 2"]
        assert re.search(r'<body data-refreshes="[1-9]', dom), "the refresh script did not run"
        assert "<img" not in dom and "&lt;img src=x" in dom

        # 2. A fourth learner joins right after the page is served: only the self-refresh can show it.
        joined_at = state["calls"] + 1
        state["serve"] = lambda: snapshot(3) if state["calls"] <= joined_at else snapshot(4)
        dom = dump_dom(f"http://{server.address}/", tmp_path)
        assert state["calls"] > joined_at, "the page never fetched itself again"
        assert learner_names(dom) == ["learner 0", "learner 1", "learner 2", "learner 3"]
        assert 'id="conn">live<' in dom


# ------------------------------------------------------------------ regions


def test_with_regions_learners_are_grouped_under_their_region():
    regions = [{"name": "us-east", "syncer": True, "learners": [0, 1]}, {"name": "eu-west", "learners": [2, 3]},
               {"name": HOSTILE, "learners": []}]
    page = render_page(snapshot(5, regions=regions))
    groups = re.findall(r'<tbody class="region" data-region="([^"]*)">(.*?)</tbody>', page)
    assert [(name, re.findall(r'<td class="name">([^<]*)</td>', body)) for name, body in groups] == [
        ("us-east", ["learner 0", "learner 1"]), ("eu-west", ["learner 2", "learner 3"]),
        ("&lt;script&gt;alert(1)&lt;/script&gt;", []),
        ("", ["learner 4"])]  # an elastic run's extra learner is in no region: listed last
    assert ['class="badge syncer"' in body for _, body in groups] == [True, False, False, False]
    assert ">us-east <" in groups[0][1] and "2 learners" in groups[0][1] and "no region" in groups[3][1]
    assert learner_names(page) == [f"learner {i}" for i in range(5)]
    assert HOSTILE not in page


def test_without_regions_the_membership_table_is_unchanged():
    from diloco.status.page import render_content

    plain = render_content(snapshot(3))
    assert render_content(snapshot(3, regions=[])) == plain
    assert 'class="region' not in plain and "<tbody><tr class=\"learner\" data-learner=\"0\">" in plain
    assert learner_names(plain) == ["learner 0", "learner 1", "learner 2"]


def test_the_snapshot_groups_by_the_configs_regions():
    from pathlib import Path
    from types import SimpleNamespace

    from diloco.config import Config, load_config
    from diloco.shard.snapshot import region_groups, snapshot_regions

    config = load_config(Path(__file__).resolve().parents[1] / "examples" / "regions.toml")
    assert region_groups(config) == [
        {"name": "us-east", "syncer": True, "learners": [0, 1]},
        {"name": "us-west", "syncer": False, "learners": [2, 3]},
        {"name": "eu-west", "syncer": False, "learners": [4, 5]},
        {"name": "ap-south", "syncer": False, "learners": [6, 7]}]
    assert region_groups(Config()) == []
    assert snapshot_regions(SimpleNamespace(config=config, tier=None)) == region_groups(config)
    # The regional tier: a region's syncer shows its own region; the global syncer's members are regions' syncers.
    config.topology = "regional"
    assert snapshot_regions(SimpleNamespace(config=config, tier=SimpleNamespace(name="eu-west"))) == \
        [{"name": "eu-west", "syncer": False, "learners": [4, 5]}]
    assert snapshot_regions(SimpleNamespace(config=config, tier=None)) == []


def test_the_membership_counts_merged_tokens_once_per_learner_in_the_unit_of_its_trained_tokens():
    """A learner's pushes of every fragment each carry the tokens it trained since that fragment's last
    push: summed over fragments they would count each trained token once per fragment (444,416 trained
    showed as 1,452,032 merged). The page shows them weighted by the fragments' sizes, beside `tokens`."""
    import torch

    from conftest import tiny_config
    from diloco.clock import ManualClock
    from diloco.core.events import HeartbeatArrived
    from diloco.fragments import Fragment
    from diloco.shard.server import ShardPlan, SyncerShard
    from diloco.shard.snapshot import snapshot as shard_snapshot

    clock = ManualClock()
    shard = SyncerShard(tiny_config("learners.count=2", "outer.fragments=4"), ShardPlan(0, 1, ("",)), clock=clock)
    sizes = (1, 1, 2, 4)
    fragments = [Fragment(p, (f"w{p}",), n, False) for p, n in enumerate(sizes)]
    with shard.lock:
        shard.core = shard._make_core({f"w{p}": torch.zeros(n) for p, n in enumerate(sizes)}, fragments, set())
        shard.joined |= {0, 1}
        shard.apply(HeartbeatArrived(0, step=10, tokens=640), clock.now())
        entry = shard.core.ledger[0]
        for p in range(4):  # every fragment merged what learner 0 trained, one of them half of it stale
            entry.merged[p], entry.stale[p] = (640, 0) if p != 3 else (320, 320)
        row = shard_snapshot(shard)["learners"]["0"]
    assert row["tokens"] == 640
    assert row["tokens_merged"] + row["tokens_stale"] == row["tokens"]  # not 4 x 640
    assert (row["tokens_merged"], row["tokens_stale"]) == (640 - 320 * 4 // 8, 320 * 4 // 8)
    page = render_page(shard_snapshot(shard))
    assert "tokens merged" in page and "weighted by" in page  # the header says what the column counts
