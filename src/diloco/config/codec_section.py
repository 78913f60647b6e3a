"""`[codec]`: how pushes and answers are compressed on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.rules import MAX_CODEC_BLOCK, require, require_at_most

CodecName = Literal["fp32", "bf16", "int8", "int4", "fp4"]


@dataclass
class CodecConfig:
    up: CodecName = "fp32"
    """How outer gradients travel to the syncer."""
    down: CodecName = "fp32"
    """How new global values travel back (as the difference to what the learner holds)."""
    block: int = 64
    """Elements per scale of int8, int4 and fp4."""
    error_feedback: bool = False
    """Learners add what the uplink codec lost last time to their next push of the same tensor."""


def check_codec(c: CodecConfig) -> None:
    require(c.block > 0, "codec.block", "must be positive", c.block)
    require_at_most(c.block, MAX_CODEC_BLOCK, "codec.block")
