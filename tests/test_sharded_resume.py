"""A sharded learner (FSDP2, HSDP; each rank a process, Gloo on CPU) resumes its own unpushed progress
after a crash, as an unsharded one does (`core/own_progress.py`): its DCP checkpoint holds each rank's
rows of that progress, a restart puts them back on top of Θ through the same decision, with the same
world size or another, and a damaged checkpoint is refused in one line by every rank with nothing changed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import rank_procs

PROGRESS = Path(__file__).parent / "workers" / "sharded_progress.py"
TIMEOUT_S = 120

pytestmark = [pytest.mark.integration,  # one process per rank
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="torch.distributed with Gloo is not available")]


def _progress(world: int, out: Path, *args: str, name: str = "rank") -> tuple[list[int], list[str]]:
    codes, logs, _ = rank_procs.launch(world, [sys.executable, str(PROGRESS), *args, "--out", str(out)], out,
                                       TIMEOUT_S, name)
    return codes, logs


@pytest.mark.parametrize("sharding,saved_by,loaded_by", [("fsdp", 2, 2), ("hsdp", 4, 4), ("fsdp", 2, 4),
                                                          ("hsdp", 4, 2)])
def test_resumed_rows_equal_an_unsharded_learners_resume(sharding, saved_by, loaded_by, tmp_path):
    """From the same trained state (a fragment unpushed, two pushes in flight, one of which its shard never
    took), the sharded learner's resumed parameters are Θ − unpushed (− the lost push) on every rank's rows,
    bit for bit what an unsharded learner's resume gives, with the same counters and the same first pushes;
    another world size reshards the progress (DCP's global offsets). The `theta` policy leaves Θ alone."""
    codes, logs = _progress(saved_by, tmp_path, "--phase", "save", "--sharding", sharding, name="save")
    assert codes == [0] * saved_by, logs[0][-3000:]
    codes, logs = _progress(loaded_by, tmp_path, "--phase", "load", "--sharding", sharding, name="load")
    assert codes == [0] * loaded_by, logs[0][-3000:]
    result = json.loads((tmp_path / f"progress-{loaded_by}.json").read_text())
    assert result["theta_kept"] and all(why == "the policy takes Θ" for why in result["theta_policy"]), result
    assert result["outcome"] == [None, None, None] and result["same_outcome"], result
    assert result["params_equal"] and result["unpushed_on_theta"] and result["pushes_equal"], result
    assert result["tokens_since"] == result["plain_tokens_since"] == [200, 100, 200], result


@pytest.mark.parametrize("damage,words", [("distcp", "damaged"), ("latest", "latest")])
def test_a_damaged_progress_checkpoint_is_refused_by_every_rank_with_nothing_changed(damage, words, tmp_path):
    """A flipped byte in rank 1's DCP file (its rows of the progress with the rest), or in the sealed file
    naming the complete slot: every rank refuses in one line; its parameters, optimizer and core are as
    they were."""
    codes, logs = _progress(2, tmp_path, "--phase", "save", name="save")
    assert codes == [0, 0], logs[0][-3000:]
    codes, logs = _progress(2, tmp_path, "--phase", "load", "--damage", damage, name="load")
    assert codes == [0, 0], logs[0][-3000:]
    for rank, log in enumerate(logs):
        lines = [line for line in log.splitlines() if line.startswith("REFUSED: ")]
        assert len(lines) == 1 and words in lines[0], log[-2000:]
        assert json.loads((tmp_path / f"refused-{rank}.json").read_text()) == {"unchanged": True}
