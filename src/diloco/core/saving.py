"""The syncer core's state as tensors and plain data, and back: what a restarted syncer continues from."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from diloco.core.rounds import LedgerEntry, ProtocolError, RoundRecord

if TYPE_CHECKING:
    from diloco.core.syncer_core import SyncerCore


def saved_state(core: SyncerCore) -> dict:
    return {
        "theta": {n: t.clone() for n, t in core.theta.items()},
        "fragments": {p: s.plain() for p, s in core.fragments.items()},
        "alive": sorted(core.alive), "finished": sorted(core.finished), "last_weight": dict(core.last_weight),
        "ledger": {m: e.plain() for m, e in core.ledger.items()},
        "held_versions": {m: dict(v) for m, v in core.held_versions.items()},
        "session_start": dict(core.session_start), "step_time": dict(core.step_time),
        "one_way_s": core.one_way_s,
        "rounds": [dataclasses.astuple(r) for r in core.rounds],
        "tokens": dict(core.tokens), "tokens_banked": dict(core.tokens_banked), "stopped": core.stopped,
        "pacer": core.pacer.state_dict() if core.pacer else {},
        "liveness": core.liveness.state_dict(), "lost": sorted(core.lost), "over": core.over,
        "norms": core.norms.state_dict(), **core.claims.state_dict(),
    }


def load_saved_state(core: SyncerCore, state: dict) -> None:
    if set(state["fragments"]) != set(core.fragments) or set(state["theta"]) != set(core.theta):
        raise ProtocolError("the saved state holds other fragments or tensors than this syncer")
    if "held" in state:
        raise ProtocolError("the saved state keeps a copy of Θ per learner, as earlier versions did: "
                            "resume it with the version that saved it")
    core.theta = {n: t.clone().to(torch.float32) for n, t in state["theta"].items()}
    for p, saved in state["fragments"].items():
        core.fragments[p].load(saved)
    core.alive, core.finished = set(state["alive"]), set(state["finished"])
    core.last_weight = dict(state["last_weight"])
    core.ledger = {m: LedgerEntry.of(e) for m, e in state["ledger"].items()}
    core.held_versions = {m: dict(v) for m, v in state["held_versions"].items()}
    core.session_start, core.step_time = dict(state["session_start"]), dict(state["step_time"])
    core.one_way_s = state["one_way_s"]
    core.rounds = [RoundRecord(*r) for r in state["rounds"]]
    core.tokens, core.tokens_banked = dict(state["tokens"]), dict(state["tokens_banked"])
    core.stopped = state["stopped"]
    if core.pacer is not None:
        core.pacer.load_state_dict(state["pacer"])
    core.liveness.load_state_dict(state["liveness"])
    core.lost, core.over = set(state["lost"]), state["over"]
    if "norms" in state:  # saved before the outlier history was kept per learner: it starts afresh
        core.norms.load_state_dict(state["norms"])
    core.claims.load_state_dict(state)
    core._wake_at = None
