"""A learner's checkpoint is copied into one buffer per dtype (`client/packed_state.py`): it must read back
as exactly the state it was taken from, and a reference its buffers do not hold must be refused in one line."""

from __future__ import annotations

import pytest
import torch

from diloco.client.checkpoints import CheckpointWriter, read_checkpoint, write_checkpoint
from diloco.client.packed_state import PACKED, REF, packed_copy, unpacked
from diloco.errors import DilocoError
from diloco.models.gpt import GPT, GPTConfig


def assert_same(a, b) -> None:
    """Equal bit for bit: the same nesting and container types, tensors of the same dtype, shape and bytes."""
    assert type(a) is type(b) or isinstance(a, dict) and isinstance(b, dict)  # a state_dict's OrderedDict
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        if a.device.type == "cpu":
            assert torch.equal(raw_bytes(a), raw_bytes(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(5, 3, generator=g), "w_t": torch.randn(3, 5, generator=g).t(),
                      "half": torch.randn(4, generator=g).to(torch.bfloat16), "empty": torch.zeros(0, 7)},
            "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.full((2, 2), float("nan"))}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]},
            "data": {"learner": 1, "epoch": 0, "index": 96}, "steps": 7, "mask": torch.tensor([True, False]),
            "ids": torch.arange(6, dtype=torch.int64).view(2, 3), "meta": torch.empty(3, device="meta")}


def test_a_packed_copy_reads_back_bit_for_bit_and_training_can_no_longer_change_it():
    state = mixed_state()
    packed = packed_copy(state)
    assert set(packed["buffers"]) == {"float32", "bfloat16", "bool", "int64"}  # one buffer per dtype
    state["model"]["w"].add_(1.0)  # training goes on after the copy
    original = mixed_state()
    assert_same(unpacked(packed), original)
    assert unpacked(original) is original  # a state saved before packing reads as it was


def test_a_learners_checkpoint_written_packed_restores_its_optimizer_exactly(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, context=8, layers=1, width=16, heads=2, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 32, (2, 9))
    model(x[:, :-1], x[:, 1:]).backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "data": {"learner": 0, "epoch": 0, "index": 2}, "steps": 1}
    writer = CheckpointWriter(tmp_path / "learner-0.pt")
    writer.save(lambda: state, wait=True)
    assert writer.written == 1 and writer.write_cpu_s > 0
    read = read_checkpoint(tmp_path / "learner-0.pt", 100, optimizer)
    assert_same(read, {**{k: v for k, v in state.items() if k != "optimizer"}, "optimizer": state["optimizer"]})
    restored = torch.optim.AdamW(model.parameters(), lr=1e-2)
    restored.load_state_dict(read["optimizer"])
    assert_same(restored.state_dict(), optimizer.state_dict())


def retarget(packed: dict, change) -> dict:
    change(packed)
    return packed


TAMPERING = {
    "a reference past its buffer": ("past its buffer", lambda p: p["tree"]["model"]["w"][REF].__setitem__(1, 10 ** 6)),
    "a negative offset": ("malformed packed tensor reference",
                          lambda p: p["tree"]["model"]["w"][REF].__setitem__(1, -3)),
    "an unknown buffer": ("malformed packed tensor reference",
                          lambda p: p["tree"]["model"]["w"][REF].__setitem__(0, "float8")),
    "a buffer of another dtype": ("not one flat tensor", lambda p: p["buffers"].__setitem__(
        "int64", p["buffers"]["int64"].to(torch.int32))),
    "a buffer that is not flat": ("not one flat tensor", lambda p: p["buffers"].__setitem__(
        "bool", p["buffers"]["bool"].view(1, -1))),
    "another layout version": ("unknown layout", lambda p: p.__setitem__(PACKED, 2)),
}


@pytest.mark.parametrize("tampering", list(TAMPERING))
def test_a_packed_checkpoint_whose_references_do_not_fit_is_refused_in_one_line(tmp_path, tampering):
    expected, change = TAMPERING[tampering]
    state = mixed_state()
    del state["meta"]
    path = tmp_path / "learner-0.pt"
    write_checkpoint(retarget(packed_copy(state), change), path)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))])
    before = optimizer.state_dict()
    with pytest.raises(DilocoError) as refused:
        read_checkpoint(path, 100, optimizer)
    line = str(refused.value)
    assert "\n" not in line and expected in line and str(path) in line and "delete it" in line
    assert_same(optimizer.state_dict(), before)


def test_progress_computed_as_it_is_packed_reads_back_as_the_progress_computed_first():
    """A checkpoint's unpushed progress is written straight into the packed buffer (`Unpushed`, deferred):
    read back, it is bit for bit the progress `export_progress` computes into tensors of its own, pushes in
    flight and bf16 parameters included, and the copy no longer moves with training."""
    from diloco.core.own_progress import export_progress
    from test_own_progress import _trained

    core, params, _ = _trained(3)  # fragment 1's push in flight
    assert core.in_flight
    with torch.no_grad():
        params["a"].add_(torch.linspace(-1, 1, params["a"].numel()).view_as(params["a"]))  # not a round value
    extra = {"data": {"index": 3}, "other": torch.arange(6, dtype=torch.float32)}
    computed_first = packed_copy({"sync": export_progress(core), **extra})
    deferred = packed_copy({"sync": export_progress(core, deferred=True), **extra})
    assert_same(unpacked(deferred), unpacked(computed_first))
    assert list(deferred["buffers"]) == ["float32"]  # one buffer: the tensors, then the computed progress
    before = unpacked(deferred)["sync"]["fragments"][0]["unpushed"]["a"].clone()
    with torch.no_grad():
        params["a"].add_(1.0)  # training goes on
    assert torch.equal(unpacked(deferred)["sync"]["fragments"][0]["unpushed"]["a"], before)


def test_deferred_progress_of_bf16_parameters_is_the_float32_difference():
    from diloco.core.own_progress import Unpushed

    anchor = torch.randn(4, 5)
    param = (anchor + 0.01 * torch.randn(4, 5)).to(torch.bfloat16)
    sent = 0.001 * torch.randn(4, 5)
    copy = packed_copy({"p": Unpushed(anchor, param, sent), "q": torch.ones(2)})
    expected = anchor - param.to(torch.float32) - sent
    assert torch.equal(unpacked(copy)["p"], expected) and unpacked(copy)["p"].dtype == torch.float32
    assert torch.equal(unpacked(copy)["q"], torch.ones(2))
