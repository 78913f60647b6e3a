"""A Hugging Face causal LM as a learner: `diloco.Learner` takes any nn.Module, tied weights included.

A tiny randomly initialised GPT-2 trains against a syncer shard served in-process over gRPC. Nothing
is downloaded: the model is built from a config, never `from_pretrained`.
"""

from __future__ import annotations

import os
import threading
from contextlib import ExitStack

import pytest
import torch

from conftest import serving_shard
from diloco.shard.server import SyncerShard
from diloco.errors import DilocoError
from diloco.client.learner_client import Learner

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing is downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration  # every test trains against a live shard over real gRPC
GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel  # the slow lazy import, once

VOCAB, SEQ, BATCH = 64, 16, 4
STEPS = 30


def gpt2(n_embd: int = 32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=n_embd, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def syncer():
    """Start a syncer shard on a free port; yields start(*overrides) -> (shard, address); always stopped."""
    with ExitStack() as stack:
        yield lambda *overrides: stack.enter_context(serving_shard(
            "strategy=decoupled", "outer.H=5", "outer.fragments=2", "train.tokens=100000000", *overrides, workers=8))


def train(model: torch.nn.Module, learner: Learner, steps: int, seed: int) -> None:
    """The user's own loop: HF forward with labels, AdamW, then learner.step(tokens)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    done = 0
    while not learner.should_stop and done < steps:
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        learner.step(tokens=x.numel())
        done += 1


def assert_ledger_counts_every_token(shard: SyncerShard, reports: list[dict], fragments: int) -> None:
    """Every push was counted once, and every token trained reached Θ exactly once per fragment
    (merged on time or stale, the pushes of `finish` included)."""
    ledger = shard.report()["ledger"]
    for report in reports:
        entry = ledger[report["learner"]]
        assert report["tokens"] == report["steps"] * BATCH * SEQ
        assert entry["duplicates"] == 0
        assert entry["pushes"] == report["pushes"] > 0
        for p in range(fragments):
            assert entry["merged"].get(p, 0) + entry["stale"].get(p, 0) == report["tokens"], (p, entry)
        assert entry["steps_merged"] == fragments * report["steps"]


def test_a_gpt2_learner_trains_through_the_syncer_and_theta_ends_as_its_weights(syncer):
    """One learner and a plain outer step (lr 1, no momentum): every merge sets Θ to what the learner
    pushed, so after close Θ is the learner's final weights; nothing it trained is lost. GPT-2 ties
    lm_head to wte: the one shared Parameter is synced once, and the tie survives the merges."""
    shard, address = syncer("learners.count=1", "outer.lr=1.0", "outer.momentum=0.0")
    model = gpt2()
    initial = trainable(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" not in initial
    learner = Learner(model, syncer=address)
    train(model, learner, STEPS, seed=1)
    report = learner.close()
    assert shard.finished
    assert model.lm_head.weight is model.transformer.wte.weight

    assert report["steps"] == STEPS and report["merges"] > 0
    theta = shard.core.theta
    assert set(theta) == set(initial)
    assert_ledger_counts_every_token(shard, [report], fragments=2)
    status = shard.report()
    assert len(status["rounds"]) > 0 and all(v > 0 for v in status["versions"].values())
    final = trainable(model)
    for name in initial:
        assert not torch.equal(theta[name], initial[name]), name
        torch.testing.assert_close(theta[name], final[name], rtol=0, atol=1e-5, msg=name)


def test_two_gpt2_learners_merge_rounds_and_account_for_every_token(syncer):
    """Two learners in threads, each with its own data: both take part in rounds, each push is
    counted once, and every token either trained is in the ledger."""
    shard, address = syncer("learners.count=2")
    models = [gpt2(seed=m) for m in range(2)]
    initial = trainable(models[0])
    reports: list[dict] = [{}, {}]
    errors: list[BaseException] = []

    def run(m: int) -> None:
        try:
            learner = Learner(models[m], syncer=address)
            try:
                train(models[m], learner, STEPS + 5 * m, seed=100 + m)
            finally:
                reports[m] = learner.close()
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,), daemon=True) for m in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a learner thread hung"
    if errors:
        raise errors[0]

    assert shard.finished
    assert sorted(r["learner"] for r in reports) == [0, 1]
    assert sorted(r["steps"] for r in reports) == [STEPS, STEPS + 5]
    assert_ledger_counts_every_token(shard, reports, fragments=2)
    rounds = shard.report()["rounds"]
    assert {m for r in rounds for m in r["participants"]} == {0, 1}
    assert all(r["merges"] > 0 for r in reports)
    theta = shard.core.theta
    assert set(theta) == set(initial)
    assert all(not torch.equal(theta[n], initial[n]) for n in initial)


def test_a_learner_whose_model_differs_is_refused_before_its_weights_are_touched(syncer):
    """The first learner seeds Θ; a second one with another width gets a one-line error naming the
    mismatch, and its model is left as it was."""
    shard, address = syncer("learners.count=1")
    first = Learner(gpt2(), syncer=address)
    wider = gpt2(n_embd=48)
    before = trainable(wider)
    try:
        with pytest.raises(DilocoError, match="does not match"):
            Learner(wider, syncer=address, connect_timeout_s=5)
    finally:
        first.close()
    after = trainable(wider)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert {n: tuple(t.shape) for n, t in shard.core.theta.items()} == \
        {n: tuple(p.shape) for n, p in first.params.items()}


def test_a_refused_learner_does_not_hold_up_the_run(syncer):
    """A learner refused for its model never took part: once the accepted learner leaves, the run is over
    (a learner counted alive forever would block synchronous rounds and shrink every decoupled step)."""
    shard, address = syncer("learners.count=1")
    first = Learner(gpt2(), syncer=address)
    with pytest.raises(DilocoError, match="does not match"):
        Learner(gpt2(n_embd=48), syncer=address, connect_timeout_s=5)
    first.close()
    assert shard.core.alive == set()
    assert shard.finished
