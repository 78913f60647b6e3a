"""Build the configured model: the built-in GPT, or any user module named `package.module:callable`."""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from diloco.config import Config
from diloco.errors import DilocoError
from diloco.models.gpt import GPT, GPTConfig

ModelFactory = Callable[[Config, int], nn.Module]
"""(config, vocab_size) -> a fresh module whose forward(inputs, targets) returns a scalar loss."""


def builtin_gpt(config: Config, vocab_size: int) -> nn.Module:
    m = config.model
    return GPT(GPTConfig(vocab_size=vocab_size, context=m.context or config.train.seq_len,
                         layers=m.layers, width=m.width, heads=m.heads, dropout=m.dropout))


def resolve_factory(config: Config) -> ModelFactory:
    if not config.model.factory:
        return builtin_gpt
    module_name, _, attr = config.model.factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DilocoError(f"model.factory: cannot import {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise DilocoError(f"model.factory: {module_name!r} has no callable {attr!r}")
    return factory


def build_model(config: Config, vocab_size: int, factory: ModelFactory | None = None) -> nn.Module:
    """A fresh model on the CPU, initialised from the run's seed so every learner starts equal."""
    factory = factory or resolve_factory(config)
    torch.manual_seed(config.seed)
    model = factory(config, vocab_size)
    if not isinstance(model, nn.Module):
        raise DilocoError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise DilocoError("the model has no trainable parameters")
    return model


def check_loss(loss: object, need_grad: bool = True) -> torch.Tensor:
    """The one contract a model must keep: forward(inputs, targets) is a scalar, differentiable loss."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise DilocoError(f"the model's forward(inputs, targets) must return a scalar loss; it returned {shape}")
    if need_grad and not loss.requires_grad:
        raise DilocoError("the model's loss does not require grad: it is not connected to the parameters")
    return loss
