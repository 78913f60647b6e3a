"""The command line as a user meets it: files written, one-line errors, exit codes."""

import json
import subprocess
import sys

import pytest

from conftest import TINY, child_env
from diloco.cli import main

REQUIRED = {"strategy", "learners", "tokens", "final_eval_loss", "virtual_wall_clock_s", "wire_bytes_up",
            "wire_bytes_down", "goodput", "per_learner"}


def sets(*overrides):
    return [arg for o in overrides for arg in ("--set", o)]


def test_sim_writes_a_summary(tmp_path, capsys):
    code = main(["sim", *sets(*TINY, "strategy=diloco"), "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert REQUIRED <= summary.keys()
    assert summary["strategy"] == "diloco" and summary["learners"] == 4
    assert {"tokens", "steps", "busy_fraction"} <= summary["per_learner"][0].keys()
    assert "final eval loss" in capsys.readouterr().out


def test_sim_reads_a_config_file(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('strategy = "ddp"\n[learners]\nspeeds = [1, 0.5]\n')
    tiny = [o for o in TINY if not o.startswith("learners.")]  # the file's learners, not the fixture's
    assert main(["sim", str(config), *sets(*tiny), "--out", str(tmp_path), "-q"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == "ddp" and summary["learners"] == 2


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, env=child_env(),
                          timeout=120)


@pytest.mark.parametrize("args, message", [
    (["sim", "--set", "outer.H=0"], "config key 'outer.H' must be positive"),
    (["sim", "--set", "outer.typo=1"], "unknown config key 'outer.typo'"),
    (["sim", "/nonexistent/run.toml"], "config file not found"),
    (["sim", *sets(*TINY, "data.source=/nonexistent/tokens.bin")], "data file not found"),
    (["sim", *sets(*TINY, "strategy=diloco", "model.factory=toy_models:returns_logits")], "must return a scalar loss"),
    (["sim", *sets(*TINY, "model.factory=toy_models:not_a_module")], "not a torch.nn.Module"),
    (["sim", *sets(*TINY, "model.factory=no_such_module:f")], "cannot import"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(args, message, tmp_path):
    result = run_cli(*args, "--out", str(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "summary.json").exists()


def test_verbose_shows_the_traceback(tmp_path):
    result = run_cli("sim", "--set", "outer.H=0", "--verbose", "--out", str(tmp_path))
    assert result.returncode == 2
    assert "Traceback" in result.stderr
