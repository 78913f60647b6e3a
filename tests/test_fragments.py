import itertools
import random

import pytest
from torch import nn

from diloco.errors import DilocoError
from diloco.fragments import Schedule, _pack, embedding_names, partition
from diloco.models import GPT, GPTConfig


def gpt(layers=4, width=64, vocab=256):
    return GPT(GPTConfig(vocab_size=vocab, context=32, layers=layers, width=width, heads=4))


def test_embeddings_are_detected():
    assert embedding_names(gpt()) == {"token_embedding.weight", "position_embedding.weight", "lm_head.weight"}


def test_every_tensor_in_exactly_one_fragment_and_embeddings_apart():
    model = gpt()
    names = [n for n, _ in model.named_parameters()]
    embeddings = embedding_names(model)
    for fragments in range(1, 12):
        parts = partition(model, fragments)
        assert len(parts) == fragments
        assert sorted(n for f in parts for n in f.names) == sorted(names)
        assert all(f.names for f in parts)
        if fragments > 1:
            for f in parts:
                kinds = {n in embeddings for n in f.names}
                assert len(kinds) == 1, f"fragment {f.index} mixes embeddings and other tensors"
                assert f.embedding == (True in kinds)


@pytest.mark.parametrize("fragments", [4, 6, 8, 12])
def test_fragments_are_balanced_within_four_thirds_of_ideal(fragments):
    model = gpt(layers=8, width=64)
    parts = partition(model, fragments)
    total = sum(p.numel() for p in model.parameters())
    assert max(f.numel for f in parts) <= 4 / 3 * total / fragments


@pytest.mark.parametrize("fragments", range(2, 10))
def test_fragments_are_balanced_given_embeddings_apart(fragments):
    # With few fragments, a fragment of embeddings alone may be far from |θ|/P; bound the imbalance
    # against the best any packing that keeps embeddings apart could do.
    model = gpt(layers=4, width=64)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    embeddings = embedding_names(model)
    emb = sum(s for n, s in sizes.items() if n in embeddings)
    rest = sum(sizes.values()) - emb
    best = min(max(emb / k, rest / (fragments - k)) for k in range(1, fragments))
    best = max(best, max(sizes.values()))
    assert max(f.numel for f in partition(model, fragments)) <= 4 / 3 * best


def test_greedy_packing_is_within_four_thirds_of_the_best_packing():
    rng = random.Random(0)
    for _ in range(200):
        sizes = {f"t{i}": rng.randint(1, 100) for i in range(rng.randint(2, 6))}
        bins = rng.randint(2, min(4, len(sizes)))
        ours = max(f.numel for f in _pack(sizes, bins, 0, False))
        best = min(max(sum(s for s, b in zip(sizes.values(), assign) if b == k) for k in range(bins))
                   for assign in itertools.product(range(bins), repeat=len(sizes)))
        assert ours <= 4 / 3 * best


def test_too_many_fragments_is_an_error():
    with pytest.raises(DilocoError, match="only 2 trainable tensors"):
        partition(nn.Linear(3, 3), 3)


def test_staggered_schedule_syncs_each_fragment_once_per_period():
    schedule = Schedule(H=12, fragments=4)
    assert [schedule.offset(p) for p in range(4)] == [0, 3, 6, 9]
    due = {t: schedule.due(t) for t in range(1, 49)}
    for p in range(4):
        steps = [t for t, ps in due.items() if p in ps]
        assert len(steps) == 4
        assert all(b - a == 12 for a, b in zip(steps, steps[1:]))
    assert all(len(ps) <= 1 for ps in due.values())
    assert schedule.due(0) == []


def test_one_fragment_syncs_every_H_steps():
    schedule = Schedule(H=5, fragments=1)
    assert [t for t in range(1, 21) if schedule.due(t)] == [5, 10, 15, 20]
