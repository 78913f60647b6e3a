"""A shard's state file and a learner's checkpoint under attack: flipped bytes, cut-short, pickled, non-finite
or foreign files are refused, in one line through the CLI, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, tiny_config
from diloco.errors import DilocoError
from diloco.client.checkpoints import read_checkpoint
from diloco.state_files import TRAILER, save_checked

from shard_on_disk import SeededShard, _no_shard_left, flip, tiny_model  # noqa: F401 (an autouse fixture)

integration = pytest.mark.integration  # live shards over real gRPC, or diloco as a process


# ---------------------------------------------------------------- the state file


@pytest.fixture
def saved_state(tmp_path) -> tuple[Path, object]:
    """A state folder holding a seeded shard's saved state (and the config it ran with)."""
    seeded = SeededShard(tmp_path)
    seeded.client.push(*seeded.push_message(1))
    seeded.shard.save_state()
    seeded.kill()
    return tmp_path, seeded.config


def resume_error(state_dir: Path, config, shards: int = 1) -> str:
    from diloco.shard.server import ShardPlan, SyncerShard

    with pytest.raises(DilocoError) as caught:
        SyncerShard(config, ShardPlan(0, shards, ("",) * shards), state_dir=state_dir, resume=True)
    message = str(caught.value)
    assert "\n" not in message
    return message


@integration
def test_a_flipped_byte_in_the_state_file_is_refused(saved_state):
    state_dir, config = saved_state
    path = state_dir / "shard-0.state.pt"
    flip(path, path.stat().st_size // 2)
    assert "is damaged" in resume_error(state_dir, config) and str(path) in resume_error(state_dir, config)


@integration
def test_a_cut_short_or_unchecked_state_file_is_refused(saved_state):
    state_dir, config = saved_state
    path = state_dir / "shard-0.state.pt"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - TRAILER.size])  # as an older diloco wrote it, or cut short
    assert "has no checksum" in resume_error(state_dir, config)
    path.write_bytes(data[:100])
    assert "state of shard 0" in resume_error(state_dir, config)


@integration
def test_a_state_file_holding_pickled_objects_is_refused_in_one_line(saved_state):
    state_dir, config = saved_state
    save_checked({"format": 2, "journal_seq": 0, "payload": Path("/etc/passwd")}, state_dir / "shard-0.state.pt")
    assert "refused to unpickle" in resume_error(state_dir, config)


@integration
def test_a_state_file_with_non_finite_theta_or_wrong_shapes_is_refused(saved_state):
    state_dir, config = saved_state
    path = state_dir / "shard-0.state.pt"
    state = torch.load(path, weights_only=True)
    name = next(iter(state["core"]["theta"]))
    good = state["core"]["theta"][name]
    state["core"]["theta"][name] = torch.full_like(good, 1e38) * 10  # overflows to Inf
    save_checked(state, path)
    assert "NaN or Inf" in resume_error(state_dir, config)
    state["core"]["theta"][name] = torch.zeros(good.numel() + 1)
    save_checked(state, path)
    assert "shape" in resume_error(state_dir, config)


@integration
def test_a_state_file_rewritten_with_a_huge_theta_and_its_checksum_recomputed_is_refused(saved_state):
    state_dir, config = saved_state  # no run secret: the checksum is unkeyed, so the values are checked
    path = state_dir / "shard-0.state.pt"
    state = torch.load(path, weights_only=True)
    name = next(iter(state["core"]["theta"]))
    state["core"]["theta"][name] = torch.full_like(state["core"]["theta"][name], 3e38)
    save_checked(state, path)
    assert "RMS" in resume_error(state_dir, config)


@integration
def test_a_state_file_of_another_config_or_shard_count_is_refused(saved_state):
    state_dir, _ = saved_state
    other = tiny_config("learners.count=2", "outer.fragments=1", "outer.H=4")
    message = resume_error(state_dir, other)
    assert "other settings" in message and "learners differ" in message
    two_shards = tiny_config("learners.count=1", "outer.fragments=2", "outer.H=4")
    assert "with shards 1, but this one has 2" in resume_error(state_dir, two_shards, shards=2)


