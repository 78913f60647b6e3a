"""Delayed Nesterov (arXiv 2401.09135), for outer gradients that arrive one learner at a time.

Applying every arrival through Nesterov momentum compounds the momentum N times per "round" of N
learners. Delayed Nesterov keeps a sum S of arrivals and touches the momentum once every N:

    on the t-th arrival g:  S ← S + g
      t mod N ≠ 0:  Θ ← Θ − η·g/N                      (plain step, momentum untouched)
      t mod N = 0:  b ← μ·b + S/N;  Θ ← Θ − η·(μ·b + g/N);  S ← 0
"""

from __future__ import annotations

import torch


class DelayedNesterov:
    def __init__(self, lr: float, momentum: float, buffer: int) -> None:
        if lr <= 0 or not 0 <= momentum < 1 or buffer < 1:
            raise ValueError(f"DelayedNesterov needs lr > 0, 0 <= momentum < 1, buffer >= 1; "
                             f"got lr={lr}, momentum={momentum}, buffer={buffer}")
        self.lr, self.momentum, self.buffer = lr, momentum, buffer
        self.arrivals = 0
        self.sums: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]) -> None:
        self.arrivals += 1
        update_momentum = self.arrivals % self.buffer == 0
        for name, theta in params.items():
            g = deltas[name].to(torch.float32)
            total = self.sums.get(name)
            if total is None:
                total = self.sums[name] = torch.zeros_like(theta, dtype=torch.float32)
                self.buffers[name] = torch.zeros_like(theta, dtype=torch.float32)
            total.add_(g)
            if not update_momentum:
                theta.sub_(g, alpha=self.lr / self.buffer)
                continue
            b = self.buffers[name]
            b.mul_(self.momentum).add_(total, alpha=1.0 / self.buffer)
            theta.sub_(b.mul(self.momentum).add_(g, alpha=1.0 / self.buffer), alpha=self.lr)
            total.zero_()
