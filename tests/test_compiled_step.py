"""The delayed-Nesterov steps' compiled loops give the torch ops' Θ, sums and momentum bit for bit, over
steps of every kind (plain and full rounds, merged gradients scaled or divided or as they are, in place and
into new tensors, chunks of either path): a shard with numba and one without must agree exactly. What the
loops find non-finite as they write it is handed back to be checked, and the round is refused."""

from __future__ import annotations

import math

import pytest
import torch

from diloco import cache_chunks
from diloco.cache_chunks import Scaled
from diloco.codecs import compiled, compiled_sums
from diloco.core import closing
from diloco.outer import compiled_step
from diloco.outer.delayed_nesterov import DelayedNesterov

pytest.importorskip("numba")

NUMEL = compiled.MIN_ELEMENTS * 2 + 13
"""Two chunks the compiled loop takes and a short last one (chunks of MIN_ELEMENTS in these tests)."""
SHARES = (0.25, 0.5, 0.25, 0.3, 1.0, 0.2, 0.45, 0.35)
"""Plain steps, a full round after the first three and after the fifth, and again at the end."""


def _gradient(kind: str, step: int) -> torch.Tensor | Scaled:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(step)) * 1e-2
    if kind == "divided":
        return Scaled(values, 2.9 + step, divide=True)
    if kind == "scaled":
        return Scaled(values, 0.37 / (1 + step))
    return values


def _run(kind: str, into_new: bool) -> tuple[list[torch.Tensor], DelayedNesterov, list[int]]:
    optimizer = DelayedNesterov(lr=0.7, momentum=0.9)
    theta = {"w": torch.randn(NUMEL, generator=torch.Generator().manual_seed(99))}
    seen, unchecked = [], []
    for step, share in enumerate(SHARES):
        written: list[tuple[str, int, int]] = []
        out = {"w": torch.empty(NUMEL)} if into_new else None
        unchecked.append(len(optimizer.step(theta, {"w": _gradient(kind, step)}, share, out=out,
                                            written=lambda *chunk: written.append(chunk))))
        assert written[-1][2] == NUMEL and all(a[2] == b[1] for a, b in zip(written, written[1:]))
        theta = out if into_new else theta
        seen.append(theta["w"].clone())
    return seen, optimizer, unchecked


@pytest.mark.parametrize("into_new", [False, True])
@pytest.mark.parametrize("kind", ["divided", "scaled", "plain"])
def test_the_compiled_steps_give_the_torch_values(kind, into_new, monkeypatch):
    monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", compiled.MIN_ELEMENTS)
    monkeypatch.setattr(compiled, "_enabled", False)
    eager, eager_optimizer, eager_unchecked = _run(kind, into_new)
    assert eager_unchecked == [1, 1, 1, 1, 1, 1, 1, 1]  # torch's ops check nothing: the new sums, or momentum
    monkeypatch.setattr(compiled, "_enabled", True)
    assert compiled_step.steps_like_torch()  # its probe's calls made before the spies below
    taken: dict[str, list[int]] = {"plain_step": [], "momentum_step": []}
    for name, chunks_taken in taken.items():
        real = getattr(compiled_step, name)
        monkeypatch.setattr(compiled_step, name,
                            lambda *a, real=real, seen=chunks_taken: seen.append(a[0].numel()) or real(*a))
    loops, loops_optimizer, loops_unchecked = _run(kind, into_new)
    # every chunk of every step in a loop: whole ones and the short last one; 5 plain steps, 3 full rounds
    assert taken["plain_step"] == [compiled.MIN_ELEMENTS, compiled.MIN_ELEMENTS, 13] * 5
    assert taken["momentum_step"] == [compiled.MIN_ELEMENTS, compiled.MIN_ELEMENTS, 13] * 3
    assert loops_unchecked == [0] * len(SHARES)  # the loops checked what they wrote
    for got, want in zip(loops, eager):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for got, want in zip(loops_optimizer.tensors(), eager_optimizer.tensors()):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("accumulated", [0.0, 0.9])  # a plain step; a full round, its momentum overflowing
