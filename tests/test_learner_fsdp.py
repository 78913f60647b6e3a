"""Learners whose parameters are DTensors (FSDP2 on a 1-D mesh, HSDP on replicate × shard), each rank a
process (Gloo, CPU): the sync path is exact, whole runs sync, bad models are refused in one line, and
a rank that dies mid-sync ends the others with one line within a bound.

The syncer runs in this process; tests/workers/sharded_learner.py runs once per rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import rank_procs
from conftest import TINY as TINY_SETS, serving_shard, tiny_config
from diloco.state_files import load_checked

WORKER = Path(__file__).parent / "workers" / "sharded_learner.py"
STEPS, BATCH, SEQ, FRAGMENTS = 16, 4, 16, 3
TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 20
"""The learner's process group timeout in the hang test: the bound a dead rank is noticed within."""

pytestmark = [pytest.mark.integration,  # one process per rank, against a live shard
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="torch.distributed with Gloo is not available")]


def launch(world: int, *args: str, out: Path, timeout_s: float = TIMEOUT_S, command: list[str] | None = None
           ) -> tuple[list[int], list[str], float]:
    """Start one worker per rank (`command`: instead of the worker script); return their exit codes, outputs
    and the seconds until the last ended."""
    return rank_procs.launch(world, command or [sys.executable, str(WORKER), *args, "--out", str(out)], out, timeout_s)


@pytest.fixture
def syncer():
    """A decoupled syncer for one learner, with a short period so that several merges happen."""
    with serving_shard("learners.count=1", "strategy=decoupled", "outer.H=4", f"outer.fragments={FRAGMENTS}",
                       "train.tokens=100000000", workers=8) as started:
        yield started


