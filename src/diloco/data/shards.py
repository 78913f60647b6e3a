"""Deterministic, disjoint per-learner shards, and the fixed held-out evaluation batches.

Learner m owns the m-th contiguous slice of the training tokens. Its slice is cut into windows of
`seq_len + 1` tokens; each epoch visits them in an order drawn from (seed, learner, epoch). The
position (epoch, index) is all the state there is, so saving and resuming it replays the same batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from diloco.errors import DilocoError

Batch = tuple[torch.Tensor, torch.Tensor]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    block = torch.from_numpy(rows)
    return block[:, :-1], block[:, 1:]


class ShardSampler:
    """Batches for one learner, from its own disjoint slice of the training tokens."""

    def __init__(self, tokens: np.ndarray, *, learner: int, learners: int, seq_len: int,
                 batch_size: int, seed: int) -> None:
        if not 0 <= learner < learners:
            raise ValueError(f"learner {learner} is not in [0, {learners})")
        size = len(tokens) // learners
        self.tokens = tokens[learner * size : (learner + 1) * size]
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < batch_size:
            raise DilocoError(
                f"each learner's shard holds {len(self.tokens)} tokens: fewer than one batch of "
                f"{batch_size} x {seq_len}; use a larger corpus, fewer learners or a smaller batch")
        self.learner, self.seq_len, self.batch_size, self.seed = learner, seq_len, batch_size, seed
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, self.learner, epoch))
        return rng.permutation(self.windows)

    def next_batch(self) -> Batch:
        if self.index + self.batch_size > self.windows:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        picked = self._order[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return _windows(self.tokens, picked * self.seq_len, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {"learner": self.learner, "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("learner") != self.learner:
            raise DilocoError(f"data position belongs to learner {state.get('learner')}, not {self.learner}")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.windows:
            raise DilocoError(f"data position epoch={epoch} index={index} is out of range for this shard")
        self.epoch, self.index = epoch, index
        self._order = self._epoch_order(epoch)


class EvalBatches:
    """The same held-out batches every time, so eval losses compare across runs and strategies."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, batches: int) -> None:
        windows = (len(tokens) - 1) // seq_len
        if windows < 1:
            raise DilocoError(f"the held-out split has {len(tokens)} tokens: fewer than one sequence of {seq_len}")
        wanted = batches * batch_size
        # Spread the windows over the whole held-out split rather than taking its first pages.
        starts = np.linspace(0, windows - 1, num=wanted).round().astype(np.int64) * seq_len
        self.batches = [_windows(tokens, starts[i : i + batch_size], seq_len) for i in range(0, wanted, batch_size)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
