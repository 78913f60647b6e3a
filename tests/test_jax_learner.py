"""JAX learners against a live syncer shard over gRPC: alone, next to a PyTorch learner, and refused when
their model is not the run's.

The JAX learner is `diloco.Learner` over a host mirror: these tests check that what the mirror copies
(device → host when a push or a merge reads a tensor, host → device when a merge wrote it) leaves Θ,
the ledger and the learner's params exactly as a torch learner would.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

import numpy as np
import pytest
import torch

from conftest import serving_shard, tiny_config
from diloco.client.learner_client import Learner
from diloco.errors import DilocoError
from diloco.models.gpt import GPT, GPTConfig
from diloco.shard.server import SyncerShard

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from diloco.jax.flax_gpt import FlaxGPT, gpt_layout  # noqa: E402
from diloco.jax.host_mirror import HostMirror  # noqa: E402
from diloco.jax.jax_learner import JaxLearner  # noqa: E402
from diloco.jax.equivalence import flax_params_for  # noqa: E402
from diloco.jax.jax_training import jitted_step  # noqa: E402
from diloco.jax.name_map import GPT_NAMES  # noqa: E402

pytestmark = pytest.mark.integration  # every test trains against a live shard over real gRPC

VOCAB, SEQ, BATCH, STEPS = 32, 16, 4, 30
CFG = GPTConfig(vocab_size=VOCAB, context=SEQ, layers=1, width=32, heads=2)


@pytest.fixture
def syncer():
    """Start a syncer shard on a free port; yields start(*overrides) -> (shard, address); always stopped."""
    with ExitStack() as stack:
        yield lambda *overrides: stack.enter_context(serving_shard(
            "strategy=decoupled", "outer.H=5", "outer.fragments=3", "train.tokens=100000000", *overrides, workers=8))


def torch_gpt(cfg: GPTConfig = CFG, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def join_jax(address: str, cfg: GPTConfig = CFG, seed: int = 0) -> tuple[JaxLearner, FlaxGPT]:
    model = FlaxGPT(cfg)
    params = flax_params_for(model, {n: p.detach() for n, p in torch_gpt(cfg, seed).named_parameters()})
    order, embeddings = gpt_layout(cfg)
    return JaxLearner(params, syncer=address, order=order, embeddings=embeddings), model


def train_jax(learner: JaxLearner, model: FlaxGPT, steps: int, seed: int) -> None:
    """The user's own loop: a jitted optax step, then params = learner.step(params, tokens)."""
    config = tiny_config()
    jitted = jitted_step(lambda p, x, y: model.apply({"params": p}, x, y), config.train)
    params = learner.params
    state = jitted.optimizer.init(params)
    rng = np.random.default_rng(seed)
    done = 0
    while not learner.should_stop and done < steps:
        x = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), dtype=jnp.int32)
        params, state, _ = jitted.step(params, state, jnp.float32(3e-3), x, x)
        params = learner.step(params, tokens=x.size)
        done += 1


