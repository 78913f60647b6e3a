"""Codecs by name, as configs and messages spell them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco.codecs.base import Codec
from diloco.codecs.blockwise import DEFAULT_BLOCK
from diloco.codecs.cast import CastCodec
from diloco.codecs.fp4 import E3M0Codec
from diloco.codecs.integer import IntCodec
from diloco.errors import DilocoError

_FACTORIES: dict[str, Callable[[int], Codec]] = {
    "fp32": lambda block: CastCodec("fp32", torch.float32),
    "bf16": lambda block: CastCodec("bf16", torch.bfloat16),
    "int8": lambda block: IntCodec(8, block),
    "int4": lambda block: IntCodec(4, block),
    "fp4": lambda block: E3M0Codec(block),
}
CODEC_NAMES = tuple(_FACTORIES)


def get_codec(name: str, block: int = DEFAULT_BLOCK) -> Codec:
    """The codec called `name`; `block` is the elements per scale of int8, int4 and fp4."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise DilocoError(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}")
    return factory(block)
