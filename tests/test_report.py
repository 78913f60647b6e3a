"""Tests of `diloco report`: plots of one run folder, the comparison table, tolerance of what runs leave."""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import tiny_config

from diloco.errors import DilocoError
from diloco.report.report_cli import add_arguments, default_compare_out, run
from diloco.report.compare import compare_runs
from diloco.report.plots import link_rate, smooth, write_run_plots
from diloco.report.run_records import AllLearnersTokens, load_run, read_metrics

matplotlib_image = pytest.importorskip("matplotlib.image")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --- helpers -------------------------------------------------------------------------------------


def assert_png(path: Path) -> None:
    """A real, non-empty PNG: signature, positive IHDR size, and more than one colour."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    assert width > 0 and height > 0, path
    assert matplotlib_image.imread(path).std() > 0, f"{path} is a single flat colour"


def summary(**overrides: Any) -> dict[str, Any]:
    """A summary.json as `diloco sim` writes it (two learners), with the given keys changed."""
    data: dict[str, Any] = {
        "strategy": "decoupled", "learners": 2, "tokens": 40960, "final_eval_loss": 4.0,
        "training_time_s": 9.5, "wire_bytes_up": 8_000_000, "wire_bytes_down": 4_825_696, "goodput": 0.9781,
        "peak_sync_bytes": 500_000, "rounds": 6, "parameters": 470_528, "tokens_merged": 30000.0,
        "tokens_stale": 10960.0, "tokens_lost": 0.0,
        "per_learner": [{"learner": i, "speed": 1.0, "tokens": 20480, "steps": 20, "busy_s": 9.0, "waiting_s": 0.0,
                         "down_s": 0.0, "busy_fraction": 0.95, "crashes": 0, "tokens_lost": 0.0,
                         "bytes_up": 4_000_000, "bytes_down": 2_412_848} for i in range(2)],
        "eval_curve": [{"time_s": 5.0, "tokens": 20480, "loss": 5.0}, {"time_s": 9.5, "tokens": 40960, "loss": 4.0}],
        "config": {"strategy": "decoupled", "train": {"tokens": 40960}},
    }
    data.update(overrides)
    return data


def metrics_records(learners: int = 2, steps: int = 20) -> list[dict[str, Any]]:
    """Records of every kind over a short run: learners report each second, a round every 3 s."""
    records: list[dict[str, Any]] = []
    for t in range(steps):
        for learner in range(learners):
            records.append({
                "kind": "learner", "time_s": float(t), "learner": learner, "tokens": 1024 * (t + 1),
                "steps": t + 1, "tokens_per_s": 1024.0, "step_time_s": 1.0, "busy_fraction": 0.95,
                "bytes_up": 200_000 * (t // 3), "bytes_down": 100_000 * (t // 3) * (learner + 1),
                "loss": 6.0 - 0.1 * t + 0.05 * ((t + learner) % 3), "outer_grad_norm": None if t < 3 else 1.5,
                "staleness": None, "last_merged_version": t // 3,
            })
        if t % 3 == 2:
            records.append({
                "kind": "round", "time_s": t + 0.5, "shard": 0, "fragment": (t // 3) % 2, "version": t // 3 + 1,
                "participants": list(range(learners)) if t % 2 else [0], "stale": 1 if t % 2 else 0,
                "time_to_quorum_s": 0.2, "held_s": 0.1, "update_norm": 0.3, "cosine": 0.5, "tokens": 4096,
            })
        if t % 5 == 4:
            records.append({"kind": "eval", "time_s": t + 0.9, "tokens": 1024 * (t + 1) * learners,
                            "loss": 6.0 - 0.08 * t})
            records.append({"kind": "syncer", "time_s": t + 0.9, "shard": 0, "queue_length": 1,
                            "checkpoint_age_s": None, "memory_bytes": 1 << 20})
    return records


def write_run(folder: Path, summary_data: dict[str, Any] | None = None,
              records: list[dict[str, Any]] | None = None, tail: str = "") -> Path:
    """A run folder: summary.json and/or metrics.jsonl (plus raw text appended, e.g. a truncated line)."""
    folder.mkdir(parents=True)
    if summary_data is not None:
        (folder / "summary.json").write_text(json.dumps(summary_data, indent=2) + "\n")
    if records is not None:
        lines = "".join(json.dumps(r) + "\n" for r in records)
        (folder / "metrics.jsonl").write_text(lines + tail)
    return folder


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="diloco report")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def table_rows(markdown: str) -> list[list[str]]:
    """The body rows of a markdown table, as cells."""
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real, short simulator run folder, written the way `diloco sim` writes it (no metrics.jsonl)."""
    from diloco.sim import simulate

    result = simulate(tiny_config("train.tokens=512", "learners.count=2"))
    folder = tmp_path_factory.mktemp("runs") / "sim-tiny"
    return write_run(folder, result.summary())


