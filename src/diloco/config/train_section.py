"""`[train]`: the inner loop of every learner, its token budget and the device it trains on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.rules import require


@dataclass
class TrainConfig:
    tokens: int = 1_200_000
    """Total token budget, summed over all learners."""
    batch_size: int = 16
    """Sequences per inner step, per learner."""
    seq_len: int = 64
    lr: float = 3e-3
    """Peak learning rate of each learner's inner AdamW."""
    weight_decay: float = 0.1
    warmup_steps: int = 20
    schedule: Literal["cosine", "constant"] = "cosine"
    """Follows each learner's own step count, never the wall-clock."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 turns clipping off."""
    eval_points: int = 8
    """How many times the global model is evaluated during the run (the last one at the end)."""
    eval_batches: int = 8
    device: str = "auto"
    """Where a real learner trains: `auto` (the GPU when there is one), `cpu`, `cuda` or `cuda:N`. The
    simulator always trains on the CPU."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: forward and backward under bf16 autocast; parameters, optimizer state and syncing stay fp32."""
    compile: bool = False
    """torch.compile the model of a real learner."""
    sharding: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """How the ranks of a real learner under torchrun hold its model: `ddp` (each rank the whole model),
    `fsdp` (FSDP2: each rank its rows of every tensor) or `hsdp` (replicas of sharded groups)."""


def check_train(t: TrainConfig) -> None:
    """The inner optimizer's settings and the device name, which is a free string."""
    require(t.lr > 0, "train.lr", "must be positive", t.lr)
    require(t.weight_decay >= 0, "train.weight_decay", "must be zero or positive", t.weight_decay)
    require(t.warmup_steps >= 0, "train.warmup_steps", "must be zero or positive", t.warmup_steps)
    require(t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:"), "train.device",
            "must be auto, cpu, cuda or cuda:N", t.device)
    require(t.sharding in ("ddp", "fsdp", "hsdp"), "train.sharding", "must be ddp, fsdp or hsdp", t.sharding)
    require(t.grad_clip >= 0, "train.grad_clip", "must be zero or positive (0 turns clipping off)", t.grad_clip)


def check_token_budget(t: TrainConfig, learners: int) -> None:
    """Checked last, as it combines sections: the budget must give every learner at least one step."""
    tokens_per_round = learners * t.batch_size * t.seq_len
    require(t.tokens >= tokens_per_round, "train.tokens",
            f"must cover at least one step of every learner ({tokens_per_round} tokens)", t.tokens)
