"""Codecs by name, as configs and messages spell them."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

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
    """The codec called `name`; `block` is the elements per scale of int8, int4 and fp4. One instance per
    (name, block) is shared: a codec holds nothing but its settings and tables made once (a shard took a new
    one, and remade its decode tables, for every tensor of every push)."""
    factory = _FACTORIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise DilocoError(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}")
    if isinstance(block, bool) or not isinstance(block, int):
        return factory(block)  # refused there, with its message (True would share block 1's instance)
    return _shared(name, block)


@lru_cache(maxsize=64)
def _shared(name: str, block: int) -> Codec:
    """Bounded: a block size comes from a peer's header (any up to 2³²−1), so an attacker's variety of them
    only evicts."""
    return _FACTORIES[name](block)
