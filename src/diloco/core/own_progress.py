"""A learner's own progress across a crash: what its checkpoint keeps, and what a restart resumes.

A crash used to throw away everything a learner had trained since its last push of each fragment. Its
checkpoint now also holds, per fragment, the progress no push has carried yet (anchor − θ − what the
push in flight carries), its tokens and steps, the anchor version and the error-feedback residuals. A
restarted learner takes the syncer's current Θ and, for each fragment whose saved progress is usable,
puts that progress back on top of Θ (θ = Θ − unpushed, the same rebasing as `outer.keep_progress`); its
next push of the fragment carries it with its tokens. The one decision, per fragment, is `usable`. A
sharded learner's ranks each take it on their own rows of that progress (`client/sharded_progress.py`)
and agree (`agreed`): a fragment is resumed only where every rank can resume it.

The check is per fragment: each shard says, per fragment it owns, the newest push of this learner of
that fragment it counted (`JoinReply.fragment_last_seq`; an older shard's last push of any fragment
stands for each). A fragment pushed after the checkpoint (a counted push numbered above the checkpoint's)
takes Θ: that push carried everything the checkpoint saved of it, so resuming it would count it twice,
and only what was trained since that push is lost (at most the steps since the checkpoint). Every other
fragment resumes its own progress, whatever its shard took of the others. Pushes therefore go as soon as
they are made: checkpoints keep the period their cost allows (`client/checkpoints.py`). The push in
flight when the checkpoint was taken is carried again only if its shard never counted it (that
fragment's newest counted push is numbered below it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from diloco.codecs.base import all_finite

if TYPE_CHECKING:
    from diloco.core.learner_core import LearnerCore

ResumePolicy = Literal["own", "theta"]
"""`own`: a restarted learner resumes its own unpushed progress where it can; `theta`: it takes Θ only."""

MAX_AGE_VERSIONS = 8
"""Versions Θ may have moved on past a fragment's saved anchor before that progress is too old to rebase."""


