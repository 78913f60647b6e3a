"""benchmarks/scale.py stays runnable: its layout, its window accounting and its targets, and one tiny run
end to end (a real shard, one synthetic learner, the socket baseline) that writes the JSON the lead's
checks read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import scale  # noqa: E402  (the benchmark itself)
import scale_model  # noqa: E402
import scale_report  # noqa: E402
import scale_worker  # noqa: E402


def test_layout_splits_params_into_fragments_and_bounded_tensors():
    layout = scale_model.model_layout(10_000_003, 4, 1_000_000)
    assert len(layout) == 4
    assert sum(t.numel for f in layout for t in f) == 10_000_003
    assert all(t.numel <= 1_000_000 for f in layout for t in f)
    assert len({t.name for f in layout for t in f}) == sum(len(f) for f in layout)
    assert scale_model.shard_fragments(5, 2) == [[0, 2, 4], [1, 3]]


def test_a_push_counts_by_its_overlap_with_the_window():
    assert scale_worker.overlap(0.0, 2.0, 1.0, 5.0) == pytest.approx(0.5)
    assert scale_worker.overlap(2.0, 3.0, 1.0, 5.0) == 1.0
    assert scale_worker.overlap(5.5, 6.0, 1.0, 5.0) == 0.0
    assert scale.count("20M") == 20_000_000 and scale.count("1B") == 10**9 and scale.count("1e6") == 10**6


def test_targets_compare_runs_that_differ_only_in_learners():
    def run(learners, rss, push, pull, ratio):
        return {"params": 10**8, "shards": 1, "codec": "int4", "down_codec": "int4", "fragments": 4,
                "learners": learners, "status": "ok", "rss_bytes": rss, "push_mb_s": push, "pull_mb_s": pull,
                "push_vs_socket": ratio}

    rows = scale_report.targets([run(1, 100, 10.0, 10.0, 0.6), run(8, 110, 40.0, 20.0, 0.9), run(16, 130, 50.0, 25.0, 0.9)])
    by = {r["measure"]: r for r in rows}
    assert by["syncer RSS, 16 learners / 1 learner"]["value"] == pytest.approx(1.3)
    assert by["syncer RSS, 16 learners / 1 learner"]["met"] is False
    assert by["push MB/s of one shard (1 learner) / plain socket"]["met"] is True
    assert by["a shard's push MB/s, 8 learners / 1 learner"]["met"] is True
    assert by["a shard's pull MB/s, 8 learners / 1 learner"]["met"] is False


@pytest.mark.integration
def test_a_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "scale.json"
    code = scale.main(["--params", "1M", "--learners", "1", "--shards", "1", "--seconds", "1", "--warmup", "0.5",
                       "--socket-seconds", "0.5", "--min-free-gib", "0.5", "--profile", "--json", str(out)])
    assert code == 0
    runs = json.loads(out.read_text())
    assert len(runs) == 1
    run = runs[0]
    assert run["status"] == "ok", run["reason"]
    assert not run["problems"], run["problems"]
    for key in ("params", "learners", "shards", "rss_bytes", "push_mb_s", "pull_mb_s", "socket_mb_s"):
        assert run[key], key
    assert (run["params"], run["learners"], run["shards"]) == (1_000_000, 1, 1)
    shard = run["per_shard"][0]
    assert shard["pushes"] > 0 and shard["answers"] > 0 and shard["refused"] == 0
    assert shard["latency_median_s"] > 0 and shard["rounds_per_s"] > 0
    assert 0.5 <= shard["pushes_per_round"] <= 1.5  # one learner at quorum 1: each push closes its own round
    profile = shard["cpu_profile"]  # --profile: the window's CPU by frame, the merge's among them
    assert 0 < profile["cpu_s"] and sum(share for _, share in profile["leaf"]) == pytest.approx(1.0, abs=1e-3)
    assert any(name == "syncer_core.py:handle" for name, _ in profile["inclusive"])


@pytest.mark.integration
def test_a_push_rate_spaces_the_pushes_so_the_shard_is_not_saturated(tmp_path):
    """`--push-rate R`: each learner sends R pushes a second, however fast the shard takes them."""
    out = tmp_path / "scale.json"
    code = scale.main(["--params", "1M", "--learners", "1", "--shards", "1", "--seconds", "2", "--warmup", "0.5",
                       "--min-pushes", "1", "--push-rate", "4", "--socket-seconds", "0.2", "--joins", "1",
                       "--min-free-gib", "0.5", "--json", str(out)])
    assert code == 0
    (run,) = json.loads(out.read_text())
    assert run["status"] == "ok", run["reason"]
    assert run["push_rate"] == 4
    window = run["per_shard"][0]
    assert window["cpu_profile"] is None  # not asked for
    assert 4 <= window["pushes"] <= 4 * 3 + 1  # about 8 in 2 s; unpaced, ~400 of 1M parameters go in 2 s here


@pytest.mark.integration
def test_paced_learners_push_on_the_syncers_grid_so_rounds_gather_them(tmp_path):
    """`--paced`: each learner pushes a fragment when its last answer said (the pacing grid, one period of
    H steps apart) and reports when each is due, as a paced learner does, so rounds gather the learners."""
    out = tmp_path / "scale.json"
    code = scale.main(["--params", "1M", "--learners", "4", "--shards", "1", "--seconds", "3", "--warmup", "1",
                       "--min-pushes", "1", "--paced", "--socket-seconds", "0.2", "--joins", "1",
                       "--min-free-gib", "0.5", "--json", str(out)])
    assert code == 0
    (run,) = json.loads(out.read_text())
    assert run["status"] == "ok", run["reason"]
    assert not run["problems"], run["problems"]
    window = run["per_shard"][0]
    assert window["refused"] == 0
    period = 50 * scale_model.STEP_TIME_S  # outer.H steps of the learners' claimed step time
    # each learner pushes each of the 4 fragments once a period; as fast as the shard takes them would be
    # hundreds of pushes of 1M parameters a second
    assert window["pushes"] <= 4 * 4 * (run["seconds"] / period + 2)
    assert window["pushes_per_round"] >= 2.5  # most rounds gather all four learners


@pytest.mark.integration
def test_a_sink_answers_each_push_with_a_difference_of_a_pushs_size(tmp_path):
    """`--sink`: no round moves the fragment, yet each push is answered as after a round, with one encoded
    difference (the size of a push), not with the fragment whole in fp32 (7x that with int4)."""
    out = tmp_path / "scale.json"
    code = scale.main(["--params", "1M", "--learners", "1", "--shards", "1", "--seconds", "1", "--warmup", "0.5",
                       "--sink", "--socket-seconds", "0.2", "--joins", "1", "--min-free-gib", "0.5",
                       "--json", str(out)])
    assert code == 0
    (run,) = json.loads(out.read_text())
    assert run["status"] == "ok", run["reason"]
    window = run["per_shard"][0]
    assert window["answers"] > 10 and window["refused"] == 0
    bytes_per_answer = window["pull_mb_s"] * scale_model.MB * run["seconds"] / window["answers"]
    assert bytes_per_answer == pytest.approx(run["message_bytes"], rel=0.2)
