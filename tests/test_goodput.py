"""Tests of the datacenter-scale goodput model (`diloco goodput`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from diloco.errors import DilocoError
from diloco.goodput import GoodputParams, Policy, calibrate, data_parallel_closed_form, simulate, sweep
from diloco.goodput.goodput_cli import add_arguments, run
from diloco.goodput.engine import durable_work
from diloco.goodput.params import CALIBRATED_RESTART_S
from diloco.goodput.policies import checkpoint_interval

DP = Policy("data-parallel")
ELASTIC = Policy("elastic")


def decoupled(m: int) -> Policy:
    return Policy("decoupled", m)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="diloco goodput")
    add_arguments(parser)
    return parser.parse_args(list(argv))


# --- the model -----------------------------------------------------------------------------


def test_no_failures_gives_full_goodput() -> None:
    params = GoodputParams(mtbi_hours=1e15, hours=24)
    for result in sweep([150_000, 2_400_000], Policy.standard([2, 16]), params):
        assert result.failures == 0
        assert result.goodput == pytest.approx(1.0, abs=1e-12)
        assert result.uptime == pytest.approx(1.0, abs=1e-12)


def test_one_learner_is_data_parallel() -> None:
    """A lone learner's syncer copy is its checkpoint: with the same cadence it is the same process."""
    params = GoodputParams(checkpoint_interval_s=30.0, checkpoint_cost_s=0.0, sync_interval_s=30.0, hours=48)
    for chips in (150_000, 1_200_000):
        dp, m1 = simulate(DP, chips, params), simulate(decoupled(1), chips, params)
        assert (m1.goodput, m1.uptime, m1.failures) == (dp.goodput, dp.uptime, dp.failures)
        assert dp.failures > 100


def test_more_learners_never_lower_goodput() -> None:
    params = GoodputParams(hours=48)
    for chips in (150_000, 2_400_000):
        goodputs = [simulate(DP, chips, params).goodput]
        goodputs += [simulate(decoupled(m), chips, params).goodput for m in (1, 2, 4, 8, 16)]
        assert goodputs == sorted(goodputs), goodputs


def test_quorum_only_removes_progress() -> None:
    loose = GoodputParams(hours=48)
    strict = replace(loose, quorum=4)
    a, b = simulate(decoupled(4), 1_200_000, loose), simulate(decoupled(4), 1_200_000, strict)
    assert b.uptime < a.uptime
    assert b.goodput < a.goodput


def _closed_form_tolerance(chips: int, params: GoodputParams) -> float:
    """Four standard errors of the renewal-reward estimate over the simulated duration, plus edge effects.

    Each failure cycle runs X ~ Exp(lam), banks W = durable_work(X), and lasts T = X + D; the
    simulated goodput is sum W / sum T over n = H / E[T] cycles, whose standard error is
    sqrt(E[(W - G T)^2] / n) / E[T] (delta method). The last, cut cycle adds up to E[T] / H.
    """
    lam = chips / params.mtbi_s
    recovery = params.detect_s + params.swap_s + params.restart_s
    tau, cost = checkpoint_interval(chips, params), params.checkpoint_cost_s
    g = data_parallel_closed_form(chips, params)
    x = np.linspace(0.0, 60.0 / lam, 400_001)
    kept = np.floor(x / (tau + cost)) * tau if tau > 0 else x  # durable_work(x, failed=True), vectorised
    density = lam * np.exp(-lam * x)
    second_moment = float(np.trapezoid((kept - g * (x + recovery)) ** 2 * density, x))
    mean_cycle = 1.0 / lam + recovery
    cycles = params.horizon_s / mean_cycle
    return 4.0 * math.sqrt(second_moment / cycles) / mean_cycle + 2.0 * mean_cycle / params.horizon_s


@pytest.mark.parametrize(
    ("chips", "interval", "cost"),
    [(300_000, 0.0, 0.0), (600_000, 60.0, 5.0), (150_000, None, 5.0), (2_400_000, None, 5.0)],
)
def test_data_parallel_matches_closed_form(chips: int, interval: float | None, cost: float) -> None:
    """Exponential failures, fixed recovery: goodput = lam tau / ((1 + lam D)(e^{lam (tau + C)} - 1))."""
    params = GoodputParams(checkpoint_interval_s=interval, checkpoint_cost_s=cost, hours=400)
    result = simulate(DP, chips, params)
    expected = data_parallel_closed_form(chips, params)
    tolerance = _closed_form_tolerance(chips, params)
    assert tolerance < 0.02
    assert result.goodput == pytest.approx(expected, abs=tolerance)
    lam = chips / params.mtbi_s
    uptime = 1.0 / (1.0 + lam * (params.detect_s + params.restart_s))
    assert result.uptime == pytest.approx(uptime, abs=tolerance)