def test_a_round_whose_loops_find_the_optimizers_state_not_finite_is_refused_and_changes_nothing(accumulated):
    """The loops say what they found as they wrote the sums or the momentum; a non-finite one is handed
    back to be checked, so a round that would overflow the outer optimizer's state is refused as before."""
    import core_state
    from diloco.core import Push, SyncerCore
    from diloco.core.events import PushArrived
    from diloco.fragments import Fragment

    core = SyncerCore({"w": torch.zeros(NUMEL)}, [Fragment(0, ("w",), NUMEL, False)], (0, 1),
                      optimizer=lambda: DelayedNesterov(lr=1e-30, momentum=0.9), merge_rule="weighted",
                      outlier="off", quorum=1)
    optimizer = core.fragments[0].optimizer
    optimizer.sums, optimizer.buffers = {"w": torch.full((NUMEL,), 3e38)}, {"w": torch.full((NUMEL,), 3e38)}
    optimizer.accumulated = accumulated
    handed: list[int] = []
    real = DelayedNesterov.step
    spy = lambda self, *a, **k: handed.append(len(unchecked := real(self, *a, **k))) or unchecked  # noqa: E731
    before = core_state.frozen(core)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DelayedNesterov, "step", spy)
        message = core_state.refused(lambda: core.handle(PushArrived(
            Push(0, 0, 0, 1, {"w": torch.full((NUMEL,), 3e38)}, 100, 1, step=1)), now=1.0))
    assert "non-finite" in message and handed == [1]
    assert core_state.same(core_state.frozen(core), before) and core.version(0) == 0


def test_the_probe_holds_on_this_torch():
    """On x86-64 and arm64 builds torch's add and sub with an alpha are fused multiply-adds; a build where
    they are not would take the torch ops (the probe), which this test would flag for a look."""
    assert compiled_step.steps_like_torch()


def test_small_tensors_and_other_dtypes_take_the_torch_ops():
    assert not compiled_step.usable(torch.zeros(compiled.MIN_ELEMENTS - 1))
    assert not compiled_step.usable(torch.zeros(compiled.MIN_ELEMENTS), torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("strategy, numel, loads", [("decoupled", compiled.MIN_ELEMENTS, True),
                                                     ("decoupled", compiled.MIN_ELEMENTS - 1, False),
                                                     ("diloco", compiled.MIN_ELEMENTS, False)])  # plain Nesterov
def test_a_shard_loads_the_compiled_step_as_it_makes_its_core_not_at_its_first_round(strategy, numel, loads):
    """numba and the loop cost a process about 120 MB once: taken as the shard starts, its memory stays flat
    after (the soak's measure), where a tensor of its will take the loop; no shard pays it for nothing."""
    from conftest import tiny_config
    from diloco.fragments import Fragment
    from diloco.shard.server import ShardPlan, SyncerShard

    shard = SyncerShard(tiny_config("learners.count=1", "outer.fragments=1", f"strategy={strategy}"),
                        ShardPlan(0, 1, ("",)))
    try:
        compiled_step.steps_like_torch.cache_clear()
        compiled_sums.groups_like_torch.cache_clear()
        shard._make_core({"w": torch.zeros(numel)}, [Fragment(0, ("w",), numel, False)], set())
        assert (compiled_step.steps_like_torch.cache_info().currsize == 1) == loads
        # the group fold (any outer optimizer) is compiled as the core is made, not at a first group mid-run
        assert compiled_sums.groups_like_torch.cache_info().currsize == (numel >= compiled.MIN_ELEMENTS)
    finally:
        shard.stop()


def test_a_spare_shard_loads_the_compiled_step_before_it_is_handed_a_resume(tmp_path, monkeypatch):
    """A resumed shard makes its core on the outage's critical path: a spare (`python -m diloco.prestarted
    syncer`) has numba and the loop in already, so that core's `load_for` costs nothing."""
    import io

    from diloco import prestarted

    monkeypatch.setattr(prestarted, "die_with_parent", lambda: None)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no process to become: it returns once ready
    compiled_step.steps_like_torch.cache_clear()
    compiled_sums.groups_like_torch.cache_clear()
    ready = tmp_path / "ready"
    assert prestarted.wait_as_spare("syncer", str(ready)) == 0
    assert ready.exists() and compiled_step.steps_like_torch.cache_info().currsize == 1
    assert compiled_sums.groups_like_torch.cache_info().currsize == 1


def test_a_rounds_distance_in_one_read_is_the_float64_sum_of_the_fp32_differences_squared(monkeypatch):
    """The update norm's compiled loop: each difference as torch.sub rounds it, squares summed in float64 (any
    order: so within float64 rounding of the exact sum); the torch path's fp32 norms per piece agree to fp32
    precision; a NaN reaches the sum, for the round's finite checks to refuse."""
    generator = torch.Generator().manual_seed(5)
    a = torch.randn(NUMEL, generator=generator)
    b = a + torch.randn(NUMEL, generator=generator) * 1e-3
    got = compiled_step.square_distance(a, b)
    exact = float((torch.sub(a, b).double() ** 2).sum())
    assert got is not None and abs(got - exact) <= 1e-12 * exact
    monkeypatch.setattr(compiled, "_enabled", False)
    assert compiled_step.square_distance(a, b) is None
    assert abs(closing.squared_pieces(a, b) - got) <= 1e-5 * got
    monkeypatch.setattr(compiled, "_enabled", True)
    assert closing.squared_pieces(a, b) == got
    assert compiled_step.square_distance(a[:100], b[:100]) is None  # below the loop's size: torch's
    b[7] = float("nan")
    assert compiled_step.square_distance(a, b) != compiled_step.square_distance(a, b)


def test_a_rounds_new_theta_is_measured_as_its_step_writes_it(monkeypatch):
    """The new Θ's squares come from the same in-cache read as the update's distance: its finite check and
    the next outlier bound take no pass of their own, and the norm they read is its float64 sum of squares."""
    from diloco.config import load_config
    from diloco.core import accumulate
    from diloco.core.events import PushArrived
    from diloco.core.messages import Push
    from diloco.fragments import Fragment
    from diloco.strategies import build_strategy

    monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", compiled.MIN_ELEMENTS)  # several chunks
    spec = build_strategy(load_config(overrides=["learners.count=2", "learners.speeds=[]", "outer.fragments=1",
                                                 "outer.quorum=1", "outer.pacing=false"]))
    core = spec.syncer_core({"w": torch.randn(NUMEL, generator=torch.Generator().manual_seed(6))},
                            [Fragment(0, ("w",), NUMEL, False)], range(2), embeddings=())
    for m in range(2):
        core.declare(m, 64)
        core.rejoin_state(m, after_seq=0)
    measured: list[int] = []
    real = accumulate.tensor_norm
    monkeypatch.setattr(accumulate, "tensor_norm", lambda t: measured.append(id(t)) or real(t))
    before = core.merging.theta["w"]
    delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7)) * 1e-3
    core.handle(PushArrived(Push(0, 0, core.version(0), 1, {"w": delta}, 256, 4, step_time_s=0.01, sent_at=0.0,
                                 step=4)), 1.0)
    theta = core.merging.theta["w"]
    assert theta is not before and core.rounds_closed == 1
    assert id(theta) not in measured  # its norm came with the step's chunks
    exact = float((theta.double() ** 2).sum()) ** 0.5
    assert abs(accumulate.norm_of(theta) - exact) <= 1e-12 * exact
    assert id(theta) not in measured


