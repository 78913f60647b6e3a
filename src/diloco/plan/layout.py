"""The fragments a deployment syncs, as the element counts of their tensors.

Bytes on the wire are counted per tensor (each carries a header, and a block codec's last block of each
tensor may be short), so exact counts need the real tensors: `model_layout` builds the configured model
and partitions it as the simulator and the runtime do. Given only a parameter count, `assumed_layout`
makes each fragment one tensor of an equal share: headers and short blocks are then counted once per
fragment instead of once per tensor, an error of a few bytes per tensor (a few hundred KB in a 12B
model's full sync, under one millionth of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from diloco.errors import DilocoError

if TYPE_CHECKING:
    from diloco.config import Config


@dataclass(frozen=True)
class FragmentLayout:
    index: int
    tensors: tuple[int, ...]
    """Element count of each tensor of the fragment."""
    embedding: bool = False

    @property
    def numel(self) -> int:
        return sum(self.tensors)


@dataclass(frozen=True)
class Layout:
    fragments: tuple[FragmentLayout, ...]
    exact: bool
    """Built from the real model's tensors (True), or assumed from a parameter count."""
    source: str
    """What the layout was built from, in words, for the output."""
    split: Callable[[int], tuple[FragmentLayout, ...]]
    """The same model cut into another number of fragments (for the planner's search)."""
    tensor_count: int

    @property
    def parameters(self) -> int:
        return sum(f.numel for f in self.fragments)

    def with_fragments(self, count: int) -> Layout:
        return Layout(self.split(count), self.exact, self.source, self.split, self.tensor_count)


def assumed_layout(parameters: int, fragments: int) -> Layout:
    """`fragments` tensors of `parameters`/`fragments` elements each (the first ones one larger)."""
    if parameters < 1:
        raise DilocoError(f"--params must be at least 1, got {parameters}")

    def split(count: int) -> tuple[FragmentLayout, ...]:
        if count > parameters:
            raise DilocoError(f"{count} fragments of a {parameters}-parameter model: at least one would be empty")
        share, extra = divmod(parameters, count)
        return tuple(FragmentLayout(p, (share + (1 if p < extra else 0),)) for p in range(count))

    source = f"assumed: {parameters:,} parameters, each fragment one tensor (bytes are estimates)"
    return Layout(split(fragments), False, source, split, tensor_count=fragments)


def model_layout(config: Config, fragments: int) -> Layout:
    """The configured model's trainable tensors, partitioned as the simulator and the runtime do."""
    from diloco.data import load_corpus
    from diloco.fragments import embedding_names, partition
    from diloco.models.factory import build_model

    d = config.data
    corpus = load_corpus(d.source, dtype=d.dtype, vocab_size=d.vocab_size, eval_fraction=d.eval_fraction)
    model = build_model(config, corpus.vocab_size)
    embeddings = embedding_names(model)
    sizes = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}

    def split(count: int) -> tuple[FragmentLayout, ...]:
        return tuple(FragmentLayout(f.index, tuple(sizes[n] for n in f.names), f.embedding)
                     for f in partition(model, count, embeddings))

    name = type(model).__name__
    source = f"model: {name}, {sum(sizes.values()):,} parameters in {len(sizes)} tensors (bytes are exact)"
    return Layout(split(fragments), True, source, split, tensor_count=len(sizes))
