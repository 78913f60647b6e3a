"""What every driver sets up the same way from a config: the corpus, the held-out batches, the model."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from diloco.config import Config
from diloco.data import Corpus, EvalBatches, load_corpus
from diloco.data.shards import Batch
from diloco.models.factory import ModelFactory, build_model


@dataclass
class Materials:
    corpus: Corpus
    eval_batches: list[Batch]
    """The same held-out batches for Θ and every learner, in every driver: losses compare."""
    model: nn.Module | None
    """The initial model, on the CPU: every replica and Θ start from it (None when not asked for: a sharded
    learner builds its own, `client/sharded_build.py`)."""


def prepare(config: Config, factory: ModelFactory | None = None, *, model: bool = True) -> Materials:
    t, d = config.train, config.data
    corpus = load_corpus(d.source, dtype=d.dtype, vocab_size=d.vocab_size, eval_fraction=d.eval_fraction)
    batches = EvalBatches(corpus.eval, seq_len=t.seq_len, batch_size=t.batch_size, batches=t.eval_batches).batches
    return Materials(corpus, batches, build_model(config, corpus.vocab_size, factory) if model else None)