@pytest.mark.parametrize("into_new", [False, True])
def test_a_steps_loop_sums_each_chunks_squares_as_it_writes_them(into_new, monkeypatch):
    """The update's distance and the new values' own squares come from the step's loop itself (no second read
    of the chunk): the float64 sums of the fp32 differences and values, to float64's rounding, for plain and
    full rounds and the short last chunk; a step in place passes none (its new and old values are one tensor)."""
    monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", compiled.MIN_ELEMENTS)
    assert compiled_step.steps_like_torch()
    optimizer = DelayedNesterov(lr=0.7, momentum=0.9)
    theta = {"w": torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))}
    for step, share in enumerate(SHARES):
        before = theta["w"].clone()
        out = {"w": torch.empty(NUMEL)} if into_new else None
        passed: list[tuple[int, int, tuple[float, float] | None]] = []
        optimizer.step(theta, {"w": _gradient("divided", step)}, share, out=out,
                       written=lambda name, start, stop, squares: passed.append((start, stop, squares)))
        theta = out if into_new else theta
        assert [(a, b) for a, b, _ in sorted(passed)] == [(0, compiled.MIN_ELEMENTS),
                                                         (compiled.MIN_ELEMENTS, 2 * compiled.MIN_ELEMENTS),
                                                         (2 * compiled.MIN_ELEMENTS, NUMEL)]
        for start, stop, squares in passed:
            if not into_new:
                assert squares is None
                continue
            new, old = theta["w"][start:stop], before[start:stop]  # each difference rounded as torch.sub does
            distance, own = float(torch.sub(new, old).double().square().sum()), float(new.double().square().sum())
            assert squares is not None and squares[0] > 0
            assert math.isclose(squares[0], distance, rel_tol=1e-12) and math.isclose(squares[1], own, rel_tol=1e-12)
