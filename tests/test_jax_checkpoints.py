"""A JAX learner's own checkpoint: the torch learner's file, checks and writer, its optax state converted
bit for bit. A learner killed mid-run and restarted resumes exactly what its checkpoint saved (optax state,
step, data position; its unpushed progress on top of Θ) and nothing is counted twice; a damaged or
foreign checkpoint stops the learner in one line, as it stops a torch learner."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import TINY, child_env, tiny_config, wait_for
from diloco.client.builtin_loop import Standalone, _data_shard, _learner_state
from diloco.client.checkpoints import optimizer_file, read_checkpoint, write_checkpoint
from diloco.client.packed_state import packed_copy, unpacked
from diloco.errors import DilocoError
from diloco.materials import prepare
from diloco.metrics.records import learner_lives, records_of
from diloco.shard.server import ShardPlan, SyncerShard, serve
from diloco.state_files import file_key, load_checked
from test_crash_resume import counted_seqs, newest_push_step

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

from diloco.jax.equivalence import flax_params_for  # noqa: E402
from diloco.jax.flax_gpt import FlaxGPT  # noqa: E402
from diloco.jax.jax_checkpoints import optax_state_dict  # noqa: E402
from diloco.jax.jax_loop import _checked, start_jax_learner, train_jax_learner  # noqa: E402
from diloco.jax.jax_training import JaxReplica, JaxStep  # noqa: E402
from diloco.jax.name_map import GPT_NAMES  # noqa: E402

SETTINGS = ("learners.count=1", "outer.H=8", "outer.fragments=2", "train.tokens=6400", "metrics.every_steps=1")
TOKENS_PER_STEP = 4 * 16  # TINY's batch × sequence
KILL_AT_STEP = 30


_JITTED: dict[str, JaxStep] = {}
"""A config's `train` section (its repr) → the jitted step its replicas share."""


def replica(config=None, steps: int = 0) -> JaxReplica:
    """The built-in GPT in Flax on learner 0's shard, trained `steps` steps."""
    config = config or tiny_config(*SETTINGS)
    materials = prepare(config)
    model = FlaxGPT(materials.model.cfg)
    params = flax_params_for(model, {n: p.detach() for n, p in materials.model.named_parameters()})
    replica = JaxReplica(params, lambda p, x, y: model.apply({"params": p}, x, y), config.train,
                         _data_shard(config, materials.corpus.train, 0, 0, 1), planned_steps=100)
    # Every replica of one training config runs the first one's jitted step (the same function of the
    # same model): each JaxReplica jits a closure of its own, whose compilation (~4 s on two cores) was
    # most of these tests' time.
    jitted = _JITTED.setdefault(repr(config.train), replica.jitted)
    replica.jitted, replica._step = jitted, jitted.step
    for _ in range(steps):
        replica.train_step()
    return replica


def same_leaves(a, b) -> bool:
    left, right = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(left) == len(right) and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
                                           for x, y in zip(left, right))


def test_a_checkpoint_restores_the_optax_state_step_and_data_position_bit_for_bit(tmp_path):
    """Written sealed and read back through the torch learner's checks: a fresh replica restored from it
    takes the next steps exactly as the one that saved it."""
    saving = replica(steps=3)
    key = file_key(b"run secret")
    write_checkpoint(packed_copy(_learner_state(saving.model, saving, Standalone(0))), tmp_path / "c.pt", key)
    state = read_checkpoint(tmp_path / "c.pt", 1000, saving.optimizer, key)
    assert state["steps"] == 3 and state["data"] == saving.sampler.state_dict()
    restored = replica()
    restored.optimizer.load_state_dict(state["optimizer"])
    restored.sampler.load_state_dict(state["data"])
    restored.steps, restored.params = state["steps"], saving.params
    assert same_leaves(restored.opt_state, saving.opt_state)
    for _ in range(2):
        saving.train_step()
        restored.train_step()
    assert same_leaves(restored.params, saving.params) and same_leaves(restored.opt_state, saving.opt_state)


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def optax_entry(state: dict, where: str, value) -> None:
    state["optimizer"]["state"][0][where] = value


DAMAGES = {
    "a flipped byte": ("is damaged", None),
    "moments of another shape": ("of shape [3]", lambda s: optax_entry(s, "1.inner_state.0.mu", torch.zeros(3))),
    "a NaN moment": ("NaN or Inf", lambda s: optax_entry(s, "1.inner_state.0.nu", torch.full_like(
        s["optimizer"]["state"][0]["1.inner_state.0.nu"], float("nan")))),
    "no step count": ("'1.count'", lambda s: s["optimizer"]["param_groups"][0]["optax"].pop("1.count")),
    "too many steps": ("more than this run could have taken", lambda s: s.update(steps=10 ** 9)),
}


