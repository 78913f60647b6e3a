"""The ranks of one sharded diloco learner (Gloo, CPU), for tests/test_learner_fsdp.py.

Started once per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (by the test, or torchrun).
Modes:
- `exact`: no syncer; the same parameters, anchors and answers through a sharded core (FSDP2 or HSDP)
  and through an unsharded one: rank 0 writes whether the gathered pushes and the merged parameters
  are equal bit for bit.
- `train`: the project's tiny GPT under --sharding joins --syncer and trains --steps steps; each rank
  writes its report (rank-R.json), rank 0 the whole final parameters (params.pt). With --die-at-step,
  rank --die-rank exits abruptly at that step (a rank killed mid-sync).
- `checkpoint`: DCP save, then a fresh model and optimizer resume from it (resume-R.json); with --damage
  a flipped byte in rank 1's file is refused by every rank (refused-R.json).
- `reshard`: --phase save writes a DCP checkpoint at this world size (and the whole state, whole.pt);
  --phase load, at another world size, checks that the loaded state is exactly that (reshard-W.json).
- `build`: every rank builds --model as the built-in learner does (`sharded_build.build_sharded`: on the
  meta device, each rank filling its own rows); rank 0 writes whether the gathered model equals the
  whole one built on the CPU bit for bit, and whether it was built whole instead (build.json).
- `refuse`: a model the learner cannot sync (--bad tp | mixed | disagree): every rank prints its
  one-line refusal (REFUSED: ...), leaves the process group with the others and exits with 3.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from diloco.client.builtin_loop import finish_distributed
from diloco.client.learner_client import Learner
from diloco.client.param_shards import shard_model
from diloco.client.rank_sync import ShardedRanks
from diloco.config import load_config
from diloco.core.learner_core import LearnerCore
from diloco.core.learner_events import Advance, SendPush, StepDone, UpdateArrived
from diloco.core.messages import Update
from diloco.errors import DilocoError
from diloco.fragments import Schedule, partition
from diloco.models.factory import build_model

VOCAB = 64
FRAGMENTS = 3


def tiny_gpt(width: int = 32, layers: int = 2) -> torch.nn.Module:
    config = load_config(None, [f"model.layers={layers}", f"model.width={width}", "model.heads=2",
                                "train.seq_len=16"])
    return build_model(config, VOCAB)  # seeded: every rank builds the same weights


def core_over(params: dict[str, torch.Tensor], fragments, learner: int = 0) -> LearnerCore:
    return LearnerCore(learner, params, fragments, Schedule(1, len(fragments)), tau=0, alpha=0.25,
                       wait_for_updates=False, encode_later=True, keep_progress=True)


def exact(args: argparse.Namespace, out: Path) -> None:
    """The sync path of a sharded learner against an unsharded one, from the same state."""
    device = torch.device(args.device, dist.get_rank()) if args.device == "cuda" else torch.device("cpu")
    reference = tiny_gpt().to(device)
    sharded = shard_model(tiny_gpt().to(device), args.sharding, dist.get_world_size(), device.type)
    fragments = partition(reference, FRAGMENTS)
    names = [n for n, _ in reference.named_parameters()]
    generator = torch.Generator().manual_seed(7)
    trained = {n: p.detach() + 0.01 * torch.randn(p.shape, generator=generator).to(device)
               for n, p in reference.named_parameters()}
    answers = {n: p.detach() - 0.02 * torch.randn(p.shape, generator=generator).to(device)
               for n, p in reference.named_parameters()}

    plain_params = dict(reference.named_parameters())
    plain = core_over(plain_params, fragments)
    params = dict(sharded.named_parameters())
    ranks = ShardedRanks(params, dist.get_rank(), dist.get_world_size())
    ranks.core, ranks.fragments = core_over(ranks.local(), fragments), fragments
    with torch.no_grad():  # "training": the same new values, each rank its own rows
        for n in names:
            plain_params[n].copy_(trained[n])
            rows = params[n].to_local().shape[0]
            start = ranks_start(params[n])
            params[n].to_local().copy_(trained[n][start:start + rows])
    ours = run_events(ranks, [StepDone(100, 0.1)])
    theirs = [a.push for a in plain.handle(StepDone(100, 0.1), 1.0) if isinstance(a, SendPush)]
    updates = [Update(p.fragment, 1, {n: answers[n] for n in fragments[p.fragment].names}, ack_seq=p.seq)
               for p in theirs]
    run_events(ranks, [UpdateArrived(u) for u in updates] + [Advance()])
    for u in updates:
        plain.handle(UpdateArrived(u), 1.0)
    plain.handle(Advance(), 1.0)
    whole = {n: p.full_tensor() for n, p in params.items()}
    if dist.get_rank() == 0:
        pushes_equal = len(ours) == len(theirs) and all(
            a.fragment == b.fragment and a.seq == b.seq and a.tokens == b.tokens and list(a.deltas) == list(b.deltas)
            and all(torch.equal(a.deltas[n], b.deltas[n]) for n in a.deltas) for a, b in zip(ours, theirs))
        merged_equal = all(torch.equal(whole[n], plain_params[n].detach()) for n in names)
        anchors_whole = sum(t.numel() for a in ranks.core.anchors for t in a.values())
        (out / "exact.json").write_text(json.dumps({
            "pushes": len(ours), "pushes_equal": pushes_equal, "merged_equal": merged_equal,
            "moved": any(not torch.equal(whole[n], trained[n]) for n in names),
            "anchor_elements_rank0": anchors_whole, "model_elements": sum(t.numel() for t in trained.values())}))


def ranks_start(param) -> int:
    from diloco.client.param_shards import rows_per_shard
    mesh = param.device_mesh
    return mesh.get_coordinate()[-1] * rows_per_shard(param.shape[0], mesh.size(mesh.ndim - 1))


def run_events(ranks: ShardedRanks, events: list) -> list:
    """Rank 0 feeds `events` to every rank's core; returns the whole pushes (rank 0)."""
    ranks.open_step()
    pushes = []
    if ranks.leader:
        for event in events:
            pushes += [a.push for a in ranks.feed(event, 1.0) if isinstance(a, SendPush)]
        ranks.close_step(False)
    else:
        ranks.follow()
    return pushes