def train_torch(model: GPT, learner: Learner, steps: int, seed: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    done = 0
    while not learner.should_stop and done < steps:
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        model(x, x).backward()
        optimizer.step()
        optimizer.zero_grad()
        learner.step(tokens=x.numel())
        done += 1


def assert_every_token_counted(shard: SyncerShard, reports: list[dict], fragments: int) -> None:
    ledger = shard.report()["ledger"]
    for report in reports:
        entry = ledger[report["learner"]]
        assert report["tokens"] == report["steps"] * BATCH * SEQ
        assert entry["duplicates"] == 0
        assert entry["pushes"] == report["pushes"] > 0
        for p in range(fragments):
            assert entry["merged"].get(p, 0) + entry["stale"].get(p, 0) == report["tokens"], (p, entry)


def test_a_jax_learner_alone_ends_with_theta_equal_to_its_params(syncer):
    """One learner, a plain outer step (lr 1, no momentum): every merge sets Θ to what the learner
    pushed, so after close Θ is the JAX learner's final params, tensor for tensor, and every token is
    in the ledger: the mirror copied what was pushed and wrote back what was merged."""
    shard, address = syncer("learners.count=1", "outer.lr=1.0", "outer.momentum=0.0")
    learner, model = join_jax(address)
    initial = GPT_NAMES.theta_from_params(learner.params)
    train_jax(learner, model, STEPS, seed=1)
    report = learner.close()
    assert shard.finished and report["merges"] > 0 and report["steps"] == STEPS
    assert_every_token_counted(shard, [report], fragments=3)
    final = GPT_NAMES.theta_from_params(learner.params)
    theta = shard.core.theta
    assert set(theta) == set(gpt_layout(CFG)[0])
    for name in initial:
        assert not torch.equal(theta[name], initial[name]), name
        torch.testing.assert_close(theta[name], final[name], rtol=0, atol=1e-5, msg=name)


def test_a_torch_and_a_jax_learner_train_one_theta(syncer):
    """A PyTorch learner seeds Θ, a JAX learner joins it and loads the same values; both take part in
    rounds, each push counted once, every token of both in the ledger."""
    shard, address = syncer("learners.count=2")
    torch_model = torch_gpt(seed=0)
    seeded = {n: p.detach().clone() for n, p in torch_model.named_parameters()}
    torch_learner = Learner(torch_model, syncer=address)
    jax_learner, flax_model = join_jax(address, seed=7)  # its own init differs: Θ's values replace it
    loaded = GPT_NAMES.theta_from_params(jax_learner.params)
    for name, value in seeded.items():
        assert torch.equal(loaded[name], value), name
    reports: list[dict] = [{}, {}]
    errors: list[BaseException] = []

    def run(m: int) -> None:
        try:
            if m == 0:
                train_torch(torch_model, torch_learner, STEPS, seed=100)
                reports[0] = torch_learner.close()
            else:
                train_jax(jax_learner, flax_model, STEPS + 5, seed=101)
                reports[1] = jax_learner.close()
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,), daemon=True) for m in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert all(r["merges"] > 0 for r in reports)
    assert_every_token_counted(shard, reports, fragments=3)


def test_a_jax_model_that_is_not_the_runs_is_refused_at_join_naming_the_tensor(syncer):
    """Θ seeded by a torch GPT of width 32; a JAX GPT of width 48 is refused in one line that names the
    first tensor that differs, and the run goes on with the learner not counted."""
    shard, address = syncer("learners.count=2")
    seeder = Learner(torch_gpt(), syncer=address)
    wider = GPTConfig(vocab_size=VOCAB, context=SEQ, layers=1, width=48, heads=2)
    with pytest.raises(DilocoError) as refused:
        join_jax(address, wider)
    seeder.close()  # its link's threads end with the test
    message = str(refused.value)
    assert "\n" not in message and "does not match the run" in message
    assert "weight" in message and "48" in message


def test_pushes_staged_off_the_step_carry_exactly_what_copies_on_the_step_would(syncer, monkeypatch):
    """Synchronous DiLoCo, one learner (merges at fixed steps: the run is deterministic): with its pushes'
    device → host copies on the staging thread, Θ and the learner's params end bit for bit as with every
    copy made on the training thread, and the staging thread made the pushes' copies."""
    ends = []
    for staged in (True, False):
        if not staged:
            monkeypatch.setattr(HostMirror, "stage_pushes", lambda self, core: None)
        shard, address = syncer("strategy=diloco", "learners.count=1")
        learner, model = join_jax(address)
        train_jax(learner, model, STEPS, seed=1)
        report = learner.close()
        assert report["steps"] == STEPS and report["merges"] > 0
        assert (learner.mirror.staged > 0) == staged
        ends.append(({n: t.clone() for n, t in shard.core.theta.items()}, GPT_NAMES.theta_from_params(learner.params),
                     learner.mirror))
    (theta, params, mirror), (theta_twin, params_twin, mirror_twin) = ends
    # Each staged copy is one the training thread no longer makes.
    assert mirror.copied_on_step + mirror.staged == mirror_twin.copied_on_step
    for name in theta:
        assert torch.equal(theta[name], theta_twin[name]), name
        assert torch.equal(params[name], params_twin[name]), name
