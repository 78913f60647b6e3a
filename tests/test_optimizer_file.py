"""A learner's inner optimizer state goes to a file of its own every few checkpoints (`client/checkpoints.py`,
`OPTIMIZER_EVERY`): the progress, which a kill loses, is saved more often for the same cost. A restart
reads both; a damaged optimizer file is refused in one line that names it, and a missing one means fresh
moments, never a failure."""

from __future__ import annotations

import pytest
import torch

from diloco.client.builtin_loop import restore_checkpoint
from diloco.client.checkpoints import OPTIMIZER_EVERY, CheckpointWriter, optimizer_file, read_checkpoint
from diloco.client.packed_state import unpacked
from diloco.errors import DilocoError
from diloco.models.gpt import GPT, GPTConfig
from diloco.state_files import file_key, load_checked, save_checked

KEY = file_key(b"run secret")


class Position:
    """A data sampler's position, as a replica's sampler restores it."""

    def __init__(self) -> None:
        self.position: dict | None = None

    def load_state_dict(self, position: dict) -> None:
        self.position = position


class Trained:
    """A small model and its AdamW, a step at a time, and the state a syncing learner's checkpoint takes:
    what `restore_checkpoint` restores into, as it does a replica."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(vocab_size=32, context=8, layers=1, width=16, heads=2, dropout=0.0))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.steps = 0
        self.sampler = Position()

    def step(self) -> None:
        x = torch.randint(0, 32, (2, 9))
        self.model(x[:, :-1], x[:, 1:]).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1

    def state(self) -> dict:
        return {"sync": {"seq": self.steps, "step": self.steps, "fragments": []},
                "optimizer": self.optimizer.state_dict(), "data": {"learner": 0, "epoch": 0, "index": self.steps},
                "steps": self.steps}

    def moments(self) -> list[torch.Tensor]:
        return [t.clone() for s in self.optimizer.state_dict()["state"].values() for t in s.values()]


def saved_moments(path) -> tuple[int, list[torch.Tensor]]:
    saved = unpacked(load_checked(optimizer_file(path), "", "", KEY))
    return saved["steps"], [t for s in saved["optimizer"]["state"].values() for t in s.values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_optimizer_is_saved_every_few_checkpoints_and_a_restart_reads_it_with_the_newest_progress(tmp_path):
    path, learner = tmp_path / "learner-0.pt", Trained()
    writer = CheckpointWriter(path, KEY)
    moments_at: dict[int, list[torch.Tensor]] = {}
    for _ in range(OPTIMIZER_EVERY + 2):
        learner.step()
        moments_at[learner.steps] = learner.moments()
        writer.save(learner.state)
        writer.wait()
        assert "optimizer" not in unpacked(load_checked(path, "", "", KEY))  # the progress file holds none
        first_of_its_cycle = 1 + (learner.steps - 1) // OPTIMIZER_EVERY * OPTIMIZER_EVERY
        steps, moments = saved_moments(path)
        assert steps == first_of_its_cycle and same(moments, moments_at[first_of_its_cycle])
    read = read_checkpoint(path, 100, learner.optimizer, KEY)
    assert read["steps"] == learner.steps == OPTIMIZER_EVERY + 2 and read["data"]["index"] == learner.steps
    restored = Trained()
    restore_checkpoint(read, restored, 1, "checkpoint")  # a Trained stands in for a replica: optimizer, steps
    assert same(restored.moments(), moments_at[OPTIMIZER_EVERY + 1]) and restored.steps == learner.steps
    assert restored.sampler.position == {"learner": 0, "epoch": 0, "index": learner.steps}
    learner.step()
    writer.save(learner.state, wait=True)  # the run's last save holds the moments it ends with
    assert saved_moments(path)[0] == learner.steps


def test_without_its_optimizer_file_a_learner_restarts_with_fresh_moments(tmp_path):
    path, learner = tmp_path / "learner-0.pt", Trained()
    learner.step()
    writer = CheckpointWriter(path, KEY)
    writer.save(learner.state, wait=True)
    optimizer_file(path).unlink()
    read = read_checkpoint(path, 100, learner.optimizer, KEY)
    assert "optimizer" not in read and read["steps"] == 1
    restored = Trained()
    restore_checkpoint(read, restored, 1, "checkpoint")
    assert restored.optimizer.state_dict()["state"] == {} and restored.steps == 1


def _another_shape(saved: dict) -> None:
    first = next(iter(saved["optimizer"]["state"].values()))
    first["exp_avg"] = torch.zeros(3)


def _a_nan(saved: dict) -> None:
    first = next(iter(saved["optimizer"]["state"].values()))
    first["exp_avg_sq"] = torch.full_like(first["exp_avg_sq"], float("nan"))


@pytest.mark.parametrize("damage, expected", [(None, "damaged"), (_another_shape, "of shape [3]"),
                                              (_a_nan, "NaN or Inf")], ids=["a flipped byte", "another shape", "NaN"])
def test_a_damaged_optimizer_file_is_refused_in_one_line_that_names_it_and_changes_nothing(tmp_path, damage, expected):
    path, learner = tmp_path / "learner-0.pt", Trained()
    learner.step()
    writer = CheckpointWriter(path, KEY)
    writer.save(learner.state, wait=True)
    moments = optimizer_file(path)
    if damage is None:
        data = bytearray(moments.read_bytes())
        data[len(data) // 2] ^= 0x40
        moments.write_bytes(bytes(data))
    else:
        saved = unpacked(load_checked(moments, "", "", KEY))
        damage(saved)
        save_checked(saved, moments, KEY)
    before = learner.moments()
    with pytest.raises(DilocoError) as refused:
        read_checkpoint(path, 100, learner.optimizer, KEY)
    line = str(refused.value)
    assert "\n" not in line and expected in line and str(moments) in line and "inner optimizer afresh" in line
    assert same(learner.moments(), before)


def test_the_period_spreads_the_optimizers_file_over_the_checkpoints_it_is_saved_in(tmp_path):
    """On the CPUs training uses, each file's copy and write CPU count; beside a GPU, the copies only."""
    for counts_write, own, moments in ((True, 0.001 + 0.004, 0.002 + 0.010), (False, 0.001, 0.002)):
        writer = CheckpointWriter(tmp_path / "learner-0.pt", counts_write=counts_write)
        writer.copy_s, writer.write_cpu_s = 0.001, 0.004
        writer.moments_copy_s, writer.moments_write_cpu_s = 0.002, 0.010
        assert writer.cost_s() == pytest.approx(own + moments / OPTIMIZER_EVERY)