def hf_causal_lm() -> torch.nn.Module:
    """A tiny randomly initialised GPT-2 (tied embeddings), whose forward the loop adapts to (inputs, targets)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def masked_gpt() -> torch.nn.Module:
    """A model whose build cannot be replayed (a buffer computed from another tensor): built whole."""
    model = tiny_gpt()
    model.register_buffer("mask", torch.tril(torch.ones(4, 4)))
    return model


def build(args: argparse.Namespace, out: Path) -> None:
    from diloco.client.sharded_build import build_sharded
    builder = {"gpt": tiny_gpt, "hf": hf_causal_lm, "masked": masked_gpt}[args.model]
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("diloco.learner").addHandler(handler)
    model = build_sharded(builder, args.sharding, dist.get_world_size())
    held = {n: type(t).__name__ for n, t in model.named_parameters()}
    values = {n: _whole(t) for n, t in model.state_dict().items()}  # full_tensor: a collective, every rank
    if dist.get_rank() == 0:
        reference = builder().state_dict()
        (out / "build.json").write_text(json.dumps({
            "equal": values.keys() == reference.keys() and all(torch.equal(values[n], reference[n]) for n in values),
            "built_whole": [m for m in said if "whole" in m], "held": sorted(set(held.values()))}))


def loss_of(model: torch.nn.Module, x: torch.Tensor, hf: bool) -> torch.Tensor:
    if hf:
        return model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
    return model(x[:, :-1], x[:, 1:])


def train(args: argparse.Namespace, out: Path) -> None:
    rank = dist.get_rank()
    hf = args.model == "hf"
    model = shard_model(hf_causal_lm() if hf else tiny_gpt(), args.sharding, dist.get_world_size())
    learner = Learner(model, syncer=args.syncer, connect_timeout_s=30)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1000 + rank)
    done = 0
    while not learner.should_stop and done < args.steps:
        x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=generator)
        loss_of(model, x, hf).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if done == args.die_at_step and rank == args.die_rank:
            os._exit(9)  # killed mid-run: no goodbye to anyone
        learner.step(tokens=args.batch * args.seq)
        done += 1
    report = learner.close()
    report["local_steps"] = done
    report["largest_fragment_bytes"] = max(sum(learner.params[n].numel() for n in f.names) * 4
                                           for f in learner.fragments)
    module = getattr(model, "module", model)  # under DDP
    whole = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in module.named_parameters()}
    if rank == 0:
        torch.save(whole, out / "params.pt")
    (out / f"rank-{rank}.json").write_text(json.dumps(report))


def checkpoint(args: argparse.Namespace, out: Path) -> None:
    """Train, save (DCP), train on; a fresh model and optimizer loaded from the save train the same steps:
    both end equal bit for bit. With --damage, a byte of rank 1's file is flipped before loading."""
    from diloco.client.sharded_checkpoints import load_sharded, save_sharded
    rank, world = dist.get_rank(), dist.get_world_size()

    def fresh():
        model = shard_model(tiny_gpt(), args.sharding, world)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    def train_steps(model, optimizer, first: int, count: int) -> None:
        for step in range(first, first + count):
            x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(step * 10 + rank))
            model(x[:, :-1], x[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    model, optimizer = fresh()
    train_steps(model, optimizer, 0, 3)
    folder = out / "ckpt"
    save_sharded(folder, model, optimizer, steps=3, data={"learner": 0, "epoch": 0, "index": 3 + rank})
    train_steps(model, optimizer, 3, 2)
    if args.damage and rank == 1:
        victim = sorted((folder / "a").glob("__1_*.distcp"))[0]  # the first checkpoint's slot
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))
    dist.barrier()
    again, again_opt = fresh()
    before = {n: p.full_tensor() for n, p in again.named_parameters()}
    try:
        side = load_sharded(folder, again, again_opt, max_steps=100)
    except DilocoError as exc:
        unchanged = all(torch.equal(before[n], p.full_tensor()) for n, p in again.named_parameters())
        print(f"REFUSED: {exc}", flush=True)
        (out / f"refused-{rank}.json").write_text(json.dumps({"unchanged": unchanged}))
        return
    train_steps(again, again_opt, 3, 2)
    equal = all(torch.equal(p.full_tensor(), q.full_tensor())
                for p, q in zip(model.parameters(), again.parameters()))
    state_a, state_b = optimizer.state_dict()["state"], again_opt.state_dict()["state"]
    optimizer_equal = all(torch.equal(_whole(state_a[i][k]), _whole(state_b[i][k])) for i in state_a for k in state_a[i])
    (out / f"resume-{rank}.json").write_text(json.dumps({"steps": side["steps"], "data": side["data"],
                                                         "model_equal": equal, "optimizer_equal": optimizer_equal}))


