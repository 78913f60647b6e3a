"""The built-in GPT in Flax: the PyTorch one's parameter names, shapes, layout and initialisation.

Θ is one thing whichever framework trains it: every tensor here is stored as torch stores it (a linear
layer's weight is (out, in) and is applied as x @ Wᵀ), under the same dotted name once the pytree's path
is joined with dots (`blocks.0.attn.qkv.weight`). The arithmetic is torch's too: LayerNorm with ε = 1e-5,
the exact (erf) GELU, causal softmax attention scaled by 1/√d, mean cross-entropy. Dropout is not built:
a config asking for it is refused.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diloco.errors import DilocoError
from diloco.models.gpt import GPTConfig

INIT_STD = 0.02
LAYER_NORM_EPS = 1e-5


def _normal(std: float):
    return nn.initializers.normal(stddev=std)


class Linear(nn.Module):
    """torch.nn.Linear: weight (out, in), optional bias."""

    features_in: int
    features_out: int
    bias: bool = True
    std: float = INIT_STD

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", _normal(self.std), (self.features_out, self.features_in))
        y = x @ weight.T
        if self.bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features_out,))
        return y


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm: `weight` and `bias` (Flax's own calls them scale and bias, with another ε)."""

    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (self.width,))
        bias = self.param("bias", nn.initializers.zeros, (self.width,))
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * weight + bias


class Embedding(nn.Module):
    count: int
    width: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.param("weight", _normal(INIT_STD), (self.count, self.width)), ids, axis=0)


class SelfAttention(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, c = x.shape
        h = self.cfg.heads
        qkv = Linear(c, 3 * c, name="qkv")(x)
        q, k, v = (z.reshape(b, t, h, c // h).transpose(0, 2, 1, 3) for z in jnp.split(qkv, 3, axis=-1))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(c // h)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        y = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
        return Linear(c, c, name="proj", std=_residual_std(self.cfg))(y)


class Mlp(nn.Module):
    """torch's nn.Sequential(Linear, GELU, Linear): its linears are named 0 and 2."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.cfg.width
        x = jax.nn.gelu(Linear(w, 4 * w, name="0")(x), approximate=False)
        return Linear(4 * w, w, name="2", std=_residual_std(self.cfg))(x)


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.cfg.width
        x = x + SelfAttention(self.cfg, name="attn")(LayerNorm(w, name="norm1")(x))
        return x + Mlp(self.cfg, name="mlp")(LayerNorm(w, name="norm2")(x))


class Blocks(nn.Module):
    """torch's nn.ModuleList: blocks named 0, 1, …"""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.cfg.layers):
            x = Block(self.cfg, name=str(i))(x)
        return x


class FlaxGPT(nn.Module):
    """`apply({"params": p}, inputs, targets)` is the mean cross-entropy; without targets, the logits."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, inputs: jax.Array, targets: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        if cfg.dropout:
            raise DilocoError(f"the Flax GPT has no dropout; set model.dropout = 0 (it is {cfg.dropout})")
        t = inputs.shape[1]
        if t > cfg.context:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context {cfg.context}")
        x = Embedding(cfg.vocab_size, cfg.width, name="token_embedding")(inputs)
        x = x + Embedding(cfg.context, cfg.width, name="position_embedding")(jnp.arange(t))
        x = LayerNorm(cfg.width, name="norm")(Blocks(cfg, name="blocks")(x))
        logits = Linear(cfg.width, cfg.vocab_size, bias=False, name="lm_head")(x)
        if targets is None:
            return logits
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def _residual_std(cfg: GPTConfig) -> float:
    """GPT-2's scaled init of the residual projections, as the torch model does it."""
    return INIT_STD / math.sqrt(2 * cfg.layers)


def init_gpt(cfg: GPTConfig, seed: int) -> dict[str, Any]:
    """A fresh params pytree, from the same distributions as the torch GPT (not the same draws)."""
    dummy = jnp.zeros((1, cfg.context), dtype=jnp.int32)
    return FlaxGPT(cfg).init(jax.random.PRNGKey(seed), dummy)["params"]


def gpt_layout(cfg: GPTConfig) -> tuple[list[str], list[str]]:
    """Θ's tensor order and its embedding tensors, read off the torch GPT itself (built on the meta
    device: no memory, no init), so the two models cannot drift apart."""
    import torch

    from diloco.fragments import embedding_names
    from diloco.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    return [n for n, _ in model.named_parameters()], sorted(embedding_names(model))