# --- reading -------------------------------------------------------------------------------------


def test_reading_skips_a_truncated_last_line_and_keeps_unknown_kinds(tmp_path: Path) -> None:
    records = metrics_records()
    records.append({"kind": "hologram", "time_s": 3.0, "brightness": 7})
    records[0]["a_field_from_the_future"] = [1, 2]
    folder = write_run(tmp_path / "run", summary(), records, tail='{"kind": "learner", "time_s": 19.5, "lear')
    read = read_metrics(folder / "metrics.jsonl")
    assert len(read) == len(records)
    assert [r["time_s"] for r in read] == sorted(r["time_s"] for r in records)
    assert load_run(folder).of_kind("learner")[0]["a_field_from_the_future"] == [1, 2]


def test_eval_records_come_first_and_the_summary_curve_is_the_fallback(tmp_path: Path) -> None:
    with_metrics = load_run(write_run(tmp_path / "a", summary(), metrics_records()))
    assert [p.loss for p in with_metrics.eval_points()] == pytest.approx([5.68, 5.28, 4.88, 4.48])
    without = load_run(write_run(tmp_path / "b", summary()))
    assert [(p.time_s, p.tokens, p.loss) for p in without.eval_points()] == [(5.0, 20480, 5.0), (9.5, 40960, 4.0)]


def test_all_learners_tokens_sums_each_learners_latest_count() -> None:
    records = [{"kind": "learner", "time_s": 0.0, "learner": 0, "tokens": 100},
               {"kind": "learner", "time_s": 1.0, "learner": 1, "tokens": 50},
               {"kind": "learner", "time_s": 2.0, "learner": 0, "tokens": 300}]
    tokens = AllLearnersTokens(records)
    assert [tokens.at(t) for t in (-1.0, 0.0, 1.5, 2.0, 9.0)] == [0, 100, 150, 350, 350]


def test_link_rate_from_cumulative_bytes_and_a_restarted_counter() -> None:
    records = [{"time_s": t, "bytes_up": b} for t, b in [(0.0, 0), (1.0, 100), (1.0, 150), (3.0, 550), (4.0, 40)]]
    times, rates = link_rate(records, "bytes_up")
    assert times == [0.0, 1.0, 3.0, 4.0]
    assert rates == [100.0, 100.0, 225.0, 40.0]  # 1 -> 3 s counts the same-instant 50 bytes; then a restart
    assert link_rate([{"time_s": 0.0, "bytes_up": None}], "bytes_up") == ([], [])


def test_smoothing_keeps_a_constant_and_the_length() -> None:
    assert smooth([2.0] * 50) == pytest.approx([2.0] * 50)
    assert len(smooth([1.0, 3.0])) == 2


# --- plots of one run ----------------------------------------------------------------------------


