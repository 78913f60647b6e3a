"""A model built on the meta device and filled by replaying its recorded init (`client/sharded_build.py`)
gets exactly the values the whole model built on the CPU gets, holding one whole tensor at a time; a build
that cannot be replayed exactly is named, so that it is built whole instead. Whole-model fills here; each
rank's own rows of a sharded model are tests/test_learner_fsdp.py's."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from diloco.client.sharded_build import Unreplayable, record_build
from diloco.models.gpt import GPT, GPTConfig


def gpt() -> nn.Module:
    torch.manual_seed(7)
    return GPT(GPTConfig(vocab_size=96, context=16, layers=3, width=32, heads=4))


def hf_causal_lm() -> nn.Module:
    """A tiny GPT-2 (tied embeddings): Hugging Face skips its init under a meta device context; the
    recorder makes its tensors meta one by one instead, so the init runs as on the CPU."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))


class CausalMask(nn.Module):
    """A buffer computed from another tensor: its values are not recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))


class OwnGenerator(nn.Module):
    """Random values drawn from a generator the replay cannot rewind."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        nn.init.normal_(self.weight, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("build", [gpt, hf_causal_lm])
def test_replayed_values_equal_the_whole_build_bit_for_bit(build):
    whole = build().state_dict()
    model, record = record_build(build)
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    model.to_empty(device="cpu")
    before = torch.get_rng_state()
    peak = record.fill(model)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random stream is left as it was
    filled = model.state_dict()
    assert filled.keys() == whole.keys()
    assert [n for n in whole if not torch.equal(filled[n], whole[n])] == []
    largest = max(t.numel() * t.element_size() for t in whole.values())
    assert 0 < peak <= largest  # one whole tensor at a time, never the model


@pytest.mark.parametrize("module,words", [(CausalMask, "mask is computed by aten.tril"),
                                          (OwnGenerator, "generator of its own")])
def test_a_build_that_cannot_be_replayed_says_why(module, words):
    with pytest.raises(Unreplayable, match=words):
        record_build(module)
