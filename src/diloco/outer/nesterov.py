"""Nesterov SGD on the global parameters Θ, in PyTorch's convention, with fp32 state.

    b ← μ·b + Δ;   Θ ← Θ − η·(Δ + μ·b)

Δ is the outer gradient (anchor − learner), so a positive η moves Θ towards the learners.
"""

from __future__ import annotations

import copy

import torch

from diloco.cache_chunks import Scaled, chunks, piece_of
from diloco.outer.buffers import NewTensor, Written, fp32_like


class Nesterov:
    def __init__(self, lr: float, momentum: float) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"Nesterov needs lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr, self.momentum = lr, momentum
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor | Scaled], share: float = 1.0,
             out: dict[str, torch.Tensor] | None = None, new: NewTensor = fp32_like, written: Written | None = None
             ) -> list[torch.Tensor]:
        """Step `params` (fp32) with the merged outer gradients `deltas`, scaled by the share of a full round
        they stand for (1 unless the syncer heard from only some learners): in place, or into `out` (the
        syncer's new Θ, `params` left as they were). Its new state comes from `new`. A chunk at a time, each
        op of the rule done while the chunk is in cache: the same values as whole-tensor ops; `written` is
        called as each chunk of the new values is done (`buffers.Written`), to read it while it is in cache."""
        for name, theta in params.items():
            old = self.buffers.get(name)
            if old is None:
                old = torch.zeros_like(theta, dtype=torch.float32)
            buf = self.buffers[name] = new(theta)  # new: see `fork`
            target = (theta if out is None else out[name]).view(-1)
            flat, old, buf = theta.reshape(-1), old.reshape(-1), buf.view(-1)
            for start, stop in chunks(flat.numel(), flat.device):
                delta = torch.mul(piece_of(deltas[name], start, stop), share)
                momentum = torch.mul(old[start:stop], self.momentum, out=buf[start:stop]).add_(delta)
                torch.sub(flat[start:stop], delta.add_(momentum, alpha=self.momentum), alpha=self.lr,
                          out=target[start:stop])
                if written is not None:
                    written(name, start, stop, None)
        return [self.buffers[name] for name in params]

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