@dataclass(frozen=True)
class Unpushed:
    """One parameter's progress no push has carried yet, anchor − θ (− what the push in flight carries), not
    yet computed: a checkpoint's copy (`client/packed_state.py`) writes it straight into its buffer in one
    pass (`fill_into`), instead of copying a tensor made first."""

    anchor: torch.Tensor
    param: torch.Tensor
    sent: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.anchor.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @torch.no_grad()
    def fill_into(self, out: torch.Tensor) -> None:
        """Write the progress into `out` (float32, this shape; on the CPU whatever the parameter's device)."""
        if out.device != self.anchor.device:
            out.copy_(self.tensor())
            return
        torch.sub(self.anchor, self.param.detach(), out=out)
        if self.sent is not None:
            out.sub_(self.sent)

    @torch.no_grad()
    def tensor(self) -> torch.Tensor:
        """The progress as a tensor of its own, where the parameter is."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.anchor.device)
        self.fill_into(out)
        return out


@torch.no_grad()
def export_progress(core: LearnerCore, deferred: bool = False) -> dict[str, Any]:
    """What a checkpoint keeps to resume this learner's unpushed progress (copies: training goes on).
    `deferred`: the unpushed progress as `Unpushed` values, for a copy that computes them as it is made."""
    if core.finished:  # its last pushes carried everything
        return {"seq": core.seq, "step": core.step, "fragments": []}
    residuals = dict(core.feedback.residuals) if core.feedback else {}
    fragments = []
    for p, fragment in enumerate(core.fragments):
        flight = core.in_flight.get(p)
        unpushed: dict[str, Unpushed | torch.Tensor] = {}
        for name in fragment.names:
            delta = Unpushed(core.anchors[p][name], core.params[name],
                             None if flight is None else flight.sent_deltas[name])
            unpushed[name] = delta if deferred else delta.tensor().cpu()
        sent = None if flight is None else {"seq": flight.push.seq, "tokens": flight.push.tokens,
                                            "steps": flight.push.steps,
                                            "deltas": {n: d.detach().cpu().clone() for n, d in flight.sent_deltas.items()}}
        fragments.append({"version": core.anchor_versions[p], "unpushed": unpushed, "in_flight": sent,
                          "tokens": core.tokens_since[p], "steps": core.steps_since[p],
                          "residuals": {n: residuals[n].detach().cpu().clone() for n in fragment.names
                                        if n in residuals}})
    return {"seq": core.seq, "step": core.step, "fragments": fragments}


def usable(saved: Mapping[str, Any], p: int, version: int, shard_last_seq: int, shapes: Mapping[str, torch.Size],
           policy: ResumePolicy, max_age: int = MAX_AGE_VERSIONS) -> str | None:
    """Why fragment p's saved progress must not be resumed (the learner takes Θ for it), or None.

    `version`: Θ's version of p now; `shard_last_seq`: the newest push of this learner of p that p's shard
    counted."""
    if policy != "own":
        return "the policy takes Θ"
    fragments = saved.get("fragments")
    if not isinstance(fragments, list) or p >= len(fragments) or not isinstance(fragments[p], dict):
        return "the checkpoint holds no progress for it"
    entry = fragments[p]
    if shard_last_seq > saved.get("seq", 0):
        return f"its shard counted its push {shard_last_seq}, sent after the checkpoint (push {saved.get('seq')})"
    if not isinstance(entry.get("version"), int) or not 0 <= entry["version"] <= version:
        return f"its anchor version {entry.get('version')!r} is not one Θ has had (now {version})"
    if version - entry["version"] > max_age:
        return f"Θ moved on {version - entry['version']} versions since (more than {max_age})"
    unpushed = entry.get("unpushed")
    if not isinstance(unpushed, dict) or set(unpushed) != set(shapes) or any(
            not isinstance(t, torch.Tensor) or t.shape != shapes[n] or not all_finite(t)
            for n, t in unpushed.items()):
        return "its saved progress does not fit the model or is not finite"
    if not all(isinstance(entry.get(k), int) and entry[k] >= 0 for k in ("tokens", "steps")):
        return "its saved counters are not counts"
    return None


Decision = tuple[str | None, bool]
"""Per fragment: why its saved progress is not resumed (None: it is), and whether the push in flight at
the checkpoint is resumed with it (`_lost_in_flight`)."""


def agreed(everyone: Sequence[Mapping[int, Decision]]) -> dict[int, Decision]:
    """The decisions of every rank of a sharded learner (each over its own rows) as one: a fragment is
    resumed only where every rank can (else the first rank's reason), its push in flight only where
    every rank has it."""
    first = everyone[0]
    return {p: (next((d[p][0] for d in everyone if d[p][0] is not None), None), all(d[p][1] for d in everyone))
            for p in first}


@torch.no_grad()
def resume_progress(core: LearnerCore, saved: Mapping[str, Any] | None, last_seqs: Mapping[int, int],
                    policy: ResumePolicy, max_age: int = MAX_AGE_VERSIONS,
                    agree: Callable[[dict[int, Decision]], dict[int, Decision]] = dict) -> dict[int, str | None]:
    """Put each usable fragment's saved progress back on top of Θ (the core holds Θ at its versions);
    per fragment, None where it was resumed, else why it takes Θ. `last_seqs`: per fragment, the newest
    push of this learner of that fragment its shard counted. `agree`: makes the decisions every rank's (a sharded learner)."""
    decided: dict[int, Decision] = {}
    for p, fragment in enumerate(core.fragments):
        shapes = {n: core.params[n].shape for n in fragment.names}
        why = "no checkpoint" if saved is None else \
            usable(saved, p, core.anchor_versions[p], last_seqs.get(p, 0), shapes, policy, max_age)
        lost = None if why is not None else \
            _lost_in_flight(saved["fragments"][p].get("in_flight"), last_seqs.get(p, 0), shapes)
        decided[p] = (why, lost is not None)
    decided = agree(decided)
    for p, (why, with_flight) in decided.items():
        if why is not None:
            continue
        entry, names = saved["fragments"][p], core.fragments[p].names
        lost = entry["in_flight"] if with_flight else None
        for name in names:
            param = core.params[name]
            param.sub_(entry["unpushed"][name].to(device=param.device, dtype=param.dtype))
            if lost is not None:
                param.sub_(lost["deltas"][name].to(device=param.device, dtype=param.dtype))
        core.tokens_since[p] += entry["tokens"] + (lost["tokens"] if lost is not None else 0)
        core.steps_since[p] += entry["steps"] + (lost["steps"] if lost is not None else 0)
        if core.feedback is not None:
            for name, residual in entry["residuals"].items():
                if name in names and residual.shape == core.params[name].shape:
                    core.feedback.residuals[name] = residual.to(core.params[name].device)
    return {p: why for p, (why, _) in decided.items()}


def _lost_in_flight(sent: Any, shard_last_seq: int, shapes: Mapping[str, torch.Size]) -> dict[str, Any] | None:
    """The push in flight at the checkpoint, if its shard never counted it (the fragment's newest counted
    push is numbered below it: it was lost with the process): resumed too."""
    if not isinstance(sent, dict) or not isinstance(sent.get("seq"), int) or shard_last_seq >= sent["seq"]:
        return None
    deltas = sent.get("deltas")
    if not isinstance(deltas, dict) or set(deltas) != set(shapes) or any(
            not isinstance(t, torch.Tensor) or t.shape != shapes[n] or not all_finite(t)
            for n, t in deltas.items()):
        return None
    if not all(isinstance(sent.get(k), int) and sent[k] >= 0 for k in ("tokens", "steps")):
        return None
    return sent
