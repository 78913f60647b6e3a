"""Codecs on the wire of the simulator: anchors stay exact under a lossy downlink; bytes are counted."""

import pytest
import torch

from conftest import tiny_config
from diloco.codecs import get_codec
from diloco.core.messages import MESSAGE_HEADER_BYTES
from diloco.sim.driver import Simulation

pytestmark = pytest.mark.integration  # every test is a whole training run in the simulator

HETERO = ["strategy=decoupled", "learners.speeds=[1, 1, 0.5, 0.25]", "learners.jitter=0.1", "outer.H=6",
          "outer.fragments=3", "outer.tau=2", "train.tokens=20480"]


@pytest.mark.parametrize("down", ["bf16", "int8", "int4", "fp4"])
def test_anchors_equal_what_the_syncer_believes_bit_for_bit(down):
    crash = "failures.crashes=[{learner = 1, at_s = 3.0}]"
    sim = Simulation(tiny_config(*HETERO, f"codec.down={down}", "codec.up=int4", crash, "failures.recovery_s=2"))
    checked = 0
    original = sim._on_update

    def check_after_each_merge(payload):
        original(payload)
        for learner in sim.learners:
            core = learner.core
            if core is None or learner.finished:
                continue
            for p, version in enumerate(core.anchor_versions):
                held = sim.syncer.held_values(learner.index, p)
                if version == sim.syncer.held_versions[learner.index][p] and held is not None:
                    nonlocal checked
                    for name, value in core.anchors[p].items():
                        assert torch.equal(value, held[name]), (learner.index, p, name)
                    checked += 1

    sim._on_update = check_after_each_merge
    result = sim.run()
    assert checked > 100
    assert result.per_learner[1].crashes == 1


def test_lossy_downlink_sends_differences_that_track_theta():
    sim = Simulation(tiny_config(*HETERO, "codec.down=int8"))
    sim.run()
    for p in sim.syncer.fragments:
        for name, value in sim.syncer.fragments[p].downlink.published.items():
            assert torch.allclose(value, sim.syncer.theta[name], atol=0.05), (p, name)


def test_bytes_follow_the_codec_exactly():
    sim = Simulation(tiny_config("strategy=diloco", "outer.H=5", "codec.up=int4", "codec.down=bf16"))
    result = sim.run()
    rounds = result.rounds
    up, down = get_codec("int4"), get_codec("bf16")
    numels = [p.numel() for p in sim.eval_model.parameters()]
    push = MESSAGE_HEADER_BYTES + sum(up.wire_bytes(n, 64) for n in numels)
    answer = MESSAGE_HEADER_BYTES + sum(down.wire_bytes(n) for n in numels)
    for report in result.per_learner:
        progress = MESSAGE_HEADER_BYTES + 8  # a report after every step, one fragment's schedule in it
        assert report.bytes_up == rounds * push + report.steps * progress + MESSAGE_HEADER_BYTES  # and the leave
        assert report.bytes_down == (rounds - 1) * answer
    fp32 = Simulation(tiny_config("strategy=diloco", "outer.H=5")).run()
    assert fp32.wire_bytes_up / result.wire_bytes_up > 6


def test_error_feedback_is_carried_by_the_learner():
    sim = Simulation(tiny_config(*HETERO, "codec.up=fp4", "codec.error_feedback=true"))
    result = sim.run()
    assert all(lr.core is None or lr.core.feedback is not None for lr in sim.learners)
    assert result.final_eval_loss < 5.545
