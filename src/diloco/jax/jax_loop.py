"""The built-in JAX learner (`diloco learner --framework jax`, a "jax" entry of `learners.frameworks`).

The built-in torch learner's loop (`client/builtin_loop.py`: its data shard, plan, speed emulation,
metrics and report) with a JAX replica: the built-in GPT in Flax, trained by the same AdamW, clipping
and schedule, synced through a `JaxLearner`. Its first params are the torch model's initial values, so
Θ starts the same whichever learner seeds it. One process, one device: no torchrun ranks.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from diloco.client.builtin_loop import (Standalone, _checkpoint_path, _checkpoint_report, _data_shard,
                                        _learner_state, _metrics_for, _saved_state, _Training, _writer_for,
                                        restore_checkpoint, sync_options, write_report)
from diloco.client.checkpoints import CheckpointWriter, checkpoint_key
from diloco.config import Config
from diloco.driver_kit.schedule import LearnerPlan, learner_plan
from diloco.errors import DilocoError
from diloco.fragments import embedding_names
from diloco.jax.equivalence import flax_params_for
from diloco.jax.flax_gpt import FlaxGPT
from diloco.jax.jax_learner import JaxLearner
from diloco.jax.jax_training import JaxReplica
from diloco.materials import Materials, prepare
from diloco.metrics.records import LearnerMeter
from diloco.status.endpoint import LOOPBACK, HttpExposure
from diloco.transport.security import TransportSecurity

log = logging.getLogger("diloco.learner")


class _Synced:
    """What the loop steps: the replica's params go through the JAX learner after every step."""

    def __init__(self, sync: JaxLearner | Standalone, replica: JaxReplica) -> None:
        self.sync, self.replica = sync, replica

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sync, name)

    def step(self, tokens: int) -> None:
        if isinstance(self.sync, JaxLearner):
            self.replica.params = self.sync.step(self.replica.params, tokens)

    def close(self, finished: bool = True) -> dict[str, Any]:
        report = self.sync.close(finished)
        if isinstance(self.sync, JaxLearner):
            self.replica.params = self.sync.params
        return report


@dataclass
class JaxLife:
    """A JAX learner started (joined, its checkpoint restored) and not yet trained: what a restart resumes."""

    config: Config
    materials: Materials
    replica: JaxReplica
    sync: JaxLearner | Standalone
    plan: LearnerPlan
    checkpoint: Path | None
    writer: CheckpointWriter | None
    resumed_from: int
    loss_fn: Callable[[Any, jax.Array, jax.Array], jax.Array]


def start_jax_learner(config: Config, *, syncer: str | None, learner: int | None = None, out: Path | None = None,
                      emulate_link: bool = False, connect_timeout_s: float = 30.0,
                      security: TransportSecurity | None = None, stop: threading.Event | None = None) -> JaxLife:
    """The built-in GPT in Flax, joined to the run at `syncer` (None: standing alone as `learner`), with
    its own checkpoint restored as the torch learner's is: inner optimizer (optax), data position and step
    from it; its unpushed progress on top of Θ (`core/own_progress.py`)."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # not the TPU it looked for on a CPU host
    if config.model.factory:
        raise DilocoError("a JAX learner trains the built-in GPT; a model of your own joins through "
                          "diloco.jax.JaxLearner (docs/jax.md)")
    materials = prepare(config)
    torch_model = materials.model
    model = FlaxGPT(torch_model.cfg)
    theta = {n: p.detach() for n, p in torch_model.named_parameters()}
    params = flax_params_for(model, theta)

    def loss_fn(p: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        return model.apply({"params": p}, inputs, targets)

    replica = JaxReplica(params, loss_fn, config.train, sampler=None, planned_steps=1)
    replica.compile()
    seal = checkpoint_key(security.secret, security.learner.token if security.learner else None) \
        if security is not None else None
    saved = _checked(_checkpoint_path(config, out, learner), config, learner, syncer is not None, replica, seal)
    if syncer is None:
        if learner is None:
            raise DilocoError("a learner that does not sync needs its id (--id)")
        sync: JaxLearner | Standalone = Standalone(learner)
    else:
        sync = JaxLearner(params, syncer=syncer, learner=learner, order=list(theta),
                          embeddings=sorted(embedding_names(torch_model)), connect_timeout_s=connect_timeout_s,
                          host=os.uname().nodename, security=security,
                          own_progress=saved.get("sync") if saved is not None else None,
                          resume=config.failures.resume, stop=stop, **sync_options(config, learner, emulate_link))
        replica.params = sync.params
    m = sync.id
    plan = learner_plan(config, m, syncing=syncer is not None)
    replica.sampler = _data_shard(config, materials.corpus.train, m, 0, 1)
    replica.planned_steps = plan.planned_steps
    checkpoint = _checkpoint_path(config, out, m)
    if saved is None and learner is None:  # an id the syncer picked: Θ without own progress
        saved = _checked(checkpoint, config, m, syncer is not None, replica, seal)
    if saved is not None:
        restore_checkpoint(saved, replica, 1, config.failures.restore,  # type: ignore[arg-type]
                           own_params=syncer is None)
        sync.resume(replica.steps)
        log.info("JAX learner %d resumes at step %d from %s (own progress: fragments %s)", m, replica.steps,
                 checkpoint, [p for p, why in getattr(sync, "resumed", {}).items() if why is None])
    writer = _writer_for(checkpoint, seal, config, sync, sharded=False, shares_cpu=jax.default_backend() == "cpu")
    return JaxLife(config, materials, replica, sync, plan, checkpoint, writer,  # type: ignore[arg-type]
                   replica.steps, loss_fn)


def run_jax_learner(config: Config, *, syncer: str | None, learner: int | None = None, out: Path | None = None,
                    emulate_link: bool = False, stop: threading.Event | None = None,
                    connect_timeout_s: float = 30.0, metrics_port: int | None = None,
                    metrics_port_file: str | None = None, security: TransportSecurity | None = None,
                    metrics_http: HttpExposure = LOOPBACK) -> dict[str, Any]:
    """`builtin_loop.run_learner` for a JAX learner: train to the end of the plan or the shared budget;
    the report also goes to OUT/learners/learner-ID.json, with a checkpoint as the torch learner's."""
    life = start_jax_learner(config, syncer=syncer, learner=learner, out=out, emulate_link=emulate_link,
                             connect_timeout_s=connect_timeout_s, security=security, stop=stop)
    return train_jax_learner(life, out=out, stop=stop, metrics_port=metrics_port,
                             metrics_port_file=metrics_port_file, metrics_http=metrics_http)


