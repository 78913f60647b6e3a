"""The command line as a user meets it: files written, one-line errors, exit codes."""

import json
import subprocess
import sys

import pytest

from conftest import TINY, child_env
from diloco.cli import main

REQUIRED = {"strategy", "learners", "tokens", "final_eval_loss", "training_time_s", "wire_bytes_up",
            "wire_bytes_down", "goodput", "per_learner"}


def sets(*overrides):
    return [arg for o in overrides for arg in ("--set", o)]


@pytest.mark.integration  # a whole training run in the simulator
def test_sim_writes_a_summary(tmp_path, capsys):
    code = main(["sim", *sets(*TINY, "strategy=diloco"), "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert REQUIRED <= summary.keys()
    assert summary["strategy"] == "diloco" and summary["learners"] == 4
    assert {"tokens", "steps", "busy_fraction"} <= summary["per_learner"][0].keys()
    assert "final eval loss" in capsys.readouterr().out


@pytest.mark.integration  # a whole training run in the simulator
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


@pytest.mark.integration  # runs `diloco` as a process
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


@pytest.mark.integration  # runs `diloco` as a process
def test_verbose_shows_the_traceback(tmp_path):
    result = run_cli("sim", "--set", "outer.H=0", "--verbose", "--out", str(tmp_path))
    assert result.returncode == 2
    assert "Traceback" in result.stderr


# ---------------------------------------------------------------- keys the real runtime ignores


def test_the_runtime_ignores_the_simulators_failure_plan_and_step_time_model_when_set():
    from diloco.config import load_config
    from diloco.launch.ignored_keys import ignored_keys

    assert ignored_keys(load_config()) == {}
    assert ignored_keys(load_config(None, ["failures.detect_s=5.0", "learners.jitter=0.23"])) == {}  # the defaults
    ignored = ignored_keys(load_config(None, ["failures.mtbf_s=100", "failures.crashes=[{learner = 1, at_s = 3}]",
                                              "failures.checkpoint_every=5", "failures.detect_s=1",
                                              "failures.restore=fresh", "learners.step_time_s=0.1",
                                              "learners.drift=0", "learners.speeds=[1, 0.5]"]))
    assert sorted(ignored) == ["failures.crashes", "failures.mtbf_s", "learners.drift", "learners.step_time_s"]
    assert "diloco chaos" in ignored["failures.mtbf_s"] and "step-time model" in ignored["learners.drift"]


def test_runtime_commands_warn_once_per_ignored_key_from_a_file_or_set(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[failures]\nmtbf_s = 200.0\n")
    assert main(["run", str(config), *sets("learners.step_time_s=0.1"), "--shards", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "diloco: warning: learners.step_time_s is ignored by `diloco run`: the simulator's step-time model; "
        "a real learner's steps take what they take",
        "diloco: warning: failures.mtbf_s is ignored by `diloco run`: the simulator's failure plan; "
        "use `diloco chaos` for real faults",
        "diloco: error: --shards must be at least 1"]
    assert main(["learner", *sets("learners.jitter=0.5")]) == 2
    assert "learners.jitter is ignored by `diloco learner`" in capsys.readouterr().err