@pytest.mark.parametrize("sharding,world,device", [
    ("fsdp", 2, "cpu"), ("hsdp", 4, "cpu"),
    pytest.param("fsdp", 2, "cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                             reason="NCCL needs two CUDA devices"))])
def test_sharded_push_and_merge_equal_unsharded_bit_for_bit(sharding, world, device, tmp_path):
    """From the same parameters and anchors, the pushes put together at rank 0 and the parameters after
    merging the same answers equal an unsharded learner's exactly; rank 0 holds only its rows' anchors."""
    codes, logs, _ = launch(world, "exact", "--sharding", sharding, "--device", device, out=tmp_path)
    assert codes == [0] * world, logs[0][-3000:]
    result = json.loads((tmp_path / "exact.json").read_text())
    assert result["pushes"] == FRAGMENTS
    assert result["pushes_equal"] and result["merged_equal"] and result["moved"], result
    shards = 2 if sharding == "hsdp" else world
    assert result["anchor_elements_rank0"] <= result["model_elements"] / shards * 1.1, result


@pytest.mark.parametrize("sharding,world,model", [("fsdp", 2, "gpt"), ("hsdp", 4, "gpt"), ("fsdp", 2, "hf"),
                                                 ("fsdp", 2, "masked")])
def test_a_model_built_sharded_equals_the_whole_model_bit_for_bit(sharding, world, model, tmp_path):
    """The built-in learner's sharded model, built on the meta device with each rank filling only its rows,
    gathered, is the model one process builds whole for the same seed (a Hugging Face causal LM too): a
    sharded learner that seeds Θ seeds the same Θ. A build that cannot be replayed is built whole."""
    if model == "hf":
        pytest.importorskip("transformers")
    codes, logs, _ = launch(world, "build", "--sharding", sharding, "--model", model, out=tmp_path)
    assert codes == [0] * world, logs[0][-3000:]
    result = json.loads((tmp_path / "build.json").read_text())
    assert result["equal"] and result["held"] == ["DTensor"], result
    assert bool(result["built_whole"]) == (model == "masked"), result
    if model == "masked":
        assert "mask is computed by aten.tril" in result["built_whole"][0], result


@pytest.mark.parametrize("sharding,world,model", [("fsdp", 2, "gpt"), ("hsdp", 4, "gpt"), ("ddp", 2, "gpt"),
                                                 ("fsdp", 2, "hf")])
def test_sharded_learner_trains_against_a_syncer(syncer, sharding, world, model, tmp_path):
    """Every rank takes part in every merge; the syncer counts one learner, each token once per fragment,
    every push once, and holds Θ for every parameter the learner has (a Hugging Face causal LM with tied
    embeddings too)."""
    if model == "hf":
        pytest.importorskip("transformers")
    shard, address = syncer
    codes, logs, _ = launch(world, "train", "--sharding", sharding, "--syncer", address, "--steps", str(STEPS),
                            "--batch", str(BATCH), "--seq", str(SEQ), "--model", model, out=tmp_path)
    assert codes == [0] * world, logs[0][-3000:] + logs[-1][-2000:]
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)]
    tokens = world * BATCH * SEQ * STEPS
    assert all(r["learner"] == 0 and r["world"] == world and r["tokens"] == tokens for r in reports)
    merges = reports[0]["merges"]
    assert merges > 0 and all(r["merges"] == merges for r in reports)
    assert shard.finished
    entry = shard.report()["ledger"][0]
    assert entry["duplicates"] == 0 and entry["pushes"] == reports[0]["pushes"] > 0
    for p in range(FRAGMENTS):
        assert entry["merged"].get(p, 0) + entry["stale"].get(p, 0) == tokens, (p, entry)
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    assert set(shard.core.theta) == set(params)
    if sharding != "ddp":
        assert reports[0]["bytes_between_ranks"] > 0
        # Joining (seeding the shard: this learner is the run's first; then pulling Θ, each fragment decoded
        # whole at rank 0 before it is scattered) and leaving (every fragment's last push) hold one tensor,
        # or one fragment, at a time at rank 0: never more than the largest fragment alive at once. The pull
        # holds the largest fragment whole once (all of it, and nothing beside it).
        peaks, fragment = reports[0]["peak_gathered_bytes"], reports[0]["largest_fragment_bytes"]
        assert set(peaks) >= {"join", "finish"} and peaks["join"] == fragment and 0 < peaks["finish"] <= fragment, \
            (peaks, fragment)


@pytest.mark.parametrize("bad,words", [("tp", "Shard(dim=1)"), ("mixed", "mixed meshes"),
                                       ("disagree", "disagree about the model")])
def test_a_model_the_learner_cannot_sync_is_refused_in_one_line(syncer, bad, words, tmp_path):
    """Tensor-parallel placements, parameters on mixed meshes, and ranks that built different models:
    every rank refuses with one line, before any rank joins the syncer."""
    shard, address = syncer
    codes, logs, _ = launch(2, "refuse", "--bad", bad, "--syncer", address, out=tmp_path, timeout_s=60)
    assert codes == [3, 3], logs
    for log in logs:
        lines = [line for line in log.splitlines() if line.startswith("REFUSED: ")]
        assert len(lines) == 1 and words in lines[0], log[-2000:]
    assert shard.core is None and shard.report().get("ledger", {}) == {}  # nobody seeded or joined it


def test_a_rank_killed_mid_sync_ends_the_others_in_one_line(syncer, tmp_path):
    """Rank 1 dies between two steps: rank 0 stops at its next collective with one line, within the
    process group's timeout, instead of hanging; the syncer counted every push it took once."""
    shard, address = syncer
    codes, logs, _ = launch(2, "train", "--sharding", "fsdp", "--syncer", address, "--steps", str(STEPS),
                                  "--die-at-step", "6", "--timeout-s", str(COLLECTIVE_TIMEOUT_S), out=tmp_path,
                                  timeout_s=90)
    assert codes[1] == 9 and codes[0] == 1, logs[0][-3000:]
    lines = [line for line in logs[0].splitlines() if line.startswith("diloco: ")]
    assert len(lines) == 1, logs[0][-3000:]
    entry = shard.report()["ledger"].get(0, {"duplicates": 0})
    assert entry["duplicates"] == 0


@pytest.mark.parametrize("sharding,world", [("fsdp", 2), ("hsdp", 4)])
def test_a_sharded_checkpoint_resumes_exactly(sharding, world, tmp_path):
    """Each rank writes its rows (DCP) and a sealed sidecar; a fresh model and optimizer loaded from them
    train on to the same parameters and optimizer state, bit for bit, with each rank's data position."""
    codes, logs, _ = launch(world, "checkpoint", "--sharding", sharding, out=tmp_path)
    assert codes == [0] * world, logs[0][-3000:]
    for rank in range(world):
        result = json.loads((tmp_path / f"resume-{rank}.json").read_text())
        assert result == {"steps": 3, "data": {"learner": 0, "epoch": 0, "index": 3 + rank},
                          "model_equal": True, "optimizer_equal": True}


@pytest.mark.parametrize("saved_by,loaded_by", [(2, 4), (2, 1), (4, 2)])
def test_a_sharded_checkpoint_reshards_to_another_world_size(saved_by, loaded_by, tmp_path):
    """DCP stores global shapes: written by W ranks, loaded by W' ranks (one included), the model and optimizer
    hold exactly what was saved; the step count is kept and the data position dropped (it was a slice of
    the learner's shard that the new world cuts differently)."""
    codes, logs, _ = launch(saved_by, "reshard", "--phase", "save", out=tmp_path)
    assert codes == [0] * saved_by, logs[0][-3000:]
    codes, logs, _ = launch(loaded_by, "reshard", "--phase", "load", out=tmp_path)
    assert codes == [0] * loaded_by, logs[0][-3000:]
    result = json.loads((tmp_path / f"reshard-{loaded_by}.json").read_text())
    assert result == {"steps": 3, "data": None, "written_by": saved_by, "model_equal": True,
                      "optimizer_equal": True}


def test_a_damaged_sharded_checkpoint_is_refused_by_every_rank(tmp_path):
    """A flipped byte in one rank's file: every rank refuses in one line, and nothing was loaded."""
    codes, logs, _ = launch(2, "checkpoint", "--damage", out=tmp_path)
    assert codes == [0, 0], logs[0][-3000:]
    for rank, log in enumerate(logs):
        lines = [line for line in log.splitlines() if line.startswith("REFUSED: ")]
        assert len(lines) == 1 and "damaged" in lines[0], log[-2000:]
        assert json.loads((tmp_path / f"refused-{rank}.json").read_text()) == {"unchanged": True}


BUILTIN = ["learners.count=1", "strategy=diloco", "outer.H=4", f"outer.fragments={FRAGMENTS}", "train.tokens=3072"]


@pytest.mark.parametrize("sharding,world", [("fsdp", 2), ("hsdp", 4)])
def test_the_builtin_learner_trains_a_sharded_model(sharding, world, tmp_path):
    """`python -m diloco.learner` under a process group with train.sharding: every rank trains its share,
    synchronous DiLoCo's rounds close with this learner, every token is merged once per fragment, and the
    checkpoint is DCP's (a folder, a sealed sidecar per rank)."""
    sets = [x for item in [*TINY_SETS, *BUILTIN, f"train.sharding={sharding}"] for x in ("--set", item)]
    with serving_shard(*BUILTIN, workers=8) as (shard, address):
        codes, logs, _ = launch(world, out=tmp_path, command=[
            sys.executable, "-m", "diloco.learner", "--syncer", address, "--id", "0", "--out", str(tmp_path),
            "-q", *sets])
    assert codes == [0] * world, logs[0][-3000:]
    report = json.loads((tmp_path / "learners" / "learner-0.json").read_text())
    tokens = report["tokens"]
    assert report["world"] == world and tokens == world * report["steps"] * 4 * 16 and report["merges"] > 0
    assert report["eval_loss"] is not None
    assert shard.finished
    entry = shard.report()["ledger"][0]
    assert entry["duplicates"] == 0
    fragments = set(entry["merged"]) | set(entry["stale"])  # synchronous DiLoCo syncs the model whole
    assert fragments and all(entry["merged"].get(p, 0) + entry["stale"].get(p, 0) == tokens for p in fragments)
    folder = tmp_path / "checkpoints" / "learner-0.dcp"
    assert (folder / "latest").is_file()
    slot = folder / load_checked(folder / "latest", "checkpoint", "")["slot"]  # the complete one of two slots
    assert (slot / ".metadata").is_file()
    assert sorted(f.name for f in slot.glob("rank-*.state")) == [f"rank-{r}.state" for r in range(world)]


def test_a_sharded_checkpoint_is_refused_in_one_line_by_an_unsharded_learner(tmp_path):
    """A learner restarted as one process finds its DCP checkpoint: refused before it trains or joins, in
    one line that says what to do (its optimizer and data position cannot be honoured)."""
    from diloco.client.builtin_loop import run_learner
    from diloco.errors import DilocoError

    folder = tmp_path / "checkpoints" / "learner-0.dcp"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"x")
    (folder / "rank-0.state").write_bytes(b"x")
    with pytest.raises(DilocoError) as refused:
        run_learner(tiny_config(), syncer=None, learner=0, out=tmp_path)
    assert "written by a sharded learner" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "learners").exists()
