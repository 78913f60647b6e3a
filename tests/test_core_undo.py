"""Undo on refusal (`core/undo.py`): a call that ends in RoundRefused leaves the syncer core exactly as it
was, in its saved state and in every decision it takes afterwards.

Two cores built as the drivers build them (the default config's strategy: decoupled, pacing, outlier
clipping) take the same random stream of events from learners that push, report, beat, leave and
rejoin; now and then the first core's outer optimizer is poisoned for one event, so that any round
that event closes is refused. The twin never sees the refused events. Both must then agree on every
action and, at the end, on their whole saved state.
"""

from __future__ import annotations

import random

import pytest
import torch

from diloco.config import load_config
from diloco.core.actions import Publish, Timer
from diloco.core.events import (HeartbeatArrived, LearnerLeft, LearnerRejoined, ProgressArrived, PushArrived,
                                TimerFired)
from diloco.core.messages import Progress, Push
from diloco.core.refusals import RoundRefused
from diloco.core.syncer_core import SyncerCore
from diloco.fragments import Fragment
from diloco.strategies import build_strategy
from core_state import same

LEARNERS = 6
NUMEL = 8


def core_pair() -> tuple[SyncerCore, SyncerCore]:
    spec = build_strategy(load_config())
    fragments = [Fragment(p, (f"w{p}",), NUMEL, False) for p in range(spec.fragments)]
    params = {f"w{p}": torch.randn(NUMEL, generator=torch.Generator().manual_seed(p)) for p in range(spec.fragments)}
    cores = []
    for _ in range(2):
        core = spec.syncer_core(params, fragments, range(LEARNERS), embeddings=())
        for m in range(LEARNERS):
            core.declare(m, 64)
            core.rejoin_state(m, after_seq=0)
        cores.append(core)
    return cores[0], cores[1]


def summary(actions: list) -> list:
    """What the driver would do, in plain terms (answers by recipient and version)."""
    return [(type(a).__name__, a.fragment, a.version, sorted(a.updates)) if isinstance(a, Publish)
            else (type(a).__name__, a.at) if isinstance(a, Timer) else type(a).__name__ for a in actions]


@pytest.mark.parametrize("seed", range(3))
def test_refused_calls_leave_the_core_as_a_twin_that_never_saw_them(seed, monkeypatch):
    rng = random.Random(seed)
    core, twin = core_pair()
    optimizer_type = type(core.fragments[0].optimizer)
    honest_step = optimizer_type.step

    def poisoned(self, params, deltas, share=1.0, out=None, **kwargs):
        unchecked = honest_step(self, params, deltas, share, out=out, **kwargs)
        for t in (params if out is None else out).values():
            t.fill_(float("inf"))
        return unchecked

    step, seq, away = [0] * LEARNERS, [0] * LEARNERS, set()
    now, refused = 0.0, 0
    for _ in range(600):
        now += rng.uniform(0.0005, 0.004)
        m = rng.randrange(LEARNERS)
        kind = rng.random()
        if m in away:
            event = LearnerRejoined(m, after_seq=seq[m])
            away.discard(m)
        elif kind < 0.02:
            event = LearnerLeft(m, finished=False)
            away.add(m)
        elif kind < 0.07:
            event = TimerFired()
        elif kind < 0.4:
            step[m] += rng.randint(1, 4)
            due = tuple(rng.uniform(0.0, 0.02) for _ in core.fragments)
            event = ProgressArrived(Progress(m, step[m], step[m] * 64, 0.002, due))
        elif kind < 0.55:
            event = HeartbeatArrived(m, step[m], step[m] * 64)
        else:
            step[m] += 2
            seq[m] += 1
            p = rng.randrange(len(core.fragments))
            delta = {f"w{p}": torch.randn(NUMEL, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
                     * rng.choice([1e-3, 1e-2, 1.0])}
            event = PushArrived(Push(m, p, core.version(p), seq[m], delta, 128, 2, step_time_s=0.002, sent_at=now,
                                     step=step[m], final=rng.random() < 0.02))
        if rng.random() < 0.3:
            before = core.state_dict()
            monkeypatch.setattr(optimizer_type, "step", poisoned)
            try:
                actions = core.handle(event, now)
            except RoundRefused:
                refused += 1
                assert same(core.state_dict(), before)
                if isinstance(event, LearnerLeft):
                    away.discard(m)
                elif isinstance(event, LearnerRejoined):
                    away.add(m)
                continue
            finally:
                monkeypatch.setattr(optimizer_type, "step", honest_step)
        else:
            actions = core.handle(event, now)
        assert summary(actions) == summary(twin.handle(event, now))
    assert refused > 0 and core.rounds_closed > 10
    assert same(core.state_dict(), twin.state_dict())
