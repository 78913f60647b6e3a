"""`diloco.jax.JaxLearner`: a JAX training loop joins a run, next to PyTorch learners if it likes.

    params = init(...); opt_state = optimizer.init(params)
    learner = JaxLearner(params, syncer="syncer-host:7070")   # joins; learner.params is Θ as it stands
    params = learner.params
    while not learner.should_stop:
        params, opt_state, loss = train_step(params, opt_state, batch)   # the user's jitted step
        params = learner.step(params, tokens=batch_tokens)             # never waits on the network
    report = learner.close(); params = learner.params                  # with the last merges

It is `diloco.Learner` driven over a host mirror of the params (`host_mirror.py`): the same core, codecs,
join, client link and step sequence; only the tensors it reads and writes are the mirror's. A push's
tensors are copied device → host on the mirror's staging thread, off the step (the link encodes the push
once they are); a merge's are copied when it reads them, and host → device once it wrote them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from diloco.client.learner_client import HomeLink, Learner, LinkShape
from diloco.core.own_progress import ResumePolicy
from diloco.jax.host_mirror import HostMirror
from diloco.jax.name_map import GPT_NAMES, NameMap
from diloco.transport.security import TransportSecurity


class JaxLearner:
    def __init__(self, params: Any, *, syncer: str, names: NameMap = GPT_NAMES, order: Sequence[str] | None = None,
                 embeddings: Sequence[str] = (), learner: int | None = None, link: LinkShape | None = None,
                 connect_timeout_s: float = 30.0, host: str = "", security: TransportSecurity | None = None,
                 tokens_per_step: int | None = None, homes: Sequence[HomeLink] | None = None,
                 owners: Sequence[int] | None = None, own_progress: Mapping[str, Any] | None = None,
                 resume: ResumePolicy = "own", stop: threading.Event | None = None) -> None:
        """Join the run at `syncer` with the model whose parameters are `params` (a pytree; its values
        seed Θ if this learner is the first to join). `names` maps its paths to Θ's names; `order` is
        Θ's tensor order (default the pytree's; the built-in GPT's is torch's: `flax_gpt.gpt_layout`);
        `embeddings`: the Θ names synced as embeddings. The rest is `diloco.Learner`'s (`own_progress`: what
        this learner's checkpoint saved of its unpushed progress, put back on top of Θ as it joins)."""
        self.mirror = HostMirror(params, names, order, embeddings)
        self.learner = Learner(self.mirror.module, syncer=syncer, learner=learner, link=link,
                               connect_timeout_s=connect_timeout_s, host=host, security=security,
                               tokens_per_step=tokens_per_step, homes=homes, owners=owners, host_params=self.mirror,
                               own_progress=own_progress, resume=resume, stop=stop)
        if self.learner.link is not None:  # its pushes' device → host copies are staged off the step
            self.mirror.stage_pushes(self.learner.core)
            self.learner.staging = self.learner.link.landing = self.mirror  # type: ignore[assignment]
        self.params = self.mirror.merged_into(params, self.mirror)
        """The latest params: Θ as joined, then what `step` and `close` return."""

    @property
    def should_stop(self) -> bool:
        return self.learner.should_stop

    @property
    def id(self) -> int:
        return self.learner.id

    def __getattr__(self, name: str) -> Any:
        """The rest of `diloco.Learner`'s surface (rank, world, core, up, down, resume, request_stop, report)."""
        if name in ("learner", "mirror"):
            raise AttributeError(name)
        return getattr(self.learner, name)

    def step(self, params: Any, tokens: int) -> Any:
        """One inner step made `params`: push what is due, merge what has arrived; return the params to
        train on (`params` with the merged tensors replaced)."""
        self.mirror.trained(params)
        self.mirror.stepping = True
        try:
            self.params = self._with_merges(params, lambda: self.learner.step(tokens))
        finally:
            self.mirror.stepping = False
        return self.params

    def close(self, finished: bool = True) -> dict[str, Any]:
        """Push what no push carried, leave; `params` then holds the last merges. Returns the report."""
        report: dict[str, Any] = {}

        def finish() -> None:
            report.update(self.learner.close(finished))

        self.params = self._with_merges(self.params, finish)
        self.mirror.close()
        return report

    def _with_merges(self, params: Any, act: Any) -> Any:
        core = self.learner.core
        before, merges = list(core.anchor_versions), self.learner.merges
        act()
        if self.learner.merges == merges:  # most steps: nothing to copy back
            return params
        merged = [n for p, (old, new) in enumerate(zip(before, core.anchor_versions)) if old != new
                  for n in core.fragments[p].names]
        return self.mirror.merged_into(params, merged)
