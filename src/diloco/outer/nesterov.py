"""Nesterov SGD on the global parameters Θ, in PyTorch's convention, with fp32 state.

    b ← μ·b + Δ;   Θ ← Θ − η·(Δ + μ·b)

Δ is the outer gradient (anchor − learner), so a positive η moves Θ towards the learners.
"""

from __future__ import annotations

import copy

import torch

from diloco.outer.buffers import NewTensor, fp32_like


class Nesterov:
    def __init__(self, lr: float, momentum: float) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"Nesterov needs lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr, self.momentum = lr, momentum
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], share: float = 1.0,
             out: dict[str, torch.Tensor] | None = None, new: NewTensor = fp32_like) -> None:
        """Step `params` (fp32) with the merged outer gradients `deltas`, scaled by the share of a full round
        they stand for (1 unless the syncer heard from only some learners): in place, or into `out` (the
        syncer's new Θ, `params` left as they were). Its new state and temporaries come from `new`."""
        for name, theta in params.items():
            delta = torch.mul(deltas[name].to(torch.float32), share, out=new(theta))
            buf = self.buffers.get(name)
            if buf is None:
                buf = torch.zeros_like(theta, dtype=torch.float32)
            buf = self.buffers[name] = torch.mul(buf, self.momentum, out=new(theta)).add_(delta)  # new: see `fork`
            torch.sub(theta, delta.add_(buf, alpha=self.momentum), alpha=self.lr,
                      out=theta if out is None else out[name])

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
