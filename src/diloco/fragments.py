"""Which tensors are synced together, and when.

A fragment is a set of whole tensors. Balanced fragmentation bin-packs tensors largest first into the
lightest fragment (LPT: within 4/3 of the best packing), keeping embedding tensors in fragments of
their own because their outer gradients are merged by a different rule. The staggered schedule
syncs fragment p at the inner steps t with (t − o_p) mod H = 0, o_p = ⌊p·H/P⌋, so at most about
|θ|/P crosses the link at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from diloco.errors import DilocoError


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]
    numel: int
    embedding: bool


def embedding_names(model: nn.Module) -> set[str]:
    """Input embeddings (every nn.Embedding weight) and the output embedding: the model's last
    nn.Linear, when its weight has an input embedding's shape (vocab x width), as an LM head does."""
    names: set[str] = set()
    shapes: set[tuple[int, ...]] = set()
    last_linear: tuple[str, nn.Linear] | None = None
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, nn.Embedding):
            names.add(prefix + "weight")
            shapes.add(tuple(module.weight.shape))
        elif isinstance(module, nn.Linear):
            last_linear = (prefix + "weight", module)
    if last_linear is not None and tuple(last_linear[1].weight.shape) in shapes:
        names.add(last_linear[0])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return names & trainable


def _pack(sizes: dict[str, int], bins: int, first_index: int, embedding: bool) -> list[Fragment]:
    loads = [0] * bins
    members: list[list[str]] = [[] for _ in range(bins)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = min(range(bins), key=lambda b: (loads[b], b))
        loads[lightest] += sizes[name]
        members[lightest].append(name)
    return [Fragment(first_index + i, tuple(members[i]), loads[i], embedding) for i in range(bins)]


def partition(model: nn.Module, fragments: int, embeddings: set[str] | None = None) -> list[Fragment]:
    """Split the trainable tensors of `model` into `fragments` balanced fragments."""
    sizes = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    if fragments < 1:
        raise DilocoError(f"outer.fragments must be positive, got {fragments}")
    if fragments > len(sizes):
        raise DilocoError(f"outer.fragments = {fragments} but the model has only {len(sizes)} trainable tensors")
    if fragments == 1:
        return [Fragment(0, tuple(sizes), sum(sizes.values()), embedding=False)]
    embeddings = (embedding_names(model) if embeddings is None else set(embeddings)) & set(sizes)
    rest = {n: s for n, s in sizes.items() if n not in embeddings}
    if not embeddings or not rest:
        return _pack(sizes, fragments, 0, embedding=not rest)
    emb_sizes = {n: sizes[n] for n in embeddings}
    # Give embeddings their share of the fragments, at least one and leaving at least one for the rest.
    share = round(fragments * sum(emb_sizes.values()) / sum(sizes.values()))
    emb_bins = min(max(1, share), len(emb_sizes), fragments - 1)
    rest_bins = min(fragments - emb_bins, len(rest))
    emb_bins = fragments - rest_bins
    return _pack(emb_sizes, emb_bins, 0, embedding=True) + _pack(rest, rest_bins, emb_bins, embedding=False)


@dataclass(frozen=True)
class Schedule:
    """Fragment p is due after inner step t when t ≥ 1 and (t − o_p) mod H = 0."""

    H: int
    fragments: int

    def offset(self, p: int) -> int:
        return (p * self.H) // self.fragments

    def due(self, step: int) -> list[int]:
        if step < 1:
            return []
        return [p for p in range(self.fragments) if (step - self.offset(p)) % self.H == 0]

    def next_due(self, p: int, after: int) -> int:
        """The first step after `after` at which fragment p is due."""
        step = max(after + 1, 1)
        return step + (self.offset(p) - step) % self.H
