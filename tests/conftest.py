"""Shared helpers: tiny configurations that train in well under a second."""

from __future__ import annotations

import pytest

from diloco.config import Config, load_config

TINY = [
    "model.layers=1", "model.width=32", "model.heads=2",
    "train.seq_len=16", "train.batch_size=4", "train.tokens=10240", "train.eval_batches=2",
    "train.eval_points=2", "train.warmup_steps=2", "outer.H=5", "learners.speeds=[]",
    # The lockstep timing model: tests that need noisy steps ask for it.
    "learners.jitter=0", "learners.drift=0", "learners.step_time_s=0.25",
]


def tiny_config(*overrides: str) -> Config:
    """A tiny model and budget; later overrides win."""
    return load_config(None, [*TINY, *overrides])


@pytest.fixture
def tiny():
    return tiny_config
