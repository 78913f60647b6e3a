"""All or nothing for the syncer core: a call that ends in RoundRefused (a round whose result would not
be finite) leaves the core exactly as it was before the call, the event that triggered it included.

The core never changes a tensor in place (a round computes new ones and swaps them in; a push replaces
its round's sums), so a snapshot copies everything but tensors, encoded differences, optimizers and
fragments, and the rounds list is cut back to its length.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING, Callable

from diloco.core.rounds import RoundRefused

if TYPE_CHECKING:
    from diloco.core.syncer_core import SyncerCore


def atomic(method: Callable) -> Callable:
    """Run `method` as one transaction; nested calls share the outermost one's snapshot."""

    @functools.wraps(method)
    def run(core: SyncerCore, *args, **kwargs):
        if core._in_transaction:
            return method(core, *args, **kwargs)
        saved = snapshot(core)
        core._in_transaction = True
        try:
            return method(core, *args, **kwargs)
        except RoundRefused:
            restore(core, saved)
            raise
        finally:
            core._in_transaction = False
    return run


def snapshot(core: SyncerCore) -> dict:
    keep = [core.rounds, *core.theta.values(), core.down_codec, core.defer]
    for s in core.fragments.values():
        keep += [s.optimizer, s.fragment, s.sampler, *s.sums.tensors(), *s.downlink.tensors(),
                 *(c.sample for c in s.pending.values()),
                 *(s.unjudged or {}).values(), *(s.correction or {}).values()]
    saved = copy.deepcopy(core.__dict__, {id(o): o for o in keep})
    saved["_rounds_closed"] = len(core.rounds)
    return saved


def restore(core: SyncerCore, saved: dict) -> None:
    closed = saved.pop("_rounds_closed")
    core.__dict__.update(saved)
    del core.rounds[closed:]
