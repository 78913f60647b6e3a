"""`[metrics]`: how often learners record their metrics, and where else they go."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MetricsConfig:
    every_steps: int = 10
    """Inner steps between two records of a learner's metrics."""
    tensorboard: bool = False
    """Also write TensorBoard event files under OUT/tensorboard (needs the `tensorboard` extra)."""
    wandb: str = ""
    """A Weights & Biases project to log to (needs wandb installed); empty: off."""
