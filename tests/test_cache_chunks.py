"""`cache_chunks.add_scaled`: a round's sums folded a chunk at a time are the whole-tensor ops bit for bit."""

from __future__ import annotations

import pytest
import torch

from diloco import cache_chunks
from diloco.cache_chunks import add_scaled, chunks


@pytest.mark.parametrize("multiple", [1, 3, 128])
@pytest.mark.parametrize("numel", [0, 1, 99, 100, 101, 1000])
def test_chunks_cover_every_element_once_in_multiples(numel, multiple, monkeypatch):
    monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", 100)
    ranges = list(chunks(numel, torch.device("cpu"), multiple))
    bounds = [0, *(stop for _, stop in ranges)]
    assert [start for start, _ in ranges] == bounds[:-1] and bounds[-1] == numel
    assert all((stop - start) % multiple == 0 for start, stop in ranges[:-1])


@pytest.mark.parametrize("chunk", [None, 100, 7])
@pytest.mark.parametrize("numel", [1, 1000, "3 chunks + 5"])
def test_add_scaled_is_the_whole_tensor_ops_bit_for_bit(numel, chunk, monkeypatch):
    """"3 chunks + 5" is several whole chunks and a ragged last one at every chunk size (3M elements at the
    default), without 450k chunks of 7."""
    if chunk is not None:
        monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", chunk)
    if numel == "3 chunks + 5":
        numel = 3 * cache_chunks.CPU_CHUNK_ELEMENTS + 5
    generator = torch.Generator().manual_seed(numel)
    delta, old, mine = (torch.randn(numel, generator=generator) for _ in range(3))
    alphas = [0.37, 1.0, 3.1e-3]
    expected = [delta * alphas[0], torch.add(old, delta, alpha=alphas[1]), torch.add(mine, delta, alpha=alphas[2])]
    old_copy, in_place = old.clone(), mine
    outs = add_scaled([torch.empty(numel), torch.empty(numel), in_place], [None, old, mine], delta, alphas)
    assert outs[2] is in_place  # a total that is its own out is added to in place
    assert torch.equal(old, old_copy)  # a total with an out of its own is only read
    for got, want in zip(outs, expected):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
