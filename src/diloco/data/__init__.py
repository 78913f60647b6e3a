"""Token corpora and deterministic per-learner shards."""

from diloco.data.corpus import Corpus, load_corpus
from diloco.data.shards import EvalBatches, ShardSampler

__all__ = ["Corpus", "load_corpus", "ShardSampler", "EvalBatches"]