def reshard(args: argparse.Namespace, out: Path) -> None:
    """--phase save: train 3 steps, save (DCP), and rank 0 writes the whole parameters and optimizer state;
    --phase load (any world size): a fresh model and optimizer loaded from the save hold exactly those,
    resharded to this world; the data position is dropped (another world wrote it), the steps kept."""
    from diloco.client.sharded_checkpoints import load_sharded, save_sharded
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_model(tiny_gpt(), args.sharding, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    folder = out / "ckpt"
    if args.phase == "save":
        for step in range(3):
            x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(step))
            model(x[:, :-1], x[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        save_sharded(folder, model, optimizer, steps=3, data={"learner": 0, "epoch": 0, "index": 3})
    else:
        side = load_sharded(folder, model, optimizer, max_steps=100)
    whole = {"params": {n: _whole(p).detach() for n, p in model.named_parameters()},
             "optimizer": {i: {k: _whole(v) for k, v in st.items()} for i, st in optimizer.state_dict()["state"].items()}}
    if rank != 0:
        return
    if args.phase == "save":
        torch.save(whole, out / "whole.pt")
        return
    saved = torch.load(out / "whole.pt", weights_only=True)
    model_equal = all(torch.equal(saved["params"][n], t) for n, t in whole["params"].items())
    optimizer_equal = saved["optimizer"].keys() == whole["optimizer"].keys() and all(
        torch.equal(saved["optimizer"][i][k], v) for i, st in whole["optimizer"].items() for k, v in st.items())
    (out / f"reshard-{world}.json").write_text(json.dumps({
        "steps": side["steps"], "data": side["data"], "written_by": side["world"], "model_equal": model_equal,
        "optimizer_equal": optimizer_equal}))


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def refuse(args: argparse.Namespace) -> int:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.bad == "disagree":
        model = shard_model(tiny_gpt(layers=2 if rank == 0 else 1), "fsdp", world)
    elif args.bad == "mixed":
        model = tiny_gpt()
        shard_model(model.blocks[0], "fsdp", world)  # the blocks only: the rest stays plain
    else:  # tensor-parallel: a column split (Shard(1))
        model = tiny_gpt()
        mesh = init_device_mesh("cpu", (world,))
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                placement = Shard(1) if p.dim() == 2 else Shard(0)
                module.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement])))
    try:
        Learner(model, syncer=args.syncer, connect_timeout_s=5)
    except DilocoError as exc:
        print(f"REFUSED: {exc}", flush=True)
        return 3
    print("ACCEPTED", flush=True)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["exact", "train", "refuse", "checkpoint", "reshard", "build"])
    parser.add_argument("--phase", choices=["save", "load"], default="save")
    parser.add_argument("--damage", action="store_true")
    parser.add_argument("--model", choices=["gpt", "hf", "masked"], default="gpt")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sharding", default="fsdp")
    parser.add_argument("--syncer", default="127.0.0.1:1")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--die-at-step", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--bad", default="tp")
    parser.add_argument("--timeout-s", type=float, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    args.out.mkdir(parents=True, exist_ok=True)
    code = 0
    try:
        if args.mode == "exact":
            exact(args, args.out)
        elif args.mode == "train":
            train(args, args.out)
        elif args.mode == "checkpoint":
            checkpoint(args, args.out)
        elif args.mode == "reshard":
            reshard(args, args.out)
        elif args.mode == "build":
            build(args, args.out)
        else:
            code = refuse(args)
    except DilocoError as exc:
        print(f"diloco: {exc}", flush=True)
        leave(1, failed=True)  # a peer may be dead: leave without waiting for it
    leave(code)  # every rank leaves the group together, a refusal too


def leave(code: int, failed: bool = False) -> NoReturn:
    """Leave the process group, then exit without the interpreter's teardown: a rank's DTensors and mesh
    still hold gloo's groups then, and their destruction at exit aborted a rank that had done everything
    right ("terminate called without an active exception", exit -6) now and then (seen in CI and under load)."""
    finish_distributed(failed)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
