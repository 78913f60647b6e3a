"""The core's recycled buffers (`core/scratch.py`): a tensor is taken again only once nobody else holds it,
a shape that many tensors share keeps enough for all of them, and what is free stays within the most the
scratch held in use at once, or the limit."""

import torch

from diloco.core.scratch import KEPT, MIN_NUMEL, Scratch

LIKE = torch.empty(MIN_NUMEL)
BYTES = 4 * MIN_NUMEL


def test_a_tensor_someone_holds_is_never_taken_again_and_a_free_one_is():
    scratch = Scratch(limit_bytes=8 * BYTES)
    held = scratch.take(LIKE)
    view = scratch.take(LIKE)[:10]  # a view alone keeps its tensor's memory in use
    other = scratch.take(LIKE)
    assert len({held.data_ptr(), view.data_ptr(), other.data_ptr()}) == 3
    pointer = other.data_ptr()
    del other
    again = scratch.take(LIKE)
    assert again.data_ptr() == pointer and scratch.made == 3


def test_a_shape_that_three_tensors_share_keeps_three_times_as_many_without_allocating_again():
    scratch = Scratch(limit_bytes=3 * KEPT * BYTES, shapes={tuple(LIKE.shape): 3})
    held = [scratch.take(LIKE) for _ in range(3 * KEPT)]
    assert scratch.made == 3 * KEPT and sum(map(len, scratch.kept.values())) == 3 * KEPT
    pointers = {t.data_ptr() for t in held}
    del held
    again = [scratch.take(LIKE) for _ in range(3 * KEPT)]
    assert {t.data_ptr() for t in again} == pointers and scratch.made == 3 * KEPT


def test_tensors_that_came_free_all_at_once_are_all_kept_up_to_the_most_held_at_once():
    """A paced grid closes several fragments while answers hold their last versions: as many come free at
    once as the next closes take. Kept, they are taken again, not made anew."""
    scratch = Scratch(limit_bytes=2 * BYTES, shapes={tuple(LIKE.shape): 1})
    held = [scratch.take(LIKE) for _ in range(KEPT)]
    assert scratch.nbytes() == 0  # every one is in use: the holders' memory, not the scratch's
    assert scratch.peak_in_use == KEPT * BYTES
    del held
    scratch.trim()
    assert scratch.nbytes() == KEPT * BYTES  # no more than were held at once: the peak is not raised
    again = [scratch.take(LIKE) for _ in range(KEPT)]
    assert scratch.made == KEPT and len(again) == KEPT


def test_free_tensors_beyond_the_peak_in_use_are_trimmed_to_the_limit():
    """Tensors of a shape no round takes any more make room as another shape's are made: the scratch's free
    bytes never exceed the larger of the limit and what the peak leaves beside those in use."""
    other = torch.empty(2 * MIN_NUMEL)
    scratch = Scratch(limit_bytes=2 * BYTES, shapes={tuple(LIKE.shape): 1, tuple(other.shape): 1})
    held = [scratch.take(LIKE) for _ in range(4)]
    del held
    assert scratch.nbytes() == 4 * BYTES
    now = [scratch.take(other) for _ in range(4)]  # 8 * BYTES in use: the peak
    assert scratch.peak_in_use == 8 * BYTES
    assert scratch.nbytes() == 2 * BYTES and len(scratch.free()) == 2  # the limit: the peak leaves no room
    del now
    scratch.trim()
    assert scratch.nbytes() == 8 * BYTES  # the peak's worth, the older shape's dropped first
    assert not scratch.kept[(tuple(LIKE.shape), torch.float32)]
    again = [scratch.take(other) for _ in range(4)]
    assert scratch.made == 8 and len(again) == 4  # the second shape's came back, none made


def test_small_tensors_are_not_kept():
    scratch = Scratch(limit_bytes=BYTES)
    scratch.take(torch.empty(MIN_NUMEL - 1))
    assert scratch.made == 0 and not scratch.kept


def test_a_shape_that_many_tensors_share_finds_a_free_one_without_reading_every_held_one(monkeypatch):
    """Taken ones go to the back: a round that takes n of a shape while the last round's n are held reads
    about one count per take, not n (a model's hundreds of layers of one shape would make that quadratic)."""
    n = 40
    reads = []
    real = Scratch._read
    monkeypatch.setattr(Scratch, "_read", lambda self, tensor: reads.append(1) or real(self, tensor))
    scratch = Scratch(limit_bytes=4 * n * BYTES, shapes={tuple(LIKE.shape): n})  # calibrated through the count
    last = [scratch.take(LIKE) for _ in range(n)]
    for round_ in range(4):  # each round's n replace the last round's, which come free after it
        reads.clear()
        now = [scratch.take(LIKE) for _ in range(n)]
        assert round_ == 0 or len(reads) == n, (round_, len(reads))  # the first made n more: all held
        last = now
    assert scratch.made == 2 * n and last


def test_a_tensor_taken_again_is_never_judged_by_what_was_remembered_of_its_old_values():
    """The compiled loops write through numpy, which torch's version counter does not see; a norm remembered
    of a recycled tensor's old values (the finite check of a new Θ reads it) must not stand for the new ones."""
    from diloco.core.closing import finite

    scratch = Scratch(limit_bytes=8 * BYTES)
    theta = scratch.take(LIKE)
    theta.fill_(1.0)
    assert finite(theta)  # its norm is remembered, by identity and version
    pointer = theta.data_ptr()
    del theta
    again = scratch.take(LIKE)
    assert again.data_ptr() == pointer
    again.numpy()[:] = float("nan")  # as a compiled step writes an overflowing Θ
    assert not finite(again)


def test_a_warm_core_refuses_a_round_that_makes_theta_non_finite_whatever_its_recycled_tensors_were():
    """End to end: every tensor the core keeps has its norm remembered from its last life; the round whose
    step overflows Θ alone (the sums stay finite; Θ is written by the compiled loop into one of them) is still
    refused, nothing changed. Before s62 the stale norm (0.0) passed it and Θ became infinite."""
    import core_state
    from diloco.core import Push, SyncerCore
    from diloco.core.accumulate import norm_of
    from diloco.core.events import PushArrived
    from diloco.fragments import Fragment
    from diloco.outer.delayed_nesterov import DelayedNesterov

    numel = 2 * MIN_NUMEL
    core = SyncerCore({"w": torch.zeros(numel)}, [Fragment(0, ("w",), numel, False)], (0, 1),
                      optimizer=lambda: DelayedNesterov(lr=1e10, momentum=0.0), merge_rule="weighted",
                      outlier="off", quorum=1)
    for seq in range(1, 13):
        core.handle(PushArrived(Push(0, 0, core.version(0), seq, {"w": torch.full((numel,), 1e-12)}, 100, 1,
                                     step=seq)), now=float(seq))
    for kept in core.merging.scratch.kept.values():
        for tensor in kept:
            norm_of(tensor)
    before = core_state.frozen(core)
    message = core_state.refused(lambda: core.handle(PushArrived(
        Push(0, 0, core.version(0), 13, {"w": torch.full((numel,), -1e30)}, 100, 1, step=13)), now=13.0))
    assert "non-finite" in message
    assert core_state.same(core_state.frozen(core), before) and core.version(0) == 12
    assert bool(torch.isfinite(core.merging.theta["w"]).all())
