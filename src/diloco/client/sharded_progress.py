"""A sharded learner's own progress in its checkpoint: what `core/own_progress.export_progress` keeps,
split so that no rank ever holds the whole model.

Every rank's core runs over its own rows (`rank_sync.ShardedRanks`), so its anchors, its unpushed
difference and the deltas of its push in flight are rows too, laid out like the parameters. They go into
the DCP checkpoint as DTensors with the parameters' mesh and placements (`as_rows`): DCP stores their
global shapes and offsets, so another world size loads them resharded, each rank its new rows, exactly
as it does the model. What is the same on every rank (the push counter, per fragment the anchor version,
tokens and steps since, the push in flight's number and counts, which parameters the fragment holds)
goes into each rank's sealed sidecar as `counters`. Error-feedback residuals are never there: a sharded
learner cannot sync with error feedback (`rank_sync.sharded_settings_problem`).

A restart resumes through the one decision, `own_progress.usable`, taken by every rank on its rows and
agreed (`agree_over_ranks`): a fragment is resumed only where every rank can resume it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from diloco.client.row_moves import collective_error
from diloco.core.own_progress import Decision, agreed

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - an older torch has no sharded learners
    DTensor = None  # type: ignore[assignment,misc]


def as_rows(local: torch.Tensor, param: Any) -> Any:
    """This rank's rows `local` as a DTensor placed like `param` (global shape and offsets for DCP)."""
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def split_progress(exported: Mapping[str, Any], params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`export_progress`'s dict as (DCP tensors, sidecar counters)."""
    tensors: dict[str, Any] = {}
    counters: dict[str, Any] = {"seq": exported["seq"], "step": exported["step"], "fragments": []}
    for p, entry in enumerate(exported["fragments"]):
        flight = entry["in_flight"]
        tensors[str(p)] = {"unpushed": {n: as_rows(t, params[n]) for n, t in entry["unpushed"].items()},
                           **({"in_flight": {n: as_rows(t, params[n]) for n, t in flight["deltas"].items()}}
                              if flight is not None else {})}
        counters["fragments"].append({
            "version": entry["version"], "tokens": entry["tokens"], "steps": entry["steps"],
            "names": list(entry["unpushed"]),
            "in_flight": None if flight is None else {k: flight[k] for k in ("seq", "tokens", "steps")}})
    return tensors, counters


def progress_target(counters: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP loads the saved rows into: zeros laid out like this learner's parameters now (its world
    size: the rows come back resharded). A fragment naming a parameter this model lacks gets none
    (`usable` then says its progress does not fit)."""
    target: dict[str, Any] = {}
    for p, entry in enumerate(_fragments(counters)):
        names = entry.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) and n in params for n in names):
            continue

        def rows() -> dict[str, Any]:
            return {n: as_rows(torch.zeros_like(params[n].to_local(), dtype=torch.float32), params[n]) for n in names}

        target[str(p)] = {"unpushed": rows(), **({"in_flight": rows()} if entry.get("in_flight") else {})}
    return target


def joined_progress(counters: Any, loaded: Mapping[str, Any]) -> dict[str, Any] | None:
    """The saved progress as `export_progress` gave it, each tensor this rank's rows; None: none saved."""
    if not isinstance(counters, dict):
        return None
    fragments = []
    for p, entry in enumerate(_fragments(counters)):
        rows = loaded.get(str(p), {})
        flight = entry.get("in_flight")
        fragments.append({
            "version": entry.get("version"), "tokens": entry.get("tokens"), "steps": entry.get("steps"),
            "unpushed": {n: t.to_local() for n, t in rows.get("unpushed", {}).items()}, "residuals": {},
            "in_flight": None if not isinstance(flight, dict) or "in_flight" not in rows else
            {**flight, "deltas": {n: t.to_local() for n, t in rows["in_flight"].items()}}})
    return {"seq": counters.get("seq", 0), "step": counters.get("step", 0), "fragments": fragments}


def agree_over_ranks(decided: dict[int, Decision]) -> dict[int, Decision]:
    """Every rank's decisions, agreed (`own_progress.agreed`): the ranks resume the same fragments."""
    everyone: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, decided)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise collective_error(exc) from exc
    return agreed(everyone)


def _fragments(counters: Any) -> list[dict[str, Any]]:
    fragments = counters.get("fragments") if isinstance(counters, dict) else None
    return [f if isinstance(f, dict) else {} for f in fragments] if isinstance(fragments, list) else []
