"""The invariants of DESIGN.md that tie our machinery to plain reference loops written here."""

import copy

import pytest
import torch

from conftest import tiny_config
from diloco.data import ShardSampler, load_corpus
from diloco.models import build_model
from diloco.sim.driver import Simulation

pytestmark = pytest.mark.integration  # every test is a whole training run in the simulator

PLAIN = ["train.schedule=constant", "train.warmup_steps=0", "train.grad_clip=0", "train.weight_decay=0",
         "model.factory=toy_models:tiny_lm"]


def reference_setup(config, learners):
    corpus = load_corpus()
    model = build_model(config, corpus.vocab_size)
    t = config.train
    samplers = [ShardSampler(corpus.train, learner=m, learners=learners, seq_len=t.seq_len,
                             batch_size=t.batch_size, seed=config.seed) for m in range(learners)]
    steps = t.tokens // (learners * t.batch_size * t.seq_len)
    return model, samplers, steps


def adamw(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def assert_same_params(actual: dict, model, atol=1e-5):
    for name, p in model.named_parameters():
        torch.testing.assert_close(actual[name], p.detach(), atol=atol, rtol=1e-4, msg=name)


def test_one_learner_H1_eta1_mu0_alpha0_is_plain_training():
    for strategy in ("diloco", "streaming"):
        config = tiny_config(*PLAIN, f"strategy={strategy}", "learners.count=1", "outer.H=1", "outer.lr=1",
                             "outer.momentum=0", "outer.alpha=0", "outer.tau=0", "outer.fragments=1")
        sim = Simulation(config)
        sim.run()
        model, (sampler,), steps = reference_setup(config, 1)
        opt = adamw(model, config.train.lr)
        for _ in range(steps):
            x, y = sampler.next_batch()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        assert_same_params(sim.syncer.theta, model)


def test_synchronous_diloco_matches_a_reference_loop():
    # Mixed speeds and jitter must not matter: everyone waits for everyone.
    config = tiny_config(*PLAIN, "strategy=diloco", "learners.speeds=[1, 0.5, 0.25]", "learners.jitter=0.2",
                         "outer.H=4", "outer.lr=0.7", "outer.momentum=0.9")
    sim = Simulation(config)
    sim.run()
    init, samplers, steps = reference_setup(config, 3)
    assert steps % 4 != 0, "the test should cover the final partial round too"
    theta = {n: p.detach().clone() for n, p in init.named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in theta.items()}
    models = [copy.deepcopy(init) for _ in range(3)]
    opts = [adamw(m, config.train.lr) for m in models]
    for t in range(1, steps + 1):
        for model, opt, sampler in zip(models, opts, samplers):
            x, y = sampler.next_batch()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        if t % 4 == 0 or t == steps:
            with torch.no_grad():
                for name in theta:
                    delta = sum(theta[name] - dict(m.named_parameters())[name] for m in models) / 3
                    momentum[name] = 0.9 * momentum[name] + delta
                    theta[name] -= 0.7 * (delta + 0.9 * momentum[name])
                for m in models:
                    for name, p in m.named_parameters():
                        p.copy_(theta[name])
    for name, value in theta.items():
        torch.testing.assert_close(sim.syncer.theta[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_data_parallel_is_one_model_on_the_joint_batch():
    config = tiny_config(*PLAIN, "strategy=ddp", "learners.speeds=[1, 0.5]")
    sim = Simulation(config)
    sim.run()
    model, samplers, steps = reference_setup(config, 2)
    opt = adamw(model, config.train.lr)
    for _ in range(steps):
        losses = [model(*s.next_batch()) for s in samplers]
        (sum(losses) / len(losses)).backward()
        opt.step()
        opt.zero_grad()
    for learner in sim.learners:
        assert_same_params(dict(learner.replica.model.named_parameters()), model)


def test_streaming_with_one_fragment_no_overlap_is_diloco():
    common = ["outer.H=4", "outer.fragments=1", "outer.tau=0", "outer.alpha=0", "learners.jitter=0.1"]
    diloco = Simulation(tiny_config(*common, "strategy=diloco")).run()
    streaming = Simulation(tiny_config(*common, "strategy=streaming")).run()
    assert streaming.final_eval_loss == diloco.final_eval_loss
    assert streaming.training_time_s == diloco.training_time_s
    assert streaming.wire_bytes_up == diloco.wire_bytes_up