@pytest.fixture(scope="module")
def saved_state() -> dict:
    """What a JAX learner's checkpoint holds after two steps (each test damages its own copy)."""
    saving = replica(steps=2)
    return copy.deepcopy(_learner_state(saving.model, saving, Standalone(0)))


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_or_foreign_checkpoint_stops_the_learner_in_one_line_and_changes_nothing(tmp_path, damage,
                                                                                           saved_state):
    """As a torch learner does: the line names the file, why, and what to do (delete it to take Θ)."""
    config = tiny_config(*SETTINGS)
    path = tmp_path / "learner-0.pt"
    state = copy.deepcopy(saved_state)
    expected, change = DAMAGES[damage]
    if change is not None:
        change(state)
    write_checkpoint(state, path)
    if change is None:
        flip_a_byte(path)
    restarting = replica(config)
    before = restarting.opt_state
    with pytest.raises(DilocoError) as refused:
        _checked(path, config, 0, True, restarting, None)
    line = str(refused.value)
    assert "\n" not in line and expected in line and str(path) in line and "delete it" in line
    assert restarting.opt_state is before and restarting.steps == 0


def _learner(address: str, out) -> subprocess.Popen:
    sets = [x for o in (*TINY, *SETTINGS) for x in ("--set", o)]
    return subprocess.Popen([sys.executable, "-m", "diloco", "learner", "--framework", "jax", "--syncer", address,
                             "--id", "0", "--out", str(out), *sets], env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=open(out / "learner.log", "ab"), start_new_session=True)


def _steps(out) -> int:
    path = out / "metrics" / "learner-0.jsonl"
    records = records_of(path, "learner") if path.is_file() else []
    return records[-1]["steps"] if records else 0


@pytest.mark.integration
def test_a_jax_learner_killed_mid_run_resumes_exactly_what_its_checkpoint_saved(tmp_path):
    """SIGKILLed at a known step, restarted as `diloco run` and `diloco chaos` restart it (its id and
    output folder): it starts at the checkpoint's step and data position with its optax state bit for bit,
    its params Θ minus the progress no push carried; it then trains to the end with nothing counted
    twice and at most the steps since its checkpoint lost."""
    config = tiny_config(*SETTINGS)
    shard = SyncerShard(config, ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    try:
        first = _learner(address, tmp_path)
        wait_for(lambda: _steps(tmp_path) >= KILL_AT_STEP, 240,
                 lambda: "the kill step; the log ends: " + (tmp_path / "learner.log").read_text()[-2000:])
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        counted_seqs(shard)  # the killed learner's last pushes taken
        recorded = _steps(tmp_path)
        killed_at = max(recorded, newest_push_step(shard))  # the kill may fall between a push and its record
        saved = unpacked(load_checked(tmp_path / "checkpoints" / "learner-0.pt", "checkpoint", ""))
        moments = optimizer_file(tmp_path / "checkpoints" / "learner-0.pt")  # saved every few checkpoints
        saved["optimizer"] = unpacked(load_checked(moments, "checkpoint", ""))["optimizer"]
        theta = {n: t.clone() for n, t in shard.core.theta.items()}
        # Per fragment, the newest push of it the shard counted: the kill may fall before or after a push
        # that followed the checkpoint (the period follows measured times), so each fragment's rule is checked.
        counted = dict(shard.core.ledger[0].fragment_seqs)
        life = start_jax_learner(config, syncer=address, learner=0, out=tmp_path)
        restored = life.replica
        assert restored.steps == life.resumed_from == saved["steps"] > 0
        assert restored.sampler.state_dict() == saved["data"]
        now = optax_state_dict(restored.opt_state, restored.params, GPT_NAMES)
        for i, per_param in saved["optimizer"]["state"].items():
            for where, value in per_param.items():
                assert torch.equal(now["state"][i][where], value), (i, where)
        for where, value in saved["optimizer"]["param_groups"][0]["optax"].items():
            assert torch.equal(now["param_groups"][0]["optax"][where], value), where
        params = GPT_NAMES.theta_from_params(restored.params)
        assert any(bool(u.any()) for entry in saved["sync"]["fragments"] for u in entry["unpushed"].values())
        for p, entry in enumerate(saved["sync"]["fragments"]):
            # A fragment pushed after the checkpoint takes Θ (that push carried its progress); the others
            # resume their own: Θ minus the progress no push carried (and minus a push in flight not counted).
            pushed_since = counted.get(p, 0) > saved["sync"]["seq"]
            assert (life.sync.resumed[p] is not None) == pushed_since, (p, counted, life.sync.resumed)
            sent = entry["in_flight"]["deltas"] if entry["in_flight"] and \
                shard.core.ledger[0].last_seq < entry["in_flight"]["seq"] else {}
            for name, unpushed in entry["unpushed"].items():
                expected = theta[name].clone()
                if not pushed_since:
                    expected.sub_(unpushed)
                    if name in sent:
                        expected.sub_(sent[name])
                assert torch.equal(params[name], expected), name
        report = train_jax_learner(life, out=tmp_path)
        wait_for(lambda: shard.finished, 60, "the run to end")
    finally:
        shard.stop()
        server.stop(0)
    assert report["resumed_from_step"] == saved["steps"]
    lives = learner_lives(tmp_path / "metrics")[0]
    assert len(lives) == 2 and lives[0]["steps"] == recorded and killed_at - recorded <= 1
    trained = killed_at * TOKENS_PER_STEP + lives[1]["tokens"]
    entry = shard.core.ledger[0]
    assert entry.duplicates == 0
    since_checkpoint = (killed_at - saved["steps"]) * TOKENS_PER_STEP
    for p in range(2):
        lost = trained - entry.merged[p] - entry.stale[p]
        assert 0 <= lost <= since_checkpoint, (p, lost, since_checkpoint)
