"""One learner's inner training: a model, its AdamW, its data shard and its own schedule.

Shared by the simulated and the real drivers. `compute_gradients` and `apply_gradients` are separate
so that data-parallel training can all-reduce the gradients in between.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diloco.config import TrainConfig
from diloco.data.shards import Batch, ShardSampler
from diloco.errors import DilocoError
from diloco.models.factory import check_loss


def learning_rate(cfg: TrainConfig, step: int, planned_steps: int) -> float:
    """Linear warm-up, then cosine to 10% (or constant), by this learner's own step count."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, planned_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def resolve_device(name: str) -> torch.device:
    """`auto`: the GPU when torch sees one, else the CPU. A GPU asked for and missing is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DilocoError(f"train.device = {name!r}, but torch sees no CUDA device here")
    return device


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms); fused into one kernel per step
    when the parameters are on a GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95), fused=fused or None)


class Replica:
    def __init__(self, model: nn.Module, cfg: TrainConfig, sampler: ShardSampler | None, planned_steps: int) -> None:
        self.model = model
        self.cfg = cfg
        self.sampler = sampler
        self.planned_steps = planned_steps
        self.optimizer = make_optimizer(model, cfg)
        self.device = next(model.parameters()).device
        self.steps = 0
        self._last_loss: torch.Tensor | None = None

    def named_params(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def compute_gradients(self) -> int:
        """Forward and backward on the next batch; returns the tokens it took."""
        inputs, targets = self.sampler.next_batch()
        device = self.device
        if device.type != "cpu":  # pinned pages copy without holding up the host
            inputs = inputs.pin_memory().to(device, non_blocking=True)
            targets = targets.pin_memory().to(device, non_blocking=True)
        self.model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
            loss = check_loss(self.model(inputs, targets))
        loss.backward()
        self._last_loss = loss.detach()  # read only when asked: reading it would wait for the device
        return targets.numel()

    @property
    def last_loss(self) -> float | None:
        return None if self._last_loss is None else float(self._last_loss)

    def apply_gradients(self) -> None:
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = learning_rate(self.cfg, self.steps, self.planned_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def train_step(self) -> int:
        tokens = self.compute_gradients()
        self.apply_gradients()
        return tokens


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch]) -> float:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = sum(float(check_loss(model(x.to(device), y.to(device)), need_grad=False)) for x, y in batches)
    model.train(was_training)
    return total / len(batches)

