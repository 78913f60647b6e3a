"""`[model]`: the built-in transformer's shape, or the factory of the user's own model."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.config.rules import require


@dataclass
class ModelConfig:
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 0
    """Longest sequence the model accepts; 0 means train.seq_len."""
    dropout: float = 0.0
    factory: str = ""
    """`module:callable` returning any nn.Module whose forward(inputs, targets) is a scalar loss."""


def check_model(m: ModelConfig, seq_len: int) -> None:
    """Shape rules the transformer needs: heads split the width, the context holds a training sequence."""
    require(m.width % m.heads == 0, "model.heads", f"must divide model.width ({m.width})", m.heads)
    require(m.context == 0 or m.context >= seq_len, "model.context",
            f"must be 0 or at least train.seq_len ({seq_len})", m.context)
    require(0 <= m.dropout < 1, "model.dropout", "must be in [0, 1)", m.dropout)
    require(m.factory == "" or ":" in m.factory, "model.factory", "must look like 'package.module:callable'",
            m.factory)
