"""The inner step of a JAX learner: the torch learner's AdamW, clipping and schedule, in optax.

As `training.make_optimizer`: AdamW (β = 0.9, 0.95, ε = 1e-8), weight decay on matrices only, the
gradient's global norm clipped as torch's `clip_grad_norm_` does (factor max / (norm + 1e-6), at most 1).
The learning rate of each step is `training.learning_rate`'s, passed into the jitted step.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco.config import TrainConfig
from diloco.jax.jax_checkpoints import OptaxOptimizer, ParamsModel
from diloco.jax.name_map import GPT_NAMES, NameMap
from diloco.training import learning_rate

TORCH_CLIP_EPS = 1e-6


def clip_like_torch(max_norm: float) -> optax.GradientTransformation:
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        norm = optax.tree.norm(updates)
        factor = jnp.minimum(1.0, max_norm / (norm + TORCH_CLIP_EPS))
        return jax.tree_util.tree_map(lambda g: g * factor, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_jax_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW whose learning rate is set per step (`opt_state[-1].hyperparams["learning_rate"]`)."""
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=cfg.lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=cfg.weight_decay,
        mask=lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params))
    return optax.chain(clip_like_torch(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else optax.chain(adamw)


class JaxStep(NamedTuple):
    optimizer: optax.GradientTransformation
    step: Callable[..., tuple[Any, Any, jax.Array]]
    """(params, opt_state, lr, inputs, targets) → (params, opt_state, loss), jitted."""


def jitted_step(loss_fn: Callable[[Any, jax.Array, jax.Array], jax.Array], cfg: TrainConfig) -> JaxStep:
    """One inner step of `loss_fn(params, inputs, targets)` with the torch learner's optimizer."""
    optimizer = make_jax_optimizer(cfg)

    def step(params: Any, opt_state: Any, lr: jax.Array, inputs: jax.Array, targets: jax.Array
             ) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        opt_state[-1].hyperparams["learning_rate"] = lr
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return JaxStep(optimizer, jax.jit(step))


class JaxReplica:
    """The JAX twin of `training.Replica`, with what the built-in loop reads of it: `train_step()`
    (tokens), `steps`, `last_loss`, `sampler`, `planned_steps`; and what its checkpoints read and restore:
    `model.state_dict()`, `optimizer.state_dict()` / `load_state_dict()` (`jax_checkpoints.py`)."""

    def __init__(self, params: Any, loss_fn: Callable[[Any, jax.Array, jax.Array], jax.Array], cfg: TrainConfig,
                 sampler: Any, planned_steps: int, names: NameMap = GPT_NAMES) -> None:
        self.cfg = cfg
        self.model, self.optimizer = ParamsModel(self, names), OptaxOptimizer(self, names)
        self.sampler = sampler
        self.planned_steps = planned_steps
        self.jitted = jitted_step(loss_fn, cfg)
        self.params = params
        self.opt_state = self.jitted.optimizer.init(params)
        self.steps = 0
        self._last_loss: jax.Array | None = None
        self._step: Callable[..., tuple[Any, Any, jax.Array]] = self.jitted.step

    def compile(self) -> None:
        """Compile the step for this run's batch shape now, before training: a first step that took
        the compile time would count it as training (and a slowed learner's emulation would stretch it)."""
        batch = jnp.zeros((self.cfg.batch_size, self.cfg.seq_len), dtype=jnp.int32)
        self._step = self.jitted.step.lower(self.params, self.opt_state, jnp.float32(self.cfg.lr), batch,
                                            batch).compile()

    def train_step(self) -> int:
        inputs, targets = self.sampler.next_batch()
        lr = jnp.float32(learning_rate(self.cfg, self.steps, self.planned_steps))
        self.params, self.opt_state, self._last_loss = self._step(
            self.params, self.opt_state, lr, jnp.asarray(np.asarray(inputs)), jnp.asarray(np.asarray(targets)))
        # Done when it returns, as a torch step on the CPU: the loop's busy time and a slowed learner's
        # emulated speed (`learners.speeds`) are measured around it; dispatch alone would take none.
        jax.block_until_ready(self.params)
        self.steps += 1
        return int(targets.numel())

    @property
    def last_loss(self) -> float | None:
        return None if self._last_loss is None else float(self._last_loss)