@integration
def test_resume_with_nothing_to_resume_is_an_error_but_a_shard_never_seeded_starts_fresh(tmp_path):
    from diloco.shard.server import ShardPlan, SyncerShard

    config = tiny_config("learners.count=1", "outer.fragments=1")
    assert "holds no saved state" in resume_error(tmp_path / "empty", config)
    SyncerShard(config, ShardPlan(0, 1, ("",)), state_dir=tmp_path / "early").stop()  # killed before Init
    early = SyncerShard(config, ShardPlan(0, 1, ("",)), state_dir=tmp_path / "early", resume=True)
    assert early.core is None
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "shard-0.journal").write_bytes(b"x" * 40)
    assert "cannot be replayed" in resume_error(tmp_path / "orphan", config)


# ---------------------------------------------------------------- through the CLI: one line, no traceback


def diloco_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("diloco: error:")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), done.stderr[-2000:]


@integration
def test_syncer_resume_without_state_says_so_in_one_line(tmp_path):
    done = diloco_cli("syncer", "--out", str(tmp_path), "--resume", "--bind", "127.0.0.1:0")
    assert_one_line_error(done, "--resume", "no saved state")


@integration
def test_syncer_resume_from_a_damaged_state_file_says_so_in_one_line(saved_state):
    state_dir, _ = saved_state
    out = state_dir.parent / "run"
    (out / "syncer").mkdir(parents=True)
    path = out / "syncer" / "shard-0.state.pt"
    path.write_bytes((state_dir / "shard-0.state.pt").read_bytes())
    flip(path, 200)
    done = diloco_cli("syncer", *[x for o in ["learners.count=1", "outer.fragments=1", "outer.H=4"]
                                  for x in ("--set", o)], "--out", str(out), "--resume", "--bind", "127.0.0.1:0")
    assert_one_line_error(done, str(path), "damaged")


def learner_checkpoint(out: Path, **changes) -> Path:
    path = out / "checkpoints" / "learner-0.pt"
    state = {"model": {}, "optimizer": {"state": {}, "param_groups": []}, "data": {"learner": 0, "epoch": 0,
                                                                                   "index": 0}, "steps": 3}
    state.update(changes)
    save_checked(state, path)
    return path


@integration
@pytest.mark.parametrize("damage, words", [
    ("flipped", ["learner-0.pt", "damaged"]),
    ("pickled", ["learner-0.pt", "refused to unpickle"]),
    ("steps", ["learner-0.pt", "1000000000000 steps"]),
])
def test_a_bad_learner_checkpoint_is_one_line_through_the_cli(tmp_path, damage, words):
    if damage == "flipped":
        path = learner_checkpoint(tmp_path)
        flip(path, 64)
    elif damage == "pickled":
        learner_checkpoint(tmp_path, data=Path("/etc/passwd"))
    else:
        learner_checkpoint(tmp_path, steps=10**12)
    done = diloco_cli("learner", "--no-sync", "--id", "0", "--out", str(tmp_path), "-q",
                      *[x for o in TINY for x in ("--set", o)])
    assert_one_line_error(done, *words)


def test_a_learner_checkpoint_for_other_parameters_is_refused(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    saved["state"][0]["exp_avg"] = torch.zeros(3)
    path = learner_checkpoint(tmp_path, optimizer=saved)
    with pytest.raises(DilocoError, match="shape"):
        read_checkpoint(path, 100, optimizer)
    saved["state"][0]["exp_avg"] = torch.full((8, 4), float("nan"))
    path = learner_checkpoint(tmp_path, optimizer=saved)
    with pytest.raises(DilocoError, match="NaN"):
        read_checkpoint(path, 100, optimizer)
