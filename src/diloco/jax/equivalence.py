"""One inner step of the torch GPT and of the Flax GPT from the same Θ and batch, side by side.

What the frameworks benchmark reports and the equivalence test asserts: the loss of each, and how
differently one AdamW step (the learners' own: clipping, decay on matrices, the schedule's first
rate) moves the parameters, ‖Δθ_jax − Δθ_torch‖ / ‖Δθ_torch‖ over all of Θ, in fp32 on the CPU.
The JAX step is traced at full fp32 matmul precision: on a GPU, JAX's default does fp32 matmuls in
TF32, which alone moved Δθ 2.6e-2 apart on an H200 (1.0e-4 at "highest"); the torch step is fp32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import torch

from diloco.config import TrainConfig
from diloco.jax.flax_gpt import FlaxGPT
from diloco.jax.jax_training import jitted_step
from diloco.jax.name_map import GPT_NAMES
from diloco.models.gpt import GPT, GPTConfig
from diloco.training import Replica, learning_rate


@dataclass(frozen=True)
class StepComparison:
    loss_torch: float
    loss_jax: float
    loss_rel_diff: float
    delta_rel_diff: float
    """‖Δθ_jax − Δθ_torch‖ / ‖Δθ_torch‖ after one AdamW step."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def flax_params_for(model: FlaxGPT, theta: dict[str, torch.Tensor]) -> Any:
    """The Flax GPT's params holding `theta`, checked name for name and shape for shape."""
    template = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                                 jnp.zeros((1, model.cfg.context), jnp.int32)))
    return GPT_NAMES.params_from_theta(template["params"], theta, what="the torch GPT")


def compare_one_step(cfg: GPTConfig, train: TrainConfig, seed: int = 0, planned_steps: int = 100) -> StepComparison:
    torch.manual_seed(seed)
    torch_model = GPT(cfg)
    theta = {n: p.detach().clone() for n, p in torch_model.named_parameters()}
    flax_model = FlaxGPT(cfg)
    params = flax_params_for(flax_model, theta)
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randint(0, cfg.vocab_size, (train.batch_size, cfg.context), generator=generator)
    targets = torch.randint(0, cfg.vocab_size, (train.batch_size, cfg.context), generator=generator)

    class OneBatch:
        def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
            return inputs, targets

    replica = Replica(torch_model, train, OneBatch(), planned_steps)  # type: ignore[arg-type]
    replica.train_step()
    loss_torch = float(replica.last_loss)
    step = jitted_step(lambda p, x, y: flax_model.apply({"params": p}, x, y), train)
    with jax.default_matmul_precision("highest"):
        after, _, loss = step.step(params, step.optimizer.init(params),
                                   jnp.float32(learning_rate(train, 0, planned_steps)),
                                   jnp.asarray(inputs.numpy()), jnp.asarray(targets.numpy()))
    moved = GPT_NAMES.theta_from_params(after)
    names = list(theta)
    delta_torch = torch.cat([(p.detach() - theta[n]).flatten() for n, p in torch_model.named_parameters()])
    delta_jax = torch.cat([(moved[n] - theta[n]).flatten() for n in names])
    loss_jax = float(loss)
    return StepComparison(loss_torch, loss_jax, abs(loss_jax - loss_torch) / abs(loss_torch),
                          float((delta_jax - delta_torch).norm() / delta_torch.norm()))