def test_without_spares_a_failure_waits_for_its_repair() -> None:
    """No spares: the job waits for the failed chip's repair, so recovery is repair + restart."""
    params = GoodputParams(
        spare_fraction=0.0, repair_s=600.0, checkpoint_interval_s=0.0, checkpoint_cost_s=0.0, hours=400
    )
    result = simulate(DP, 150_000, params)
    lam = 150_000 / params.mtbi_s
    expected = 1.0 / (1.0 + lam * (params.repair_s + params.restart_s))
    assert result.goodput == pytest.approx(expected, rel=0.03)
    assert result.goodput < simulate(DP, 150_000, replace(params, spare_fraction=0.01)).goodput


def test_elastic_loses_less_than_data_parallel_and_pauses_everyone() -> None:
    params = GoodputParams(hours=48)
    dp, elastic = simulate(DP, 600_000, params), simulate(ELASTIC, 600_000, params)
    assert elastic.goodput > dp.goodput
    assert elastic.uptime < 0.9  # every failure pauses the whole job for detection + reconfiguration


def test_durable_work() -> None:
    assert durable_work(25.0, 10.0, 2.0, failed=True) == 20.0
    assert durable_work(25.0, 10.0, 2.0, failed=False) == 21.0
    assert durable_work(25.0, 0.0, 0.0, failed=True) == 25.0


def test_same_seed_same_numbers_other_seed_other_numbers() -> None:
    params = GoodputParams(hours=24)
    first = sweep([300_000], Policy.standard([4]), params)
    assert first == sweep([300_000], Policy.standard([4]), params)
    other = sweep([300_000], Policy.standard([4]), replace(params, seed=1))
    assert [r.goodput for r in first] != [r.goodput for r in other]


# --- calibration ---------------------------------------------------------------------------


def test_calibration_recovers_a_known_restart_time() -> None:
    truth = GoodputParams(restart_s=30.0, hours=24)
    chips = (150_000, 600_000)
    target = tuple(100.0 * simulate(DP, n, truth).goodput for n in chips)
    fit = calibrate(replace(truth, restart_s=1.0), chips=chips, target=target, high_s=120.0)
    assert fit.params.restart_s == pytest.approx(30.0, abs=0.15)
    assert fit.rmse < 0.05


def test_defaults_are_the_calibration() -> None:
    """The shipped default restart time is what `diloco goodput --calibrate` fits, not hand-typed."""
    assert calibrate(GoodputParams()).params.restart_s == CALIBRATED_RESTART_S


# --- the command ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--chips", "-5"], "--chips"),
        (["--chips", "150000,abc"], "--chips"),
        (["--learners", "7"], "--learners"),
        (["--chips", "1000", "--slice-chips", "1000", "--learners", "2000"], "--learners"),
        (["--learners", "2", "--quorum", "3"], "--quorum"),
        (["--mtbi-hours", "0"], "--mtbi-hours"),
        (["--detect", "-1"], "--detect"),
        (["--slice-chips", "7"], "--slice-chips"),
        (["--hours", "0"], "--hours"),
    ],
)
def test_bad_arguments_are_rejected_in_one_line(argv: list[str], option: str) -> None:
    with pytest.raises(DilocoError) as caught:
        run(parse(*argv, "--hours", "1") if "--hours" not in argv else parse(*argv))
    message = str(caught.value)
    assert option in message
    assert "\n" not in message


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse("--chips", "150000", "--learners", "2", "--hours", "6", "--compare")) == 0
    out = capsys.readouterr().out
    assert "data-parallel" in out and "decoupled M=2" in out and "ours / paper" in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse("--chips", "150000,300000", "--learners", "2,4", "--hours", "6", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["results"]) == 2 * 4
    assert {r["policy"] for r in data["results"]} == {
        "data-parallel",
        "elastic data-parallel",
        "decoupled M=2",
        "decoupled M=4",
    }
    assert all(0.0 <= r["goodput"] <= r["uptime"] <= 1.0 for r in data["results"])
    assert data["params"]["restart_s"] == CALIBRATED_RESTART_S


def test_out_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    assert run(parse("--chips", "150000,300000", "--learners", "2", "--hours", "6", "--out", str(tmp_path))) == 0
    assert json.loads((tmp_path / "goodput.json").read_text())["results"]
    assert (tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_out_without_matplotlib_says_install_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(DilocoError, match="plots"):
        run(parse("--chips", "150000", "--hours", "1", "--out", str(tmp_path)))
    assert not (tmp_path / "goodput.json").exists()


def test_a_quorum_above_one_is_not_compared_with_the_paper(capsys: pytest.CaptureFixture[str]) -> None:
    """The paper's decoupled rows are for K = 1; K = 2 results are labelled and left out of the comparison."""
    assert run(parse("--chips", "600000", "--learners", "2,4", "--quorum", "2", "--hours", "6", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert "decoupled M=2, K=2" in {r["policy"] for r in data["results"]}
    assert {c["policy"] for c in data["comparison"]} == {"data-parallel", "elastic data-parallel"}
