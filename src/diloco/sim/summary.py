"""What a simulated run measured: Θ's held-out loss as it goes, and the run's result at the end."""

from __future__ import annotations

import time

import torch
from torch import nn

from diloco.driver_kit.run_summary import LearnerOutcome, build_run_result, learner_token_split
from diloco.metrics.records import resident_memory_bytes
from diloco.results import LearnerReport, RunResult, traffic_fields
from diloco.sim.sim_state import SimState
from diloco.training import evaluate


def global_model(sim: SimState) -> nn.Module:
    """The model the run produced so far: Θ from the syncer, or the data-parallel replica."""
    if sim.syncer is None:
        return sim.learners[0].replica.model
    with torch.no_grad():
        for name, p in sim.eval_model.named_parameters():
            if name in sim.syncer.theta:
                p.copy_(sim.syncer.theta[name])
    return sim.eval_model


def record_eval(sim: SimState) -> None:
    """Θ's held-out loss now, on the eval curve and in the metrics."""
    loss = evaluate(global_model(sim), sim.eval_batches)
    sim.eval_curve.append({"time_s": sim.now, "tokens": sim.tokens_trained, "loss": loss})
    sim.metrics.record("eval", sim.now, tokens=sim.tokens_trained, loss=loss)
    if sim.syncer is not None:
        pending = sum(len(s.pending) for s in sim.syncer.fragments.values())
        sim.metrics.record("syncer", sim.now, shard=0, queue_length=pending, checkpoint_age_s=None,
                            memory_bytes=resident_memory_bytes(), rounds=sim.syncer.rounds_closed)


def duplicates(sim: SimState) -> int:
    """Pushes received twice (counted once), by every syncer of the run."""
    if sim.syncer is None:
        return 0
    regional = sum(r.duplicates_banked + (sum(e.duplicates for e in r.syncer.down.ledger.values())
                                          if r.syncer is not None else 0) for r in sim.regions)
    return regional + sum(e.duplicates for e in sim.syncer.ledger.values())


def run_result(sim: SimState) -> RunResult:
    """What the run measured, in the fields every driver's summary has (`driver_kit/run_summary.py`)."""
    unfinished = [lr.index for lr in sim.learners if not lr.finished]
    if unfinished:
        raise RuntimeError(f"simulation ended with learners {unfinished} still waiting: a round never closed")
    wall = sim.last_event_s
    record_eval(sim)
    numel = {f.index: f.numel for f in sim.fragments}
    outcomes = []
    for lr in sim.learners:
        if sim.syncer is not None:
            split = learner_token_split(lr.tokens, *sim.ledger_of(lr.index), numel)
        else:  # data-parallel: every token is in the model the step it is trained
            split = {"merged": lr.tokens, "stale": 0, "lost": 0}
        report = LearnerReport(
            learner=lr.index, speed=lr.speed, tokens=lr.tokens, steps=lr.replica.steps, busy_s=lr.busy_s,
            waiting_s=lr.waiting_s, down_s=lr.down_s, crashes=lr.crashes, bytes_up=lr.link.up.bytes_sent,
            bytes_down=lr.link.down.bytes_sent, eval_loss=evaluate(lr.replica.model, sim.eval_batches))
        outcomes.append(LearnerOutcome(report, split, sim.rounds_of(lr.index) if sim.syncer else None))
    return build_run_result(
        strategy=sim.spec.name, outcomes=outcomes, training_time_s=wall, eval_curve=sim.eval_curve,
        round_records=sim.syncer.rounds if sim.syncer else None,
        peak_sync_bytes=max(lr.link.up.peak_message_bytes for lr in sim.learners),
        rounds=sim.syncer.rounds_closed if sim.syncer else sim.learners[0].replica.steps,
        parameters=sim.parameters, config=sim.config.to_dict(), clock="virtual",
        wall_clock_s=time.perf_counter() - sim.host_started, duplicates=duplicates(sim),
        **traffic_fields(sim.network.link_entries(wall)))
