"""Shared helpers: tiny configurations that train in well under a second."""

from __future__ import annotations

import os
from pathlib import Path

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


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, with tests/ (the toy models) on its path ahead of
    what this process has there, so that it runs the same sources."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
