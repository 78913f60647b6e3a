"""User-style models for tests: any nn.Module whose forward(inputs, targets) is a scalar loss."""

import torch
import torch.nn.functional as F
from torch import nn


class Bigram(nn.Module):
    """Not a GPT at all: next-token logits from the current token alone."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)

    def forward(self, inputs, targets):
        logits = self.table(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class TinyLM(nn.Module):
    """A small MLP language model without the symmetries of attention (whose key bias gets no gradient,
    which AdamW turns into rounding noise): equivalence tests compare it to reference loops tightly."""

    def __init__(self, vocab: int, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, inputs, targets):
        logits = self.out(torch.tanh(self.hidden(self.embed(inputs))))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class ReturnsLogits(Bigram):
    def forward(self, inputs, targets):
        return self.table(inputs)


def bigram(config, vocab_size):
    return Bigram(vocab_size)


def tiny_lm(config, vocab_size):
    return TinyLM(vocab_size)


def returns_logits(config, vocab_size):
    return ReturnsLogits(vocab_size)


def not_a_module(config, vocab_size):
    return torch.zeros(3)
