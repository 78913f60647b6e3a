"""What a simulated run measured: Θ's held-out loss as it goes, and the run's result at the end."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from diloco.core.accounting import learner_round_stats, learner_tokens, round_stats
from diloco.metrics.records import resident_memory_bytes
from diloco.results import LearnerReport, RunResult, traffic_fields
from diloco.training import evaluate

if TYPE_CHECKING:
    from diloco.sim.driver import Simulation


def global_model(sim: Simulation) -> nn.Module:
    """The model the run produced so far: Θ from the syncer, or the data-parallel replica."""
    if sim.syncer is None:
        return sim.learners[0].replica.model
    with torch.no_grad():
        for name, p in sim.eval_model.named_parameters():
            if name in sim.syncer.theta:
                p.copy_(sim.syncer.theta[name])
    return sim.eval_model


def record_eval(sim: Simulation) -> None:
    """Θ's held-out loss now, on the eval curve and in the metrics."""
    loss = evaluate(global_model(sim), sim.eval_batches)
    sim.eval_curve.append({"time_s": sim.now, "tokens": sim.tokens_trained, "loss": loss})
    sim.metrics.record("eval", sim.now, tokens=sim.tokens_trained, loss=loss)
    if sim.syncer is not None:
        pending = sum(len(s.pending) for s in sim.syncer.fragments.values())
        sim.metrics.record("syncer", sim.now, shard=0, queue_length=pending, checkpoint_age_s=None,
                            memory_bytes=resident_memory_bytes(), rounds=sim.syncer.rounds_closed)


def duplicates(sim: Simulation) -> int:
    """Pushes received twice (counted once), by every syncer of the run."""
    if sim.syncer is None:
        return 0
    regional = sum(r.duplicates_banked + (sum(e.duplicates for e in r.syncer.down.ledger.values())
                                          if r.syncer is not None else 0) for r in sim.regions)
    return regional + sum(e.duplicates for e in sim.syncer.ledger.values())


def run_result(sim: Simulation) -> RunResult:
    """What the run measured, in the fields every driver's summary has."""
    unfinished = [lr.index for lr in sim.learners if not lr.finished]
    if unfinished:
        raise RuntimeError(f"simulation ended with learners {unfinished} still waiting: a round never closed")
    wall = sim.last_event_s
    record_eval(sim)
    sim.eval_curve[-1]["time_s"] = wall
    numel = {f.index: f.numel for f in sim.fragments}
    totals = {"merged": 0.0, "stale": 0.0, "lost": 0.0}
    reports = []
    for lr in sim.learners:
        if sim.syncer is not None:
            tokens = learner_tokens(lr.tokens, *sim.ledger_of(lr.index), numel)
        else:  # data-parallel: every token is in the model the step it is trained
            tokens = {"merged": lr.tokens, "stale": 0.0, "lost": 0.0}
        for key in totals:
            totals[key] += tokens[key]
        reports.append(LearnerReport(
            learner=lr.index, speed=lr.speed, tokens=lr.tokens, steps=lr.replica.steps, busy_s=lr.busy_s,
            waiting_s=lr.waiting_s, down_s=lr.down_s, busy_fraction=lr.busy_s / wall if wall else 1.0,
            crashes=lr.crashes, tokens_lost=tokens["lost"], bytes_up=lr.link.up.bytes_sent,
            bytes_down=lr.link.down.bytes_sent, eval_loss=evaluate(lr.replica.model, sim.eval_batches),
            rounds=learner_round_stats(sim.rounds_of(lr.index), lr.index) if sim.syncer else {}))
    learner_losses = [r.eval_loss for r in reports]
    return RunResult(
        strategy=sim.spec.name, learners=len(sim.learners), tokens=sum(r.tokens for r in reports),
        final_eval_loss=sim.eval_curve[-1]["loss"], training_time_s=wall,
        wire_bytes_up=sum(r.bytes_up for r in reports), wire_bytes_down=sum(r.bytes_down for r in reports),
        goodput=sum(r.busy_s for r in reports) / (wall * len(reports)) if wall else 1.0,
        peak_sync_bytes=max(lr.link.up.peak_message_bytes for lr in sim.learners),
        rounds=sim.syncer.rounds_closed if sim.syncer else sim.learners[0].replica.steps,
        parameters=sim.parameters, tokens_merged=totals["merged"], tokens_stale=totals["stale"],
        tokens_lost=totals["lost"], per_learner=reports, eval_curve=sim.eval_curve,
        config=sim.config.to_dict(), round_stats=round_stats(sim.syncer.rounds) if sim.syncer else {},
        learners_eval_loss_mean=sum(learner_losses) / len(learner_losses),
        clock="virtual", wall_clock_s=time.perf_counter() - sim.host_started,
        duplicates=duplicates(sim),
        **traffic_fields(sim.network.link_entries(wall)))
