"""The ranks of one sharded learner (Gloo, CPU) checkpointing and resuming its own unpushed progress, for
tests/test_sharded_resume.py. Started once per rank, as tests/workers/sharded_learner.py is.

- `--phase save`: an unsharded core and a sharded one (FSDP2 or HSDP) train through the same steps to the
  same state, two fragments' pushes in flight; the sharded one is checkpointed (DCP, its own progress
  included), the unsharded one's `export_progress` saved whole (plain.pt, rank 0).
- `--phase load` (any world size): both restart on the same newer Θ and resume through `resume_progress`
  (the `theta` policy first, which must leave Θ untouched, then `own`); rank 0 writes whether the sharded
  parameters, counters and first pushes equal the unsharded ones (progress-W.json). With --damage (a
  flipped byte in a DCP file, or in `latest`), every rank refuses in one line (REFUSED: ...) and writes
  whether its parameters, optimizer and core are unchanged (refused-R.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import _init_optim_state

from sharded_learner import FRAGMENTS, leave, ranks_start, run_events, tiny_gpt
from diloco.client.param_shards import shard_model
from diloco.client.rank_sync import ShardedRanks
from diloco.client.sharded_checkpoints import read_sharded, save_sharded
from diloco.client.sharded_progress import agree_over_ranks
from diloco.core.learner_core import LearnerCore
from diloco.core.learner_events import SendPush, StepDone
from diloco.core.own_progress import export_progress, resume_progress
from diloco.errors import DilocoError
from diloco.fragments import Schedule, partition

THETA_VERSION = 2
"""Θ's version of every fragment at the restart: it moved on since the checkpoint (anchors at 0)."""


def core_over(params: dict[str, torch.Tensor], fragments, versions: int = 0) -> LearnerCore:
    """One fragment due per step (H = 3), answers far away (τ = 8): pushes stay in flight."""
    return LearnerCore(0, params, fragments, Schedule(3, len(fragments)), tau=8, alpha=0.25, wait_for_updates=False,
                       encode_later=True, keep_progress=True, versions=[versions] * len(fragments))


def values(seed: int, reference: torch.nn.Module, scale: float = 0.01) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=generator) for n, p in reference.named_parameters()}


