"""A learner's own checkpoint (inner optimizer, data position, step count, and the progress no push has
carried yet: `core/own_progress.py`): written off the training step, with its digest; read back only
once it is checked.

How often: the training thread takes a copy (`CheckpointWriter.save`, packed: `packed_state.py`); the
write runs on a background thread. The period is the fewest steps that keep that copy, and where training
computes on the same CPUs the write's CPU time too, within `COST_SHARE` of their time (and at most
`failures.checkpoint_every` steps), and a checkpoint whose predecessor is still being written is
skipped, never waited for. What a checkpoint costs in all, the copy plus the time steps lose while the
write runs beside them, is measured and reported (`CheckpointPacer`).

The inner optimizer's state is saved every `OPTIMIZER_EVERY` checkpoints, to a file of its own beside
the learner's (learner-0.optimizer.pt), and read back with it: a restart may take moments a few
checkpoints old, and the progress, which is what a kill loses, is saved more often for the same cost.

Each file is a `state_files.py` file (torch.save plus a BLAKE3 trailer, keyed with the run's secret or
the learner's own credential when it holds one). Reading refuses, in one line
naming the file, anything a restarted learner should not build on: a damaged or foreign file, a step
count above what the run could have taken, an optimizer state for other parameters (another number,
other shapes) or holding NaN/Inf, a data position that is not one. Deleting the file restarts the
learner from the syncer's current Θ without its own state, which is always safe; deleting the
optimizer's file restarts its inner optimizer afresh.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from diloco.clock import SYSTEM_CLOCK as clock

from diloco.client.packed_state import packed_copy, unpacked
from diloco.codecs.base import all_finite
from diloco.errors import DilocoError
from diloco.state_files import file_key, load_checked, save_checked

ADVICE = "delete it to restart this learner from the current Θ without its own state"

COST_SHARE = 0.01
"""The share of step time checkpoints may cost training."""

BASELINE_STEPS = 3
"""Steps timed with no write on its way before the first checkpoint: what a step takes without one."""

OPTIMIZER_EVERY = 4
"""Checkpoints per save of the inner optimizer's state, which has a file of its own (`optimizer_file`). A
kill loses the progress trained since the last checkpoint; the moments a restart takes may be a few
checkpoints old (AdamW's moments average over many steps, and `failures.restore = "fresh"` takes none).
AdamW's two moments are most of a syncing learner's checkpoint, so saving them at a quarter of the rate
saves the progress about twice as often for the same cost."""

OPTIMIZER_ADVICE = "delete it to restart this learner's inner optimizer afresh (its own progress is kept)"


def optimizer_file(path: Path) -> Path:
    """Where the learner checkpoint at `path` keeps its inner optimizer's state (learner-0.optimizer.pt)."""
    return path.with_name(f"{path.stem}.optimizer{path.suffix}")


def write_checkpoint(state: dict[str, Any], path: Path, key: bytes | None = None) -> None:
    """The checkpoint at `path`, atomically, with its digest (sealed with `key`: `checkpoint_key`)."""
    save_checked(state, path, key)


def checkpoint_key(secret: bytes | None, own_token: str | None = None) -> bytes | None:
    """What seals a learner's checkpoint: the run's secret, else the learner's own credential, if any."""
    return file_key(secret if secret is not None else own_token.encode("ascii") if own_token else None)


def read_checkpoint(path: Path, max_steps: int, optimizer: torch.optim.Optimizer, key: bytes | None = None,
                    params: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The checkpoint at `path`, checked against this run (`max_steps`: the most steps a learner of
    it can take) and this learner's `optimizer`, with the optimizer's state from its own file where it has
    one (none: the state holds no "optimizer"); `params`: it must hold parameters that fit these (a learner
    that does not sync resumes its own). A one-line DilocoError for anything else."""
    state = _unpacked_file(path, key, ADVICE)
    check_checkpoint(state, path, max_steps, optimizer)
    if params is not None:
        _check_params(state.get("model"), params, _refusal(path))
    moments = optimizer_file(path)
    if "optimizer" not in state and moments.is_file():
        saved = _unpacked_file(moments, key, OPTIMIZER_ADVICE)
        _check_optimizer(saved.get("optimizer") if isinstance(saved, dict) else None, optimizer,
                         _refusal(moments, OPTIMIZER_ADVICE))
        state["optimizer"] = saved["optimizer"]
    return state


def _refusal(path: Path, advice: str = ADVICE) -> Callable[[str], DilocoError]:
    """The one line that refuses the learner checkpoint file at `path`: which file, why, what to do."""
    return lambda why: DilocoError(f"learner checkpoint {path} {why}: {advice}")


def _unpacked_file(path: Path, key: bytes | None, advice: str) -> Any:
    state = load_checked(path, "learner checkpoint", advice, key)
    try:
        return unpacked(state)
    except ValueError as exc:
        raise _refusal(path, advice)(str(exc)) from None


def check_checkpoint(state: dict[str, Any], path: Path, max_steps: int, optimizer: torch.optim.Optimizer) -> None:
    """The checks `read_checkpoint` makes on a loaded state (a sharded learner's state: one rank's part)."""
    refuse = _refusal(path)

    steps = state.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise refuse(f"has no valid step count ({type(steps).__name__})")
    if steps > max_steps:
        raise refuse(f"claims {steps} steps, more than this run could have taken (at most {max_steps})")
    data = state.get("data")
    if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("learner", "epoch", "index")):
        raise refuse("has no valid data position")
    if "optimizer" in state:  # else it is in a file of its own, or was never saved
        _check_optimizer(state["optimizer"], optimizer, refuse)


def _check_params(saved: Any, params: Mapping[str, torch.Tensor], refuse: Callable[[str], DilocoError]) -> None:
    """Saved parameters that this model can take: the same names and shapes, all finite."""
    if not isinstance(saved, dict) or set(saved) != set(params):
        raise refuse("holds no parameters of this model")
    for name, value in saved.items():
        if not isinstance(value, torch.Tensor) or value.shape != params[name].shape:
            raise refuse(f"holds parameter {name!r} of another shape")
        if not all_finite(value):
            raise refuse(f"holds NaN or Inf in parameter {name!r}")


def _check_optimizer(saved: Any, optimizer: torch.optim.Optimizer, refuse) -> None:
    """The saved optimizer state fits this optimizer's parameters: same groups, same sizes, shapes of
    every per-parameter tensor, all finite (what torch's load_state_dict leaves to the next step)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise refuse("has no valid optimizer state")
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups) or any(
            not isinstance(s, dict) or len(s.get("params", ())) != len(g["params"])
            for s, g in zip(saved["param_groups"], groups)):
        raise refuse("holds the optimizer state of other parameters (another number of them)")
    params = {index: p for s, g in zip(saved["param_groups"], groups) for index, p in zip(s["params"], g["params"])}
    for index, per_param in saved["state"].items():
        if index not in params or not isinstance(per_param, dict):
            raise refuse(f"holds optimizer state for parameter {index!r}, which this model does not have")
        shape = params[index].shape
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                if value.dim() > 0 and value.shape != shape:
                    raise refuse(f"holds optimizer state {key!r} of shape {list(value.shape)} for a parameter of "
                                 f"shape {list(shape)}")
                if not all_finite(value):
                    raise refuse(f"holds NaN or Inf in optimizer state {key!r}")
            elif isinstance(value, float) and not math.isfinite(value):
                raise refuse(f"holds a non-finite optimizer value {key!r}")


def checkpoint_period(cost_s: float, step_s: float, most: int) -> int:
    """Steps between checkpoints so that one's cost to training (its copy, and its write's CPU where training
    shares the CPUs) is at most `COST_SHARE` of the steps between."""
    if step_s <= 0:
        return most
    return max(1, min(most, math.ceil(cost_s / (COST_SHARE * step_s))))


class CheckpointPacer:
    """When a learner's next checkpoint is due: the period that keeps the copy on the training thread within
    `COST_SHARE` of the median step taken with no write on its way (the caller adds the write's own CPU
    time to the copy where training shares the CPUs: `CheckpointWriter`). It also measures what each
    checkpoint cost in all (`cost_s`): the copy plus the time the steps lost while it was written (their
    time above that median), which the learner reports. The period does not count that slowdown: on a GPU
    it is about nothing, and on CPUs shared with other processes it is mostly their noise (counted, it
    spaced the chaos runs' checkpoints to the 25-step bound; docs/runtime.md); the write's CPU time is
    what the write itself took.
    Fed every step (`step`); the caller agrees the figures with its other ranks, if any, before it uses
    them (`figures`, `due`)."""

    def __init__(self, most_every: int) -> None:
        self.most_every = most_every
        self.period = 1
        self.saved_step: int | None = None
        self.copy_s = 0.0
        self.cost_s = 0.0
        """The latest finished checkpoint's cost (0 until one has finished)."""
        self.cost_total_s = 0.0
        """Every finished checkpoint's cost, summed."""
        self._plain: deque[float] = deque(maxlen=32)
        self._lost_s: float | None = None
        """While a write is on its way: the time its steps lost so far."""

    def step(self, step_s: float, writing: bool) -> None:
        """One inner step took `step_s`; `writing`: this process's write is still on its way at its end."""
        if self._lost_s is None:
            self._plain.append(step_s)
            return
        self._lost_s += step_s - self.plain_step_s()
        if not writing:
            self.cost_s, self._lost_s = self.copy_s + max(0.0, self._lost_s), None
            self.cost_total_s += self.cost_s

    def plain_step_s(self) -> float:
        return statistics.median(self._plain) if self._plain else 0.0

    def may_be_due(self, step: int) -> bool:
        """Worth asking (and agreeing) whether a checkpoint is due at `step`: its period is up, or the first
        one's step time is known."""
        if self.saved_step is None:
            return len(self._plain) >= BASELINE_STEPS
        return step - self.saved_step >= self.period

    def figures(self) -> tuple[float, float]:
        """The latest copy's time and the plain step time (what ranks agree on, by maximum)."""
        return self.copy_s, self.plain_step_s()

    def due(self, step: int, cost_s: float, step_s: float) -> bool:
        """With no write on its way anywhere: the period those (agreed) figures give (`cost_s`: a checkpoint's
        cost to training), and whether `step` is past it."""
        if self.saved_step is not None:
            self.period = checkpoint_period(cost_s, step_s, self.most_every)
        return self.saved_step is None or step - self.saved_step >= self.period

    def saved(self, step: int, copy_s: float) -> None:
        self.saved_step, self.copy_s, self._lost_s = step, copy_s, 0.0


class CheckpointWriter:
    """A learner's checkpoints, written atomically on a background thread: the training thread only
    takes a copy, then trains on while it reaches the disk. `most_every`: the longest period in steps. The
    inner optimizer's state goes to its own file every `OPTIMIZER_EVERY` checkpoints (and with the last)."""

    def __init__(self, path: Path, key: bytes | None = None, most_every: int = 25, counts_write: bool = False) -> None:
        """`counts_write`: training computes on the CPUs the write runs on, so the period counts the write's CPU
        time as well as the copy (a GPU's step loses nothing to it)."""
        self.path, self.key, self.counts_write = path, key, counts_write
        self.pacer = CheckpointPacer(most_every)
        self._thread: threading.Thread | None = None
        self.copy_s = 0.0
        """The latest copy's time on the training thread (without the optimizer's part)."""
        self.copy_total_s = 0.0
        """Every copy's time on the training thread, summed (with the optimizer's)."""
        self.write_s = 0.0
        """The latest write's time on the background thread."""
        self.write_cpu_s = self.write_cpu_total_s = 0.0
        """The latest write's CPU time (serialising, digest, the kernel's copy; this thread's own; without the
        optimizer's file), and every write's, summed: where training runs on the same CPUs, what the writes
        took from it."""
        self.moments_copy_s = self.moments_write_cpu_s = 0.0
        """The latest save of the optimizer's state: its copy's time and its file's write CPU."""
        self.moments_due_in = 0
        """Checkpoints before the next one that saves the optimizer's state (0: this one)."""
        self.written = self.skipped = 0

    def maybe_save(self, step: int, step_s: float, state: Callable[[], dict[str, Any]]) -> bool:
        """At the end of inner step `step` (which took `step_s`): save `state()` if one is due and the
        previous write is done (pushes never make one due: `core/own_progress.py`). True if it saved."""
        self.pacer.step(step_s, self._writing())
        if not self.pacer.may_be_due(step):
            return False
        if self._writing():
            self.skipped += 1
            return False
        if not self.pacer.due(step, self.cost_s(), self.pacer.plain_step_s()):
            return False
        self.save(state)
        self.pacer.saved(step, self.copy_s)
        return True

    def cost_s(self) -> float:
        """What a checkpoint costs training, the optimizer's file spread over the checkpoints it is saved in:
        the copies, and the writes' CPU where training shares the CPUs."""
        own = self.copy_s + (self.write_cpu_s if self.counts_write else 0.0)
        moments = self.moments_copy_s + (self.moments_write_cpu_s if self.counts_write else 0.0)
        return own + moments / OPTIMIZER_EVERY

    def _writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, state: Callable[[], dict[str, Any]], wait: bool = False) -> None:
        """Copy `state()` and write it in the background (`wait`: and wait for it; such a save, the run's last,
        always holds the optimizer's state)."""
        self.wait()  # one write at a time, in order
        began = clock.monotonic()
        taken = state()
        optimizer = taken.get("optimizer")
        copied = packed_copy({k: v for k, v in taken.items() if k != "optimizer"})
        self.copy_s = clock.monotonic() - began
        moments = None
        if optimizer is not None and (wait or self.moments_due_in <= 0):
            began = clock.monotonic()
            moments = packed_copy({"optimizer": optimizer, "steps": taken.get("steps")})
            self.moments_copy_s = clock.monotonic() - began
            self.moments_due_in = OPTIMIZER_EVERY
        self.moments_due_in -= 1
        self.copy_total_s += self.copy_s + (self.moments_copy_s if moments is not None else 0.0)
        self._thread = threading.Thread(target=self._write, args=(copied, moments), name="learner-checkpoint",
                                        daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    def _write(self, state: dict[str, Any], moments: dict[str, Any] | None) -> None:
        """The optimizer's file first: a kill between the two leaves moments newer than the progress, which a
        restart takes as it takes older ones."""
        began = clock.monotonic()
        if moments is not None:
            cpu_began = time.thread_time()
            write_checkpoint(moments, optimizer_file(self.path), self.key)
            self.moments_write_cpu_s = time.thread_time() - cpu_began
            self.write_cpu_total_s += self.moments_write_cpu_s
        cpu_began = time.thread_time()
        write_checkpoint(state, self.path, self.key)
        self.write_s = clock.monotonic() - began
        self.write_cpu_s = time.thread_time() - cpu_began
        self.write_cpu_total_s += self.write_cpu_s
        self.written += 1

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
