"""The regional tier in the real runtime: `diloco syncer --region NAME --upstream ADDR` between a region's
learners and the global syncer, started by `diloco run`, every token accounted through both tiers, and a
regional outage (the region's syncer and learners killed, then started again) survived."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TINY
from diloco.core.accounting import learner_tokens, ledger_of

REGIONS = ('regions=[{name = "us", syncer = true, speeds = [1, 1], lan = {bandwidth_mbit = 10000, latency_ms = 1}, '
           'wan = {bandwidth_mbit = 100, latency_ms = 20}}, {name = "eu", speeds = [1, 1], '
           'lan = {bandwidth_mbit = 10000, latency_ms = 1}, wan = {bandwidth_mbit = 100, latency_ms = 30}}]')
BASE = [*TINY, REGIONS, "train.tokens=24576", "learners.step_time_s=0.05"]


def run(tmp_path, *overrides: str) -> dict:
    args = [x for o in [*BASE, *overrides] for x in ("--set", o)]
    done = subprocess.run([sys.executable, "-m", "diloco", "run", *args, "--out", str(tmp_path), "-q"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]  # the error names an unfinished syncer and its log's end
    return json.loads((tmp_path / "summary.json").read_text())


def accounted(tmp_path) -> dict[int, dict[str, float]]:
    """Per learner: trained (every life) against what its region's syncer merged, on time or stale."""
    regions = json.loads((tmp_path / "syncer" / "regions.json").read_text())
    shards = json.loads((tmp_path / "syncer" / "shards.json").read_text())
    numel = {int(p): n for s in shards for p, n in s["fragment_numel"].items()}
    summary = json.loads((tmp_path / "summary.json").read_text())
    return {r["learner"]: learner_tokens(r["tokens"], *ledger_of(regions, r["learner"]), numel)
            for r in summary["per_learner"]}


@pytest.mark.integration
def test_a_regional_run_sends_one_regions_progress_over_its_wan_link_and_accounts_every_token(tmp_path):
    summary = run(tmp_path, "topology=regional")
    regions = json.loads((tmp_path / "syncer" / "regions.json").read_text())
    assert [r["region"] for r in regions] == ["us", "eu"]
    eu = next(r for r in regions if r["region"] == "eu")
    wan = [e for e in summary["links"] if e["kind"] == "wan"]
    # The WAN link carries the eu syncer's traffic, as its uplink counted it; learners stay on their LANs.
    assert [(e["name"], e["bytes_up"], e["bytes_down"]) for e in wan] == \
        [("eu→us (WAN)", eu["uplink"]["bytes_up"], eu["uplink"]["bytes_down"])]
    lan = {e["name"]: e["bytes_up"] + e["bytes_down"] for e in summary["links"] if e["kind"] == "lan"}
    own = {r["learner"]: r["bytes_up"] + r["bytes_down"] for r in summary["per_learner"]}
    assert lan == {f"learner {m} LAN": own[m] for m in range(4)}
    eu_learners = own[2] + own[3]
    assert 0 < summary["wan_bytes"] < eu_learners  # flat, both learners' traffic would cross it
    # Every token: merged by the region (sent up) or lost, none twice, no retry counted twice.
    for m, tokens in accounted(tmp_path).items():
        assert tokens["counted_twice"] == 0, m
        assert tokens["lost"] == 0, m
    assert summary["duplicates"] == 0
    assert summary["tokens"] >= 24576
    # The global syncer's learners are the regions: each region's tokens came up as its own.
    shards = json.loads((tmp_path / "syncer" / "shards.json").read_text())
    assert sorted(int(m) for m in shards[0]["ledger"]) == [0, 1]


@pytest.mark.integration
def test_a_regional_outage_kills_the_regions_syncer_and_learners_and_the_run_goes_on(tmp_path):
    summary = run(tmp_path, "topology=regional", "train.tokens=153600", "metrics.every_steps=1",
                  'failures.outages=[{region = "eu", at_s = 2, duration_s = 2}]')
    (outage,) = summary["outages"]
    assert outage["region"] == "eu" and outage["killed"] == ["region-eu", "learner-2", "learner-3"]
    assert outage["back_s"] > outage["at_s"]
    tokens = accounted(tmp_path)
    assert all(t["counted_twice"] == 0 for t in tokens.values())
    by_learner = {r["learner"]: r for r in summary["per_learner"]}
    # the other region lost nothing; this failed twice in ~50 runs (s60) and never since: should it again,
    # its message holds what the run's files would show (each fragment's ledger against the tokens trained)
    regions = json.loads((tmp_path / "syncer" / "regions.json").read_text())
    assert tokens[0]["lost"] == tokens[1]["lost"] == 0, (
        tokens, {m: (ledger_of(regions, m), by_learner[m]) for m in (0, 1)})
    assert by_learner[2]["crashes"] == by_learner[3]["crashes"] == 1
    assert summary["duplicates"] == 0


@pytest.mark.integration  # three `diloco syncer` processes (in this process its signal handlers and
# parent-death signal would outlive the test)
def test_a_regions_syncer_needs_its_upstream_and_a_region_with_learners(tmp_path):
    def syncer(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "diloco", "syncer", *args], capture_output=True, text=True,
                              timeout=60)
    lonely = syncer("--set", "topology=regional", "--set", REGIONS, "--region", "eu")
    assert lonely.returncode != 0 and "--region and --upstream go together" in lonely.stderr
    nowhere = syncer("--set", "topology=regional", "--set", REGIONS, "--region", "mars", "--upstream", "127.0.0.1:1")
    assert nowhere.returncode != 0 and "--region 'mars' is not a region with learners (us, eu)" in nowhere.stderr
    flat = syncer("--set", REGIONS, "--region", "eu", "--upstream", "127.0.0.1:1")
    assert flat.returncode != 0 and 'needs topology = "regional"' in flat.stderr