@torch.no_grad()
def put(params: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> None:
    """`whole` into the parameters: each rank its rows of a sharded model."""
    for n, p in params.items():
        if hasattr(p, "to_local"):
            rows = p.to_local().shape[0]
            p.to_local().copy_(whole[n][ranks_start(p):ranks_start(p) + rows])
        else:
            p.copy_(whole[n])


def pushes_of(ranks_or_core, tokens: int) -> list:
    """One step's pushes, whole (the sharded ones gathered at rank 0)."""
    if isinstance(ranks_or_core, ShardedRanks):
        return run_events(ranks_or_core, [StepDone(tokens, 0.1)])
    return [a.push for a in ranks_or_core.handle(StepDone(tokens, 0.1), 1.0) if isinstance(a, SendPush)]


def sharded_learner(sharding: str):
    model = shard_model(tiny_gpt(), sharding, dist.get_world_size())
    params = dict(model.named_parameters())
    ranks = ShardedRanks(params, dist.get_rank(), dist.get_world_size())
    return model, params, ranks


def save(args: argparse.Namespace, out: Path) -> None:
    reference = tiny_gpt()
    fragments = partition(reference, FRAGMENTS)
    plain_params = dict(reference.named_parameters())
    plain = core_over(plain_params, fragments)
    model, params, ranks = sharded_learner(args.sharding)
    ranks.core, ranks.fragments = core_over(ranks.local(), fragments), fragments
    for step in range(1, 3):  # steps 1 and 2 push fragments 1 and 2 (in flight); fragment 0 is unpushed
        trained = values(step, reference)
        put(plain_params, trained)
        put(params, trained)
        pushes_of(plain, 100)
        pushes_of(ranks, 100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _init_optim_state(optimizer)  # a learner's optimizer has stepped before its first checkpoint
    save_sharded(out / "ckpt", model, optimizer, steps=2, data={"learner": 0, "epoch": 0, "index": 2},
                 progress=export_progress(ranks.core))
    if dist.get_rank() == 0:
        torch.save(export_progress(plain), out / "plain.pt")


def load(args: argparse.Namespace, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = tiny_gpt()
    fragments = partition(reference, FRAGMENTS)
    theta = values(99, reference, scale=0.1)
    model, params, ranks = sharded_learner(args.sharding)
    put(params, theta)
    ranks.core, ranks.fragments = core_over(ranks.local(), fragments, THETA_VERSION), fragments
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    folder = out / "ckpt"
    if args.damage and rank == 0:
        victim = folder / "latest" if args.damage == "latest" else sorted((folder / "a").glob("__1_*.distcp"))[0]
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))
    dist.barrier()
    before = {n: p.full_tensor() for n, p in params.items()}
    try:
        saved = read_sharded(folder, model, optimizer, max_steps=100)
    except DilocoError as exc:
        unchanged = all(torch.equal(before[n], p.full_tensor()) for n, p in params.items()) and \
            not optimizer.state and ranks.core.tokens_since == [0] * FRAGMENTS
        print(f"REFUSED: {exc}", flush=True)
        (out / f"refused-{rank}.json").write_text(json.dumps({"unchanged": unchanged}))
        return
    plain_saved = torch.load(out / "plain.pt", weights_only=True)
    in_flight = [f["in_flight"] for f in plain_saved["fragments"]]
    # Fragment 1's shard took its push in flight (it is not carried again); fragment 2's never did (it is).
    last_seqs = {1: in_flight[1]["seq"], 2: in_flight[2]["seq"] - 1}
    took_theta = resume_progress(ranks.core, saved["sync"], last_seqs, "theta", agree=agree_over_ranks)
    theta_kept = all(torch.equal(p.full_tensor(), theta[n]) for n, p in params.items())
    ours = resume_progress(ranks.core, saved["sync"], last_seqs, "own", agree=agree_over_ranks)
    whole = {n: p.full_tensor() for n, p in params.items()}
    our_tokens = list(ranks.core.tokens_since)
    our_pushes = pushes_of(ranks, 50)
    if rank != 0:
        return
    plain_params = dict(reference.named_parameters())
    put(plain_params, theta)
    plain = core_over(plain_params, fragments, THETA_VERSION)
    theirs = resume_progress(plain, plain_saved, last_seqs, "own")
    equal = all(torch.equal(whole[n], plain_params[n].detach()) for n in whole)
    their_tokens = list(plain.tokens_since)
    their_pushes = pushes_of(plain, 50)
    pushes_equal = len(our_pushes) == len(their_pushes) > 0 and all(
        a.fragment == b.fragment and a.tokens == b.tokens and a.steps == b.steps
        and all(torch.equal(a.deltas[n], b.deltas[n]) for n in a.deltas) for a, b in zip(our_pushes, their_pushes))
    unpushed_on_theta = all(torch.equal(whole[n], rebased(theta, plain_saved, n, resumed_in_flight=(2,)))
                            for n in whole)
    (out / f"progress-{world}.json").write_text(json.dumps({
        "theta_policy": [why for why in took_theta.values()], "theta_kept": theta_kept,
        "outcome": [ours[p] for p in range(FRAGMENTS)], "same_outcome": ours == theirs, "params_equal": equal,
        "unpushed_on_theta": unpushed_on_theta, "tokens_since": our_tokens,
        "plain_tokens_since": their_tokens, "pushes_equal": pushes_equal}))


def rebased(theta: dict[str, torch.Tensor], saved: dict, name: str, resumed_in_flight: tuple[int, ...]) -> torch.Tensor:
    """Θ − unpushed (− the lost push in flight), in `resume_progress`'s order."""
    value = theta[name].clone()
    for p, entry in enumerate(saved["fragments"]):
        if name in entry["unpushed"]:
            value -= entry["unpushed"][name]
            if p in resumed_in_flight:
                value -= entry["in_flight"]["deltas"][name]
    return value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    parser.add_argument("--sharding", default="fsdp")
    parser.add_argument("--damage", choices=["", "distcp", "latest"], default="")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        (save if args.phase == "save" else load)(args, args.out)
    except DilocoError as exc:
        print(f"diloco: {exc}", flush=True)
        leave(1, failed=True)  # a peer may be dead: leave without waiting for it
    leave(0)


if __name__ == "__main__":
    main()
