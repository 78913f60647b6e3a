"""diloco: train one PyTorch model across independent compute islands joined by slow links."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Learner", "LinkShape", "__version__"]


def __getattr__(name: str) -> Any:
    """`diloco.Learner` without importing torch and gRPC for `import diloco` alone (the CLI's --help)."""
    if name in ("Learner", "LinkShape"):
        from diloco.client import learner_client

        return getattr(learner_client, name)
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
