"""`[data]`: where the tokens come from and how much of them is held out for evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.rules import require


@dataclass
class DataConfig:
    source: str = "shakespeare"
    """`shakespeare` (bundled, byte-level) or the path of a flat binary file of token ids."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a token file, as nanoGPT writes them."""
    vocab_size: int = 0
    """Vocabulary of a token file; 0 means the largest id in it plus one."""
    eval_fraction: float = 0.05


def check_data(d: DataConfig) -> None:
    """The eval split must leave both parts non-empty; a vocab_size of 0 means "read it off the data"."""
    require(0 < d.eval_fraction < 1, "data.eval_fraction", "must be in (0, 1)", d.eval_fraction)
    require(d.vocab_size >= 0, "data.vocab_size", "must be zero or positive", d.vocab_size)