def train_jax_learner(life: JaxLife, *, out: Path | None = None, stop: threading.Event | None = None,
                      metrics_port: int | None = None, metrics_port_file: str | None = None,
                      metrics_http: HttpExposure = LOOPBACK) -> dict[str, Any]:
    """Train a started JAX learner to the end of its plan (or the shared budget, or `stop`), leave, and
    write its last checkpoint and its report."""
    config, replica, sync, writer = life.config, life.replica, life.sync, life.writer
    m = sync.id
    metrics = _metrics_for(config, out, m, 0, metrics_port, metrics_port_file, metrics_http)
    synced = _Synced(sync, replica)
    meter = LearnerMeter(metrics, m, config.metrics.every_steps, at_pushes=True)
    training = _Training(replica, synced, meter, metrics,  # type: ignore[arg-type]
                         world=1, rank=0, speed=life.plan.speed, stop=stop, writer=writer,
                         on_cpu=jax.default_backend() == "cpu")
    training.start = {"steps": life.resumed_from,
                      "resumed_fragments": sum(why is None for why in getattr(sync, "resumed", {}).values())}
    training.run(life.plan.last_step)
    report = synced.close(finished=not (stop is not None and stop.is_set()))
    training.record(final=True)
    evaluate = jax.jit(life.loss_fn)
    report["eval_loss"] = float(np.mean([float(evaluate(replica.params, jnp.asarray(x.numpy()), jnp.asarray(y.numpy())))
                                         for x, y in life.materials.eval_batches]))
    metrics.close()
    training.complete(report, life.plan.planned_steps, life.resumed_from)
    mirror = sync.mirror if isinstance(sync, JaxLearner) else None
    report.update(framework="jax", copied_to_host=mirror.copied_to_host if mirror else 0,
                  staged_to_host=mirror.staged if mirror else 0,
                  **_checkpoint_report(writer))
    if writer is not None:  # after the last pushes: a restart resumes nothing twice
        writer.save(lambda: _learner_state(replica.model, replica, synced), wait=True)  # type: ignore[arg-type]
    if out is not None:
        write_report(out, report)
    return report


def _checked(path: Path | None, config: Config, m: int | None, syncing: bool, replica: JaxReplica,
             seal: bytes | None) -> dict[str, Any] | None:
    """Learner m's checkpoint, checked as the torch learner's is (`_saved_state`: a damaged or foreign
    one stops the learner in one line, as it stops a torch learner) and its optax state leaf for leaf."""
    saved = _saved_state(path, config, m, syncing, replica, seal)  # type: ignore[arg-type]
    if saved is not None and "optimizer" in saved:
        replica.optimizer.converted(saved["optimizer"], path)
    return saved
