"""What rank 0 holds of gathered tensors is counted while they live anywhere in the process, and let go
when their memory is: `row_moves.HeldBytes`, the measure behind a sharded learner's staging peaks."""

from __future__ import annotations

import gc

import torch

from diloco.client.row_moves import HeldBytes


def test_held_bytes_count_what_is_alive_and_peak_per_phase():
    held = HeldBytes()
    a = torch.empty(100)
    held.track(a)
    view = a[:10].detach()  # a view keeps the memory alive: still counted
    del a
    b = torch.empty(50)
    held.track(b)
    assert held.now == 600 and held.peaks == {"train": 600}
    del view, b
    gc.collect()
    assert held.now == 0
    held.phase = "finish"
    for _ in range(3):  # one at a time, each let go before the next: the peak is one tensor's
        c = torch.empty(200)
        held.track(c)
        del c
    assert held.peaks == {"train": 600, "finish": 800} and held.peak == 800 and held.now == 0
