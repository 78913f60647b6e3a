"""One diloco learner made of the ranks of a torchrun job (Gloo, CPU), for tests/test_learner_torchrun.py.

Each rank trains the project's tiny GPT, wrapped in DistributedDataParallel, on its own random data
(seeded by rank), calls `learner.step(tokens)` after every optimizer step, closes the learner, and
writes its final parameters (rank-R.pt) and its report (rank-R.json) to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from diloco.config import load_config
from diloco.models.factory import build_model
from diloco.client.learner_client import Learner

VOCAB = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--syncer", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = load_config(None, ["model.layers=1", "model.width=32", "model.heads=2", f"train.seq_len={args.seq}"])
    model = build_model(config, VOCAB)  # seeded: every rank builds the same weights
    ddp = nn.parallel.DistributedDataParallel(model)
    learner = Learner(ddp, syncer=args.syncer, connect_timeout_s=30)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1000 + rank)
    done = 0
    while not learner.should_stop and done < args.steps:
        x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=generator)
        loss = ddp(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        learner.step(tokens=args.batch * args.seq)
        done += 1
    report = learner.close()
    report["local_steps"] = done
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({n: p.detach().clone() for n, p in model.state_dict().items()}, args.out / f"rank-{rank}.pt")
    (args.out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
