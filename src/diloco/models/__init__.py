"""Models: a small GPT for examples and benchmarks, and loading a user's own module."""

from diloco.models.factory import build_model, check_loss
from diloco.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "build_model", "check_loss"]
