"""The built-in learner: the configured model and data, trained with a `Learner` (`diloco learner`).

It is the loop a user would write: build the model, join, train until the plan or the shared budget
is done, leave. A learner slower than its chip (a `learners.speeds` entry below 1) stretches each step
by sleeping (`slower_chip.py`): that time counts as compute, as it would on a slower chip. Under
torchrun, the ranks of one learner split its data shard and hold the model as `train.sharding` says.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.config import Config, Topology
from diloco.core.recovery import RestorePolicy, restore_plan
from diloco.data import ShardSampler
from diloco.driver_kit.schedule import STEP_CAP, learner_plan
from diloco.errors import DilocoError
from diloco.metrics import MetricsLog, open_metrics
from diloco.metrics.records import LearnerMeter
from diloco.materials import prepare
from diloco.client import fault_injection, sharded_checkpoints
from diloco.client.collective_bound import floor_s
from diloco.client.checkpoints import CheckpointWriter, checkpoint_key, read_checkpoint
from diloco.client.learner_client import HomeLink, Learner, LinkShape
from diloco.client.param_shards import shard_model
from diloco.client.row_moves import collective_error, is_collective_failure
from diloco.client.sharded_build import build_sharded
from diloco.client.slower_chip import stretch_s
from diloco.models.factory import build_model
from diloco.transport.ports import report_port
from diloco.shard.ownership import fragment_owners
from diloco.status.endpoint import LOOPBACK, HttpExposure
from diloco.training import Replica, evaluate, resolve_device
from diloco.transport.security import TransportSecurity
from diloco.network.shaping import ShapedDirection
from diloco.process_times import HANDED_OVER_ENV, process_age_s, run_origin

log = logging.getLogger("diloco.learner")

def finish_distributed(failed: bool = False) -> None:
    """Leave the torchrun process group before exiting: a group still alive when the interpreter ends
    can abort the process (gloo's threads: "terminate called without an active exception"), which after
    a dead peer turned one clear error line into a core dump in about a third of exits. After a failure
    the peers may be gone, so the group is torn down without waiting for them."""
    if dist.is_initialized():
        if not failed:
            dist.barrier()  # every rank is done with the group before any leaves it
        dist.destroy_process_group()


def dist_world() -> int:
    """Ranks in this learner's torchrun process group (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def init_distributed() -> bool:
    """Join the torchrun process group of this learner, when there is one."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # The floor until steps are measured; then a bound derived from them (`collective_bound.py`).
    dist.init_process_group(backend, timeout=timedelta(seconds=floor_s()))
    return True


class Standalone:
    """Stands in for a `Learner` when syncing is off: the same loop, the same accounting, no network.
    It is the baseline that shows what syncing costs."""

    rank, world, should_stop, core = 0, 1, False, None

    def __init__(self, learner: int) -> None:
        self.id = learner
        self.up, self.down = ShapedDirection(None), ShapedDirection(None)  # nothing crosses them

    def request_stop(self) -> None:
        self.should_stop = True

    def resume(self, step: int) -> None:
        pass

    def step(self, tokens: int) -> None:
        pass

    def close(self, finished: bool = True) -> dict[str, Any]:
        return {"learner": self.id, "rank": 0, "world": 1, "merges": 0, "pushes": 0, "bytes_up": 0,
                "bytes_down": 0, "peak_message_bytes_up": 0}


def run_learner(config: Config, *, syncer: str | None, learner: int | None = None, out: Path | None = None,
                emulate_link: bool = False, stop: threading.Event | None = None,
                connect_timeout_s: float = 30.0, metrics_port: int | None = None,
                metrics_port_file: str | None = None, security: TransportSecurity | None = None,
                metrics_http: HttpExposure = LOOPBACK) -> dict[str, Any]:
    """Train one learner to the end of its plan (or of the shared budget, or until `stop` is set);
    return its report, also written to OUT/learners/learner-ID.json with a checkpoint. With no
    `syncer`, train the same way without syncing (`learner` is then required)."""
    entered = clock.monotonic()
    t = config.train
    sharding = config.learners.sharding_of(learner, t.sharding)
    sharded = sharding != "ddp" and dist.is_initialized()
    materials = prepare(config, model=not sharded)  # sharded before the optimizer and learner take it, never whole
    model = build_sharded(lambda: build_model(config, materials.corpus.vocab_size), sharding, dist.get_world_size(),
                          resolve_device(t.device)) if sharded else materials.model.to(resolve_device(t.device))
    sharded_checkpoints.refuse_other_kind(_checkpoint_path(config, out, learner, True),
                                          _checkpoint_path(config, out, learner), sharded)
    replica = Replica(model, t, sampler=None, planned_steps=1)  # its shard and plan follow from the id
    seal = checkpoint_key(security.secret, security.learner.token if security.learner else None) \
        if security is not None else None
    syncing = syncer is not None
    saved = _saved_state(_checkpoint_path(config, out, learner, sharded), config, learner, syncing, replica, seal)
    joining = clock.monotonic()
    sync = _sync_for(config, replica, syncer, learner, emulate_link, connect_timeout_s, security, saved, stop)
    joined_s = clock.monotonic() - joining
    m, rank, world = sync.id, sync.rank, sync.world
    plan = learner_plan(config, m, syncing=syncing)
    speed, planned = plan.speed, plan.planned_steps
    replica.sampler = _data_shard(config, materials.corpus.train, m, rank, world)
    replica.planned_steps = planned
    checkpoint = _checkpoint_path(config, out, m, sharded)
    if saved is None and learner is None:  # an id the syncer picked: Θ without own progress
        saved = _saved_state(checkpoint, config, m, syncing, replica, seal)
    if saved is not None:
        restore_checkpoint(saved, replica, world, config.failures.restore, own_params=not syncing)
        sync.resume(replica.steps)
        log.info("learner %d resumes at step %d from %s (own progress: fragments %s)", m, replica.steps, checkpoint,
                 [p for p, why in getattr(sync, "resumed", {}).items() if why is None])
    resumed_from = replica.steps
    writer = _writer_for(checkpoint, seal, config, sync, sharded, shares_cpu=replica.device.type == "cpu")
    if world > 1 and not sharded:
        replica.model = shard_model(model, "ddp", world)
    if t.compile:
        replica.model = torch.compile(replica.model)
    log.info("learner %d (rank %d/%d) trains %d steps at speed %g", m, rank, world, planned, speed)
    metrics = _metrics_for(config, out, m, rank, metrics_port, metrics_port_file, metrics_http)
    meter = LearnerMeter(metrics, m, config.metrics.every_steps, at_pushes=True)
    training = _Training(replica, sync, meter, metrics, world, rank, speed, stop, writer,
                         on_cpu=replica.device.type == "cpu")
    training.start = {"import_s": max(0.0, process_age_s() - (clock.monotonic() - entered)), "join_s": joined_s,
                      "spare": HANDED_OVER_ENV in os.environ,
                      "steps": resumed_from, "resumed_fragments": sum(why is None for why in
                                                                       getattr(sync, "resumed", {}).values())}
    # With a shared budget every learner trains until the syncer says the budget is spent, so all stop
    # together as in the simulator (its plan only shapes its learning-rate schedule); a learner that
    # stopped at its own plan would leave the others' last rounds to speak for the whole fleet.
    training.run(plan.last_step)
    report = sync.close(finished=not (stop is not None and stop.is_set()))
    # Its own model's held-out loss at the end, on the batches Θ is evaluated on: the final Θ should be
    # no worse than the learners it came from. A sharded model's forward is a collective: all ranks run it.
    eval_loss = evaluate(_unwrap(replica.model), materials.eval_batches) if rank == 0 or sharded else None
    if rank == 0:
        training.record(final=True)  # after the last pushes and the leave: every byte is counted
        report["eval_loss"] = eval_loss
    metrics.close()
    training.complete(report, plan.planned_steps, resumed_from)
    report.update(**_checkpoint_report(writer), **{k: v for k, v in training.start.items() if k.endswith("_s")})
    if isinstance(writer, sharded_checkpoints.ShardedWriter):
        writer.save(model, replica, wait=True)
    elif writer is not None and rank == 0:
        writer.save(lambda: _learner_state(model, replica, sync), wait=True)  # with the optimizer's state
    if out is not None and rank == 0:
        write_report(out, report)
    return report


def _writer_for(checkpoint: Path | None, seal: bytes | None, config: Config, sync: Learner | Standalone,
                sharded: bool, shares_cpu: bool) -> CheckpointWriter | sharded_checkpoints.ShardedWriter | None:
    """What writes this learner's checkpoints: DCP on every rank of a sharded learner, else rank 0's file.
    `shares_cpu`: training computes on the CPU, so the file's write takes from it (`CheckpointWriter`)."""
    if checkpoint is None:
        return None
    learner = syncing_learner(sync)
    if sharded:
        return sharded_checkpoints.ShardedWriter(checkpoint, seal, learner, config.failures.checkpoint_every)
    return CheckpointWriter(checkpoint, seal, config.failures.checkpoint_every, counts_write=shares_cpu)


def syncing_learner(sync: Any) -> Learner | None:
    """The `Learner` that syncs for this loop (the JAX loop's wraps one: its `learner`); None standing alone."""
    return sync if isinstance(sync, Learner) else getattr(sync, "learner", None)


def write_report(out: Path, report: dict[str, Any]) -> None:
    """OUT/learners/learner-ID.json, where `diloco run` collects every learner's report."""
    (out / "learners").mkdir(parents=True, exist_ok=True)
    (out / "learners" / f"learner-{report['learner']}.json").write_text(json.dumps(report, indent=2) + "\n")


def _metrics_for(config: Config, out: Path | None, m: int, rank: int, port: int | None,
                 port_file: str | None, http: HttpExposure = LOOPBACK) -> MetricsLog:
    """Rank 0 records (to OUT/metrics, and Prometheus if asked); other ranks record nothing."""
    metrics = open_metrics(out / "metrics" if out and rank == 0 else None, name=f"learner-{m}",
                           tensorboard=config.metrics.tensorboard and rank == 0, wandb=config.metrics.wandb,
                           prometheus_port=port if rank == 0 else None, http=http, origin=run_origin())
    if port is not None and rank == 0:
        report_port(metrics.prometheus_port, f"learner {m}'s Prometheus metrics", port_file)
    return metrics


@dataclass
class _Training:
    """The loop a user would write, with what it measures: tokens, time busy, one record per step."""

    replica: Replica
    sync: Learner | Standalone
    meter: LearnerMeter
    metrics: MetricsLog
    world: int
    rank: int
    speed: float
    stop: threading.Event | None
    writer: CheckpointWriter | sharded_checkpoints.ShardedWriter | None
    """None: no checkpoints."""
    on_cpu: bool = False  # training computes on the CPU: a slower chip's stretch scales its CPU time
    start: dict[str, Any] = field(default_factory=dict)
    """How this life started (the `start` metrics), completed at its first step."""
    tokens: int = 0
    busy_s: float = 0.0
    began: float = field(default_factory=clock.monotonic)
    started: float = field(default_factory=clock.monotonic)

    def run(self, last_step: int) -> None:
        try:
            self._run(last_step)
        except RuntimeError as exc:  # torch's distributed errors are RuntimeErrors too
            if self.world > 1 and is_collective_failure(exc):
                raise collective_error(exc, "training") from exc
            raise

    def _run(self, last_step: int) -> None:
        replica, sync = self.replica, self.sync
        first = replica.steps
        while replica.steps < last_step and not sync.should_stop:
            self.started = clock.monotonic()
            fault_injection.maybe_fail(fault_injection.AT_STEP, self.rank, replica.steps - first + 1)
            cpu_began = time.process_time()
            tokens = replica.train_step()
            if self.speed < 1:  # a slower chip, emulated: the stretch counts as compute
                clock.sleep(stretch_s(self.speed, clock.monotonic() - self.started,
                                      time.process_time() - cpu_began if self.on_cpu else None))
            self.busy_s += clock.monotonic() - self.started
            self.tokens += tokens
            if self.stop is not None and self.stop.is_set():
                sync.request_stop()
            sync.step(tokens)
            if self.rank == 0:
                if "first_step_s" not in self.start:
                    self.start.update(first_step_s=clock.monotonic() - self.started,
                                      start_to_first_step_s=process_age_s())
                    self.metrics.record("start", learner=self.sync.id, **self.start)
                self.record(final=False)
                if isinstance(self.writer, CheckpointWriter):
                    self.writer.maybe_save(replica.steps, clock.monotonic() - self.started, self._state)
            if isinstance(self.writer, sharded_checkpoints.ShardedWriter):  # every rank, at the same steps
                self.writer.maybe_save(_unwrap(replica.model), replica, clock.monotonic() - self.started)

    def _state(self) -> dict[str, Any]:
        return _learner_state(_unwrap(self.replica.model), self.replica, self.sync)

    def complete(self, report: dict[str, Any], planned_steps: int, resumed_from: int) -> None:
        """The loop's own figures, added to the learner's report at the end."""
        wall_s, tokens, busy_s = clock.monotonic() - self.began, self.tokens * self.world, self.busy_s
        report.update(speed=self.speed, planned_steps=planned_steps, steps=self.replica.steps,
                      resumed_from_step=resumed_from, tokens=tokens, busy_s=busy_s, wall_s=wall_s,
                      busy_fraction=busy_s / wall_s if wall_s else 1.0, tokens_per_s=tokens / wall_s if wall_s else 0.0,
                      interrupted=bool(self.stop is not None and self.stop.is_set()))

    def record(self, final: bool) -> None:
        learner = syncing_learner(self.sync)
        for back in learner.link.reach.take() if learner is not None and learner.link is not None else ():
            self.metrics.record("reconnect", time_s=back.back_at - self.metrics.origin, learner=learner.id,
                                shard=back.shard, down_s=back.back_at - back.lost_at, push=back.call == "push")
        now = clock.monotonic()
        self.meter.step(clock.now() - self.metrics.origin, steps=self.replica.steps, tokens=self.tokens * self.world,
                        busy_fraction=self.busy_s / (now - self.began), step_time_s=now - self.started,
                        bytes_up=self.sync.up.bytes_sent, bytes_down=self.sync.down.bytes_sent,
                        loss=lambda: self.replica.last_loss, core=self.sync.core, final=final)


def _sync_for(config: Config, replica: Replica, syncer: str | None, learner: int | None, emulate_link: bool,
              connect_timeout_s: float, security: TransportSecurity | None,
              saved: dict[str, Any] | None = None, stop: threading.Event | None = None) -> Learner | Standalone:
    """The learner's side of syncing: joined to the run at `syncer`, or standing alone."""
    if syncer is None:
        if learner is None:
            raise DilocoError("a learner that does not sync needs its id (--id)")
        return Standalone(learner)
    return Learner(replica.model, replica.optimizer, syncer=syncer, learner=learner,
                   connect_timeout_s=connect_timeout_s, host=os.uname().nodename, security=security,
                   own_progress=saved.get("sync") if saved is not None else None, resume=config.failures.resume,
                   stop=stop, **sync_options(config, learner, emulate_link))


def sync_options(config: Config, learner: int | None, emulate_link: bool) -> dict[str, Any]:
    """The links, shard homes and tokens per step a learner of this config joins with (either framework)."""
    # With regions: the learner's whole route as one link (the slowest hop, the latencies summed), one per
    # home region when `placement = "links"` spreads the shards over the regions (with the regional tier
    # the learner syncs with its region's one syncer). Unlike the simulator, learners of a region do not
    # queue behind each other on its WAN link.
    link = _link_shape(config, learner, None) if emulate_link else None
    owners = None if Topology(config).tiered else fragment_owners(config)
    homes = None if owners is None else [HomeLink(home, _link_shape(config, learner, home) if emulate_link else None)
                                         for home in Topology(config).homes(len(owners))]
    return {"link": link, "tokens_per_step": config.train.batch_size * config.train.seq_len, "homes": homes,
            "owners": owners}


def _link_shape(config: Config, learner: int | None, home: str | None) -> LinkShape:
    """The learner's route to the shards in region `home` (None: the syncer's) as one emulated link."""
    shape = Topology(config).emulated_link(learner, home)
    return LinkShape(shape.bandwidth_mbit, shape.latency_ms)


def _data_shard(config: Config, tokens: Any, m: int, rank: int, world: int) -> ShardSampler:
    """The learner's data shard (a rank of it, under torchrun)."""
    t = config.train
    learners = max(len(config.speeds()), m + 1) * world
    return ShardSampler(tokens, learner=m * world + rank, learners=learners, seq_len=t.seq_len,
                        batch_size=t.batch_size, seed=config.seed)


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def restore_checkpoint(state: dict[str, Any], replica: Replica, world: int, policy: RestorePolicy,
                       own_params: bool = False) -> None:
    """A restarted learner's own state, as `core/recovery.py` says: data position and step count, and
    the inner optimizer unless the policy is `fresh`. Its parameters are Θ with its own unpushed progress
    on top (`core/own_progress.py`, done as it joins); `own_params`: a learner that does not sync has no Θ
    and resumes its saved ones. `state` was checked by `read_checkpoint`."""
    plan = restore_plan(policy, has_checkpoint=True)
    if own_params and "model" in state:
        with torch.no_grad():
            _unwrap(replica.model).load_state_dict(state["model"])
    if plan.optimizer and "optimizer" in state:  # none saved yet (its file came first, then went): fresh
        replica.optimizer.load_state_dict(state["optimizer"])
    if plan.data and (world == 1 or state.get("rank_data")):  # DDP: rank 0's position is only its own
        replica.sampler.load_state_dict(state["data"])
    if plan.steps:
        replica.steps = int(state["steps"])


def _saved_state(path: Path | None, config: Config, m: int | None, syncing: bool, replica: Replica,
                 seal: bytes | None) -> dict[str, Any] | None:
    """Learner m's checkpoint, checked, if it has one: its file (`read_checkpoint`), or a sharded learner's
    rows of its DCP folder (`read_sharded`, every rank at once)."""
    if path is None or m is None or not (path.is_file() or sharded_checkpoints.exists(path)):
        return None
    most = learner_plan(config, m, syncing=syncing).planned_steps * STEP_CAP
    if path.suffix == ".dcp":
        return sharded_checkpoints.read_sharded(path, _unwrap(replica.model), replica.optimizer, most, seal,
                                                own_params=not syncing)
    own = None if syncing else _unwrap(replica.model).state_dict()  # no Θ to take: it resumes its own
    return read_checkpoint(path, most, replica.optimizer, seal, params=own)


def _checkpoint_path(config: Config, out: Path | None, m: int | None, sharded: bool = False) -> Path | None:
    """Learner m's own checkpoint, where it keeps one (None: no out folder, or checkpoints off): a file, or
    a DCP folder for a sharded learner."""
    if out is None or m is None or not config.failures.learner_checkpoints:
        return None
    return out / "checkpoints" / f"learner-{m}.{'dcp' if sharded else 'pt'}"


def _learner_state(model: nn.Module, replica: Replica, sync: Learner | Standalone) -> dict[str, Any]:
    """What a learner's checkpoint holds (not yet copied: `CheckpointWriter` copies it). A syncing learner's
    parameters are not in it: a restart takes Θ and puts its own unpushed progress back on top, so a copy of
    them would be a quarter or more of every checkpoint's bytes that nothing reads."""
    learner = syncing_learner(sync)
    own = learner.own_progress_state(deferred=True) if learner is not None else None  # packed as computed
    return {**({"model": model.state_dict()} if learner is None else {"sync": own} if own is not None else {}),
            "optimizer": replica.optimizer.state_dict(), "data": replica.sampler.state_dict(), "steps": replica.steps}


def _checkpoint_report(writer: CheckpointWriter | sharded_checkpoints.ShardedWriter | None) -> dict[str, Any]:
    """What the own-progress checkpoints cost this learner, for its report (a sharded learner's: rank 0's)."""
    if writer is None:
        return {}
    return {"checkpoints_written": writer.written, "checkpoints_skipped": writer.skipped,
            "checkpoint_copy_s": writer.copy_s, "checkpoint_copy_total_s": writer.copy_total_s,
            "checkpoint_write_s": writer.write_s, "checkpoint_period": writer.pacer.period,
            "checkpoint_cost_s": writer.pacer.cost_s, "checkpoint_cost_total_s": writer.pacer.cost_total_s,
            **({"checkpoint_write_cpu_total_s": writer.write_cpu_total_s} if isinstance(writer, CheckpointWriter)
               else {})}
