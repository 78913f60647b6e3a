"""JAX learners (`pip install 'diloco[jax]'`): a JAX training loop joins the same run as PyTorch learners.

`JaxLearner` (jax_learner.py) drives the shared learner machinery over a host mirror of a params pytree;
`flax_gpt.py` is the built-in GPT in Flax, Θ for Θ the torch one; `name_map.py` maps a pytree's paths to
Θ's names. Nothing here is imported by `import diloco`.
"""

from __future__ import annotations

from typing import Any

from diloco.errors import DilocoError

INSTALL_HINT = "the JAX learner needs jax, flax and optax: pip install 'diloco[jax]'"


def require_jax() -> None:
    """One line saying how to install the extra, when it is missing."""
    try:
        import flax  # noqa: F401
        import jax  # noqa: F401
        import optax  # noqa: F401
    except ImportError as exc:
        raise DilocoError(f"{INSTALL_HINT} ({exc})") from None


def __getattr__(name: str) -> Any:
    if name == "JaxLearner":
        require_jax()
        from diloco.jax.jax_learner import JaxLearner

        return JaxLearner
    raise AttributeError(f"module 'diloco.jax' has no attribute {name!r}")


__all__ = ["INSTALL_HINT", "JaxLearner", "require_jax"]
