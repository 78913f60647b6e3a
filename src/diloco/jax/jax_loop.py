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
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco.client.builtin_loop import (Standalone, _data_shard, _metrics_for, _Training, sync_options,
                                        write_report)
from diloco.config import Config
from diloco.driver_kit.schedule import learner_plan
from diloco.errors import DilocoError
from diloco.fragments import embedding_names
from diloco.jax.equivalence import flax_params_for
from diloco.jax.flax_gpt import FlaxGPT
from diloco.jax.jax_learner import JaxLearner
from diloco.jax.jax_training import JaxReplica
from diloco.materials import prepare
from diloco.metrics.records import LearnerMeter
from diloco.status.endpoint import LOOPBACK, HttpExposure
from diloco.transport.security import TransportSecurity


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


def run_jax_learner(config: Config, *, syncer: str | None, learner: int | None = None, out: Path | None = None,
                    emulate_link: bool = False, stop: threading.Event | None = None,
                    connect_timeout_s: float = 30.0, metrics_port: int | None = None,
                    metrics_port_file: str | None = None, security: TransportSecurity | None = None,
                    metrics_http: HttpExposure = LOOPBACK) -> dict[str, Any]:
    """`builtin_loop.run_learner` for a JAX learner: train to the end of the plan or the shared budget;
    the report also goes to OUT/learners/learner-ID.json."""
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
    if syncer is None:
        if learner is None:
            raise DilocoError("a learner that does not sync needs its id (--id)")
        sync: JaxLearner | Standalone = Standalone(learner)
    else:
        sync = JaxLearner(params, syncer=syncer, learner=learner, order=list(theta),
                          embeddings=sorted(embedding_names(torch_model)), connect_timeout_s=connect_timeout_s,
                          host=os.uname().nodename, security=security, **sync_options(config, learner, emulate_link))
        replica.params = sync.params
    m = sync.id
    plan = learner_plan(config, m, syncing=syncer is not None)
    replica.sampler = _data_shard(config, materials.corpus.train, m, 0, 1)
    replica.planned_steps = plan.planned_steps
    metrics = _metrics_for(config, out, m, 0, metrics_port, metrics_port_file, metrics_http)
    synced = _Synced(sync, replica)
    training = _Training(replica, synced, LearnerMeter(metrics, m, config.metrics.every_steps), metrics,  # type: ignore[arg-type]
                         world=1, rank=0, speed=plan.speed, stop=stop, writer=None)
    training.run(plan.last_step)
    report = synced.close(finished=not (stop is not None and stop.is_set()))
    training.record(final=True)
    evaluate = jax.jit(loss_fn)
    report["eval_loss"] = float(np.mean([float(evaluate(replica.params, jnp.asarray(x.numpy()), jnp.asarray(y.numpy())))
                                         for x, y in materials.eval_batches]))
    metrics.close()
    training.complete(report, plan.planned_steps, resumed_from=0)
    report.update(framework="jax", copied_to_host=sync.mirror.copied_to_host if isinstance(sync, JaxLearner) else 0)
    if out is not None:
        write_report(out, report)
    return report
