"""Nesterov SGD on the global parameters Θ, in PyTorch's convention, with fp32 state.

    b ← μ·b + Δ;   Θ ← Θ − η·(Δ + μ·b)

Δ is the outer gradient (anchor − learner), so a positive η moves Θ towards the learners.
"""

from __future__ import annotations

import copy

import torch


class Nesterov:
    def __init__(self, lr: float, momentum: float) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"Nesterov needs lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr, self.momentum = lr, momentum
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], share: float = 1.0) -> None:
        """Update `params` (fp32, in place) with the merged outer gradients `deltas`, scaled by the
        share of a full round they stand for (1 unless the syncer heard from only some learners)."""
        for name, theta in params.items():
            delta = deltas[name].to(torch.float32) * share
            buf = self.buffers.get(name)
            if buf is None:
                buf = torch.zeros_like(theta, dtype=torch.float32)
            buf = self.buffers[name] = (buf * self.momentum).add_(delta)  # a new buffer: see `fork`
            theta.sub_(delta.add(buf, alpha=self.momentum), alpha=self.lr)

    def fork(self) -> Nesterov:
        """A copy sharing this one's tensors: steps replace them, never change them in place, so this
        one stays as it was until the copy is taken instead (the syncer commits a round that way)."""
        twin = copy.copy(self)
        twin.buffers = dict(self.buffers)
        return twin

    def tensors(self) -> list[torch.Tensor]:
        """Its state as it is (not copies): for finiteness checks and memory accounting."""
        return list(self.buffers.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: buf.clone() for name, buf in self.buffers.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.buffers = {name: buf.clone().to(torch.float32) for name, buf in state.items()}
