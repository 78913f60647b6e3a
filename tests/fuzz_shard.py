"""The live shard that tests/test_fuzz*.py fuzz, and what they compare: its deep state before and after,
and a local oracle of which messages it could take."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from contextlib import contextmanager

import torch

from conftest import tiny_config, wait_for
from diloco.codecs import CODEC_NAMES
from diloco.fragments import embedding_names, partition
from diloco.client.learner_client import Learner
from diloco.shard.server import ShardPlan, SyncerShard, serve
from diloco.transport.frames import decode, read_message
from diloco.v1 import diloco_pb2 as pb

SEED = int(os.environ.get("DILOCO_FUZZ_SEED", "1729"))
MESSAGES = int(os.environ.get("DILOCO_FUZZ_MESSAGES", "3000"))
REAL = 0
MEMBERS = (100, 101, 102)
"""Ids that take the state with a member Pull while fuzzing (they join), and leave afterwards."""
U32, U64, I64 = 2**32 - 1, 2**64 - 1, 2**63 - 1
DESERIALIZE = "Exception deserializing request!"
INIT_LIMIT = 1 << 38
FLOATS = (0.0, -0.0, 1e-3, 0.25, -1.0, 5e-324, 1e300, sys.float_info.max, math.inf, -math.inf, math.nan)
CODECS = (*CODEC_NAMES, "", "pickle", "FP32", "fp8", "fp32\x00")
NAME_CHARS = "abcxyz.0123456789_ θΘ€😀\u00e9\u0000\u202e"
UNKNOWN_IDS = (1, 2, 7, 99, 1000, 2**31, U32)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


@contextmanager
def live_shard(*overrides: str):
    config = tiny_config("outer.fragments=2", "outer.H=4", *overrides)
    shard = SyncerShard(config, ShardPlan(0, 1, ("",)))
    server, port = serve(shard, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    shard.plan = ShardPlan(0, 1, (address,))
    try:
        yield shard, address
    finally:
        shard.stop()
        server.stop(0)


def train(learner: Learner, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(learner.model.parameters(), lr=0.05)
    for _ in range(steps):
        learner.model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        learner.step(tokens=8)


def settle(shard: SyncerShard, learner: Learner, timeout_s: float = 15.0) -> None:
    """Until the shard has counted (and, with one learner, merged) every push the learner sent, and its
    last progress report has landed."""
    def counted() -> bool:
        with shard.lock:
            core = shard.core
            entry = core.ledger.get(learner.id)
            pace = core.pacer.paces.get(learner.id) if core.pacer else None
            reported = core.tokens.get(learner.id) == learner.core.tokens and \
                (core.pacer is None or (pace is not None and pace.step == learner.core.step))
            return entry is not None and entry.last_seq == learner.core.seq and reported and \
                not any(s.pending for s in core.fragments.values())

    wait_for(counted, timeout_s, f"the shard to count the learner's {learner.core.seq} pushes", poll_s=0.02)


@contextmanager
def learner_of(address: str):
    learner = Learner(tiny_model(), syncer=address, learner=REAL)
    try:
        yield learner
    finally:
        learner.close()


# ---------------------------------------------------------------- deep snapshots


def frozen(x):
    """A deep copy made of plain containers, tensors cloned."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"<" + type(x).__name__: None, **{f.name: frozen(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, dict):
        return {k: frozen(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = [frozen(v) for v in x]
        return sorted(items) if isinstance(x, (set, frozenset)) else items
    return x


def differences(a, b, path: str = "") -> list[str]:
    """Where two frozen values differ; tensors bit for bit, NaN equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        return [] if same else [f"{path}: tensor differs"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}[{k!r}]: only {'before' if k in a else 'after'}" for k in set(a) ^ set(b)]
        for k in set(a) & set(b):
            out += differences(a[k], b[k], f"{path}[{k!r}]")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items before, {len(b)} after"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} before, {b!r} after"]


def optimizer_state(optimizer) -> dict:
    return {k: v for k, v in vars(optimizer).items()
            if isinstance(v, (bool, int, float, str, torch.Tensor, dict, list, tuple, type(None)))}


def core_state(shard: SyncerShard, skip: tuple[int, ...] = MEMBERS) -> dict:
    """What refused messages must leave as it was: Θ, versions, open rounds, outer-optimizer state, the
    rounds merged, the ledger and held state of every learner (but `skip`), membership, estimates."""
    with shard.lock:
        core = shard.core
        if core is None:
            return {"seeded": False, "layout": [f.SerializeToString(deterministic=True) for f in shard.layout]}
        return frozen({
            "seeded": True,
            "theta": core.theta,
            "fragments": {p: {"version": s.version, "pending": sorted(s.pending), "first_arrival": s.first_arrival,
                              "quorum_at": s.quorum_at, "deadline": s.deadline, "target": s.target,
                              "optimizer": optimizer_state(s.optimizer)} for p, s in core.fragments.items()},
            "rounds": core.rounds,
            "ledger": {m: vars(e) for m, e in core.ledger.items() if m not in skip},
            "sums": {p: s.sums.plain() for p, s in core.fragments.items()},
            "held_versions": {m: v for m, v in core.held_versions.items() if m not in skip},
            "session_start": {m: v for m, v in core.session_start.items() if m not in skip},
            "alive": core.alive,
            "finished": getattr(core, "finished", set()),
            "step_time": core.step_time,
            "one_way_s": core.one_way_s,
            "last_weight": core.last_weight,
            "tokens": {m: v for m, v in core.tokens.items() if m not in skip},
            "tokens_banked": {m: v for m, v in core.tokens_banked.items() if m not in skip},
            "paces": {m: vars(p) for m, p in core.pacer.paces.items() if m not in skip} if core.pacer else {},
            "layout": [f.SerializeToString(deterministic=True) for f in shard.layout],
            "shard_finished": shard.finished,
        })


def core_marks(shard: SyncerShard):
    """A few numbers that any change the fuzzer must not cause would move."""
    with shard.lock:
        core = shard.core
        if core is None:
            return "unseeded"
        entry = core.ledger.get(REAL)
        return {"real": (entry.pushes, entry.duplicates, entry.last_seq) if entry else None,
                "versions": [s.version for s in core.fragments.values()], "rounds": core.rounds_closed,
                "pending": [sorted(s.pending) for s in core.fragments.values()],
                "alive": sorted(core.alive - set(MEMBERS)), "finished": sorted(getattr(core, "finished", ()))}


# ---------------------------------------------------------------- the fuzzer


@dataclasses.dataclass
class View:
    """What the fuzzer knows of the shard it targets; fixed while only refused pushes arrive."""

    fragments: dict[int, dict[str, tuple[int, ...]]]
    versions: dict[int, int]
    ledger: set[int]
    last_seq: int
    limit: int
    layout: list[pb.FragmentLayout]


def view_of_model(model: torch.nn.Module, fragments: int = 2) -> View:
    params = dict(model.named_parameters())
    parts = partition(model, fragments, embedding_names(model))
    layout = [pb.FragmentLayout(index=f.index, tensors=[pb.TensorSpec(name=n, shape=list(params[n].shape),
                                                                      embedding=f.embedding) for n in f.names])
              for f in parts]
    return View({f.index: {n: tuple(params[n].shape) for n in f.names} for f in parts},
                {f.index: 0 for f in parts}, {REAL}, 0, 4 * max(f.numel for f in parts) + (1 << 16), layout)


def view_of_shard(shard: SyncerShard) -> View:
    with shard.lock:
        core = shard.core
        return View({p: {n: tuple(core.theta[n].shape) for n in s.fragment.names} for p, s in core.fragments.items()},
                    {p: s.version for p, s in core.fragments.items()}, set(core.ledger) | set(MEMBERS),
                    core.ledger[REAL].last_seq, shard.push_limit(), list(shard.layout))


def push_could_be_taken(frames: list[pb.Frame], view: View) -> bool:
    """Whether the protocol allows a shard in `view`'s state to take this push (or count it as a
    duplicate): then the fuzzer must not send it as it is. False only where the rules refuse it."""
    try:
        stream = iter(frames)
        message = read_message(stream, "push", view.limit)
        if message is None or next(stream, None) is not None:
            return False
        header, tensors = message
        names = view.fragments.get(header.fragment)
        if header.learner not in view.ledger or names is None or header.base_version > view.versions[header.fragment]:
            return False
        if set(tensors) != set(names):
            return False
        return all(tuple(decode(e).shape) == names[n] for n, e in tensors.items())
    except Exception:  # refused by framing or decoding (or a crash, which the shard would share)
        return False


def init_could_be_taken(frames: list[pb.Frame], view: View) -> bool:
    """Whether this Init could seed an unseeded shard that owns `view`'s fragments. False only where the
    rules refuse it."""
    try:
        message = read_message(iter(frames), "state", INIT_LIMIT)
        if message is None:
            return False
        header, tensors = message
        if sorted(f.index for f in header.layout) != sorted(view.fragments):
            return False
        names = [t.name for f in header.layout for t in f.tensors]
        if len(names) != len(set(names)) or set(names) != set(tensors):
            return False
        for f in header.layout:
            for t in f.tensors:
                got = tensors[t.name]
                if got.codec != "fp32" or list(got.shape) != list(t.shape):
                    return False
        for e in tensors.values():
            decode(e)
        return True
    except Exception:  # refused by framing or decoding (or a crash, which the shard would share)
        return False