def test_run_plots_are_valid_images(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run", summary(), metrics_records(), tail='{"kind": "round", "ti')
    written = write_run_plots(folder)
    assert [p.name for p in written] == ["loss.png", "bandwidth.png", "participation.png"]
    for path in written:
        assert path.parent == folder / "plots"
        assert_png(path)


@pytest.mark.integration  # a whole training run in the simulator
def test_plots_of_a_simulator_run_without_metrics(sim_run: Path) -> None:
    written = write_run_plots(sim_run, sim_run / "elsewhere")
    assert written == [sim_run / "elsewhere" / "loss.png"]  # no learner or round records: nothing else to draw
    assert_png(written[0])


def test_a_plot_without_data_is_not_written(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run", summary(eval_curve=[]), [{"kind": "syncer", "time_s": 1.0, "shard": 0}])
    assert write_run_plots(folder) == []
    assert not (folder / "plots").exists()


def test_plots_without_matplotlib_say_install_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_run(tmp_path / "run", summary())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(DilocoError, match=r"pip install 'diloco\[plots\]'"):
        write_run_plots(folder)


# --- comparing runs ------------------------------------------------------------------------------


@pytest.mark.integration  # a whole training run in the simulator
def test_compare_table_report_and_overlaid_plot(tmp_path: Path, sim_run: Path) -> None:
    first = write_run(tmp_path / "runs" / "sim-a", summary(), metrics_records())
    second = write_run(tmp_path / "runs" / "real-b", summary(strategy="diloco", final_eval_loss=4.4, wall_clock_s=300.0,
                                                             learners=4, rounds=12, wire_bytes_up=1_500))
    out = tmp_path / "cmp"
    table, written = compare_runs([first, second, sim_run], out)
    assert written == [out / "compare-loss.png", out / "report.md"]
    assert_png(out / "compare-loss.png")
    rows = table_rows(table)
    assert len(rows) == 3
    assert rows[0] == ["sim-a", "decoupled", "2", "40,960", "4.0000", "baseline", "9.5 s (virtual)", "0.978",
                       "12.83 MB", "6"]
    assert rows[1] == ["real-b", "diloco", "4", "40,960", "4.4000", "+10.00%", "5.0 min (real)", "0.978",
                       "4.83 MB", "12"]
    sim = json.loads((sim_run / "summary.json").read_text())
    assert rows[2][0] == "sim-tiny"
    assert rows[2][4] == f"{sim['final_eval_loss']:.4f}"
    assert rows[2][5] == f"{100 * (sim['final_eval_loss'] / 4.0 - 1):+.2f}%"
    report = (out / "report.md").read_text()
    assert table in report
    assert "](compare-loss.png)" in report
    assert "](../runs/sim-a/summary.json)" in report


def test_compare_names_the_folder_without_summary(tmp_path: Path) -> None:
    good = write_run(tmp_path / "good", summary())
    killed = write_run(tmp_path / "killed", None, metrics_records())
    with pytest.raises(DilocoError) as error:
        compare_runs([good, killed], tmp_path / "out")
    message = str(error.value)
    assert "killed" in message and "summary.json" in message and "\n" not in message
    assert not (tmp_path / "out").exists()  # every folder is read before anything is written


def test_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DilocoError, match="no-such-run"):
        write_run_plots(tmp_path / "no-such-run")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DilocoError, match="neither summary.json nor metrics.jsonl"):
        write_run_plots(empty)


def test_a_missing_final_loss_shows_as_not_available(tmp_path: Path) -> None:
    first = write_run(tmp_path / "a", summary(final_eval_loss=math.nan))
    second = write_run(tmp_path / "b", summary())
    table, _ = compare_runs([first, second], tmp_path / "out")
    rows = table_rows(table)
    assert rows[0][4] == "n/a" and rows[1][5] == "n/a"


# --- the command ---------------------------------------------------------------------------------


def test_command_with_one_dir_plots_and_prints_its_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_run(tmp_path / "run", summary())
    assert run(parse(str(folder))) == 0
    printed = capsys.readouterr().out
    assert len(table_rows(printed)) == 1 and "| run | decoupled | 2 |" in printed
    assert f"wrote {folder / 'plots' / 'loss.png'}" in printed


def test_command_with_a_killed_run_still_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rounds = [r for r in metrics_records() if r["kind"] == "round"]
    folder = write_run(tmp_path / "killed", None, rounds, tail='{"kind":')
    assert run(parse(str(folder))) == 0
    captured = capsys.readouterr()
    assert "no summary.json" in captured.err
    assert f"wrote {folder / 'plots' / 'participation.png'}" in captured.out and "| run |" not in captured.out


def test_command_with_several_dirs_compares_next_to_them(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [write_run(tmp_path / "runs" / name, summary()) for name in ("a", "b")]
    assert default_compare_out(dirs) == (tmp_path / "runs" / "report").resolve()
    assert run(parse(*map(str, dirs), "--out", str(tmp_path / "out"))) == 0
    printed = capsys.readouterr().out
    assert len(table_rows(printed)) == 2
    assert f"wrote {tmp_path / 'out' / 'report.md'}" in printed
