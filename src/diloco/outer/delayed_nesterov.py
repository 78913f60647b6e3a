"""Delayed Nesterov (arXiv 2401.09135), for outer gradients that arrive a few learners at a time.

Applying every arrival through Nesterov momentum compounds the momentum once per arrival instead of
once per round of all learners. Delayed Nesterov keeps a sum S of arrivals and touches the momentum
once every N arrivals; in between it takes plain steps:

    on the t-th arrival g:  S ← S + g
      t mod N ≠ 0:  Θ ← Θ − η·g/N                      (plain step, momentum untouched)
      t mod N = 0:  b ← μ·b + S/N;  Θ ← Θ − η·(μ·b + g/N);  S ← 0

Generalised here to arrivals that each carry a share s of a full round (the decoupled syncer's
rounds hear from a varying part of the learners): plain steps of η·s·g, and the momentum step once
the shares add up to a full round. s = 1/N for every arrival is the paper's algorithm with buffer N;
s = 1 for every arrival is plain Nesterov.
"""

from __future__ import annotations

import copy

import torch

import diloco.chunk_threads as chunk_threads
from diloco.cache_chunks import Scaled, chunks, piece_of
import diloco.outer.compiled_step as compiled_step
from diloco.outer.buffers import NewTensor, Written, fp32_like

_FULL = 1.0 - 1e-9
"""Shares that add up to at least this make a full round (1/3 + 1/3 + 1/3 may fall short of 1.0)."""


class DelayedNesterov:
    def __init__(self, lr: float, momentum: float, buffer: int = 0) -> None:
        """`buffer` N > 0 fixes every arrival's share to 1/N (the paper); 0 takes the share given."""
        if lr <= 0 or not 0 <= momentum < 1 or buffer < 0:
            raise ValueError(f"DelayedNesterov needs lr > 0, 0 <= momentum < 1, buffer >= 0; "
                             f"got lr={lr}, momentum={momentum}, buffer={buffer}")
        self.lr, self.momentum = lr, momentum
        self.fixed_share = 1.0 / buffer if buffer else None
        self.accumulated = 0.0
        self.sums: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor | Scaled], share: float = 1.0,
             out: dict[str, torch.Tensor] | None = None, new: NewTensor = fp32_like, written: Written | None = None
             ) -> list[torch.Tensor]:
        """Step `params` in place, or into `out` (the syncer's new Θ, `params` left as they were). Its new
        state comes from `new`; the state it holds is replaced, never written (`fork`). `written` is
        called as each chunk of the new values is done (`buffers.Written`: with its squares where the compiled
        loop summed them as it wrote), to read it while it is in cache. Returns
        the new state tensors not known to be finite (the compiled loops check what they write)."""
        s = self.fixed_share or share
        if not 0 < s <= 1:
            raise ValueError(f"an arrival's share of a round must be in (0, 1], got {s}")
        self.accumulated += s
        full_round = self.accumulated >= _FULL
        unchecked: list[torch.Tensor] = []
        for name, theta in params.items():
            total = self.sums.get(name)
            if total is None:
                total = torch.zeros_like(theta, dtype=torch.float32)
                self.buffers[name] = torch.zeros_like(theta, dtype=torch.float32)
            old, new_total = total.reshape(-1), new(theta)
            self.sums[name] = new_total
            made = [new_total]
            momentum = old_momentum = None
            if full_round:
                old_momentum, self.buffers[name] = self.buffers[name].reshape(-1), new(theta)
                momentum = self.buffers[name].view(-1)
                made = [self.buffers[name]]  # the sums are zeroed
            target = (theta if out is None else out[name]).view(-1)
            delta = deltas[name]
            source = (delta.tensor if isinstance(delta, Scaled) else delta).reshape(-1)
            factor, divide = (delta.factor, delta.divide) if isinstance(delta, Scaled) else (1.0, False)
            state = [old, new_total] if momentum is None else [old, new_total, old_momentum, momentum]
            compiled = compiled_step.usable(theta, source, target, *state)

            def one_chunk(start: int, stop: int) -> bool:
                piece, part = theta.reshape(-1)[start:stop], slice(start, stop)
                stepped = None
                if compiled and momentum is None:  # one loop each, the same values (`compiled_step.py`)
                    stepped = compiled_step.plain_step(piece, source[part], factor, divide, old[part], s,
                                                       self.lr * s, new_total.view(-1)[part], target[part])
                elif compiled:
                    stepped = compiled_step.momentum_step(piece, source[part], factor, divide, old[part], s,
                                                          self.momentum, old_momentum[part], self.lr,
                                                          new_total.view(-1)[part], momentum[part], target[part])
                else:
                    self._step_chunk(piece, piece_of(delta, start, stop), target[part], s, old[part],
                                     new_total.view(-1)[part], None if old_momentum is None else old_momentum[part],
                                     None if momentum is None else momentum[part])
                if written is not None:  # the loop's squares are of new − old only where it wrote into `out`
                    written(name, start, stop, stepped.squares if stepped is not None and out is not None else None)
                return stepped is not None and stepped.finite

            spans = list(chunks(target.numel(), target.device))
            # the compiled loops' chunks on the shard's threads (`chunk_threads`); torch's ops use its own
            done = chunk_threads.run(spans, one_chunk) if compiled else [one_chunk(*span) for span in spans]
            if not (compiled and all(done)):
                unchecked += made
        if full_round:
            self.accumulated = 0.0
        return unchecked

    def _step_chunk(self, theta: torch.Tensor, g: torch.Tensor, target: torch.Tensor, s: float, old: torch.Tensor,
                    total: torch.Tensor, old_momentum: torch.Tensor | None, momentum: torch.Tensor | None) -> None:
        """One chunk of one tensor's step, every op of the rule while it is in cache: the same values as
        whole-tensor ops. `momentum` None: a plain step."""
        summed = torch.add(old, g, alpha=s, out=total)
        if momentum is None:
            torch.sub(theta, g, alpha=self.lr * s, out=target)
            return
        b = torch.mul(old_momentum, self.momentum, out=momentum).add_(summed)
        torch.sub(theta, torch.mul(b, self.momentum).add_(g, alpha=s), alpha=self.lr, out=target)
        summed.zero_()  # made by this step: nobody else holds it

    def fork(self) -> DelayedNesterov:
        """A copy sharing this one's tensors: steps replace them, never change them in place, so this
        one stays as it was until the copy is taken instead (the syncer commits a round that way)."""
        twin = copy.copy(self)
        twin.sums, twin.buffers = dict(self.sums), dict(self.buffers)
        return twin

    def tensors(self) -> list[torch.Tensor]:
        """Its state as it is (not copies): for finiteness checks and memory accounting."""
        return [*self.sums.values(), *self.buffers.values()]

    def state_dict(self) -> dict:
        return {"accumulated": self.accumulated, "sums": {n: t.clone() for n, t in self.sums.items()},
                "buffers": {n: t.clone() for n, t in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.accumulated = float(state["accumulated"])
        self.sums = {n: t.clone().to(torch.float32) for n, t in state["sums"].items()}
        self.buffers = {n: t.clone().to(torch.float32) for n, t in state["buffers"].items()}
