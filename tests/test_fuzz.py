"""Fuzzing a live syncer shard: thousands of random and mutated messages to every RPC that takes input.

In the manner of fault-injection suites: an in-process shard served over real gRPC on loopback, one
correct learner joined (Θ seeded, a few rounds merged), then a seeded stream of messages that a
faulty or hostile client could send. Afterwards the shard must still answer, must have refused every
malformed message with INVALID_ARGUMENT or FAILED_PRECONDITION (UNKNOWN or INTERNAL would be an
unhandled exception in a handler), must hold exactly the state it held before, and the correct
learner must still train, push and merge.

What the fuzzer sends, and what may legitimately change:
- Push: every fuzzed push is built to be refused (a local oracle that mirrors the protocol's rules
  turns any message that could be valid into one based on a future version). Refusals change nothing
  but the shard's `push_errors` counter.
- Init: on the seeded shard a valid one is answered accepted=False; on an unseeded shard only invalid
  ones are sent and it must stay unseeded.
- Pull: by observers, for any id; as a member only for the ids in MEMBERS, which thereby take the
  state and join (that is what a Pull does), and leave (not finished) once fuzzing is over. Their
  ledger, held-state and membership entries are excluded from the comparison.
- A heartbeat carries progress; on a seeded shard the core refuses (INVALID_ARGUMENT) progress of an
  id that never joined and counters out of range.
- Heartbeat, Join, Leave, Updates of arbitrary ids are accepted by design (the protocol has no
  authentication): they change the shard's bookkeeping of those ids (tokens, steps, last seen, hosts,
  joined/left, update streams), which the comparison excludes. They must not change the core: Θ,
  versions, rounds, pending contributions, ledger, alive and finished learners.
- The real learner's id is not impersonated where a message under it legitimately acts for it
  (Leave, Updates, Heartbeat, a member Pull). Join under its id is sent: it must not touch the core.
- Raw bytes that do not parse as the request type are answered by gRPC itself with INTERNAL
  "Exception deserializing request!"; that is the one INTERNAL allowed. (The handler then sees its
  request stream end as if cleanly; what it read before must still be refused.)
- After every message a tripwire looks at the core, so a change is blamed on the last few messages.

The tests after the fuzz tests each pin one defect the fuzzer found, as a minimal reproduction.

DILOCO_FUZZ_SEED and DILOCO_FUZZ_MESSAGES pick the seed and the number of messages; the seed is
printed, so a failure reproduces with `DILOCO_FUZZ_SEED=<seed> pytest tests/test_fuzz.py -s`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import struct
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
import torch

from conftest import tiny_config, wait_for
from diloco.codecs import CODEC_NAMES, DEFAULT_BLOCK, get_codec
from diloco.fragments import embedding_names, partition
from diloco.client.learner_client import Learner
from diloco.shard.server import ShardPlan, SyncerShard, serve
from diloco.transport.calls import ShardClient
from diloco.transport.frames import data_frames, decode, encode_fp32, read_message, tensor_header
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration  # every test fuzzes a live shard over real gRPC

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
                    core.ledger[REAL].last_seq, shard._push_limit(), list(shard.layout))


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


class Fuzzer:
    def __init__(self, rng: random.Random, shard: SyncerShard, address: str, view: View, seeded: bool) -> None:
        self.rng, self.shard, self.view, self.seeded = rng, shard, view, seeded
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                               ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.torch = torch.Generator().manual_seed(rng.randrange(2**31))
        self.codes: Counter[tuple[str, str]] = Counter()
        self.violations: list[str] = []
        self.wrong: dict[tuple[str, str, str], list] = {}
        """Answers with a code the protocol does not allow, by RPC, code and reason: [count, first case]."""
        self.skipped = 0
        self.recent: deque[str] = deque(maxlen=3)
        self.marks = core_marks(shard)
        self.tripped = 0
        self.raw_push = self.channel.stream_unary("/diloco.v1.Syncer/Push", request_serializer=lambda b: b,
                                                  response_deserializer=pb.PushReply.FromString)
        self.raw_init = self.channel.stream_unary("/diloco.v1.Syncer/Init", request_serializer=lambda b: b,
                                                  response_deserializer=pb.InitReply.FromString)
        self.raw_unary = {
            name: (self.channel.unary_unary(f"/diloco.v1.Syncer/{name}", request_serializer=lambda b: b,
                                            response_deserializer=reply.FromString), request)
            for name, request, reply in (("Join", pb.JoinRequest, pb.JoinReply),
                                         ("Heartbeat", pb.HeartbeatRequest, pb.HeartbeatReply),
                                         ("Leave", pb.LeaveRequest, pb.LeaveReply),
                                         ("Status", pb.StatusRequest, pb.StatusReply))}
        self.raw_pull = self.channel.unary_stream("/diloco.v1.Syncer/Pull", request_serializer=lambda b: b,
                                                  response_deserializer=pb.Frame.FromString)

    def close(self) -> None:
        self.channel.close()

    # ------------------------------------------------------------ sending

    def send(self, rpc: str, allowed: set[str], call, what: str, raw: bool = False):
        self.recent.append(f"{rpc} [{what}]")
        try:
            reply, code, details = call(), "OK", ""
        except grpc.RpcError as exc:
            reply, code, details = None, exc.code().name, exc.details() or ""
        if code == "INTERNAL" and raw and details == DESERIALIZE:
            code = "INTERNAL(deserialize)"
        self.codes[(rpc, code)] += 1
        if code not in allowed:
            reason = re.sub(r"\d+", "N", details.split("\n")[0])[:200]
            seen = self.wrong.setdefault((rpc, code, reason), [0, f"{what}: {details[:300]}"])
            seen[0] += 1
        return code, reply

    def problems(self) -> list[str]:
        wrong = [f"{rpc} answered {code} {n} times, first to {first}"
                 for (rpc, code, _), (n, first) in self.wrong.items()]
        return wrong + self.violations

    # ------------------------------------------------------------ random values

    def pick(self, *options):
        return self.rng.choice(options)

    def blob(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def text(self) -> str:
        n = self.pick(0, 1, 3, 8, 40, 300)
        return "".join(self.rng.choice(NAME_CHARS) for _ in range(n))

    def unknown_id(self) -> int:
        return self.rng.choice([m for m in UNKNOWN_IDS if m not in self.view.ledger])

    def shape(self) -> list[int]:
        kind = self.rng.random()
        if kind < 0.1:
            return [1] * 33  # more dimensions than any tensor may have
        dims = (0, 0, 1, 2, 3, 4, 8, 32, 2**31, 2**32, I64, 2**63, U64)  # a zero makes any size "fit"
        return [self.rng.choice(dims) for _ in range(self.rng.randrange(0, 5))]

    def split(self, data: bytes) -> list[pb.Frame]:
        """`data` cut into data frames at random places (empty frames now and then)."""
        if not data:
            return [pb.Frame(data=b"")] if self.rng.random() < 0.1 else []
        cuts = sorted(self.rng.sample(range(1, len(data)), min(len(data) - 1, self.rng.randrange(0, 4))))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        if self.rng.random() < 0.1:
            pieces.insert(self.rng.randrange(len(pieces) + 1), b"")
        return [pb.Frame(data=p) for p in pieces]

    def encoded(self, shapes: dict[str, tuple[int, ...]], codec: str | None = None) -> dict:
        codec = codec or self.rng.choice(CODEC_NAMES)
        block = self.pick(1, 3, DEFAULT_BLOCK, U32) if codec not in ("fp32", "bf16") else DEFAULT_BLOCK
        coder = get_codec(codec, block)
        scale = self.pick(1e-30, 1e-3, 1.0, 1e30)
        return {n: coder.encode(torch.randn(s, generator=self.torch) * scale) for n, s in shapes.items()}

    def push_header(self, p: int, tensors: dict, **fields) -> pb.PushHeader:
        header = pb.PushHeader(learner=REAL, fragment=p, base_version=self.view.versions[p], seq=self.view.last_seq + 1,
                               tokens=8, steps=1, step_time_s=0.01, sent_at=time.time(),
                               tensors=[tensor_header(n, e) for n, e in tensors.items()])
        for key, value in fields.items():
            setattr(header, key, value)
        return header

    def random_tensor_header(self) -> pb.TensorHeader:
        names = [n for shapes in self.view.fragments.values() for n in shapes]
        name = self.rng.choice(names) if self.rng.random() < 0.7 else self.text()
        shapes = {n: s for f in self.view.fragments.values() for n, s in f.items()}
        shape = list(shapes[name]) if name in shapes and self.rng.random() < 0.6 else self.shape()
        codec = self.rng.choice(CODECS)
        block = self.pick(0, 0, 1, 3, DEFAULT_BLOCK, U32)
        header = pb.TensorHeader(name=name, codec=codec, shape=shape, block=block, relative=self.rng.random() < 0.2)
        try:  # the byte counts the encoding takes, mostly; else something else
            coder = get_codec(codec, block or DEFAULT_BLOCK)
            numel = math.prod(shape)
            header.payload_bytes, header.scale_bytes = coder.payload_bytes(numel), coder.scale_bytes(numel, block or 1)
        except Exception:
            pass
        if self.rng.random() < 0.3 or header.payload_bytes > U64 or header.scale_bytes > U64:
            header.payload_bytes = self.pick(0, 1, 4, 31, 32, 4096, 2**32, U64)
            header.scale_bytes = self.pick(0, 0, 4, 8, U64)
        return header

    def plausible_data(self, header) -> bytes:
        """Data for `header`'s tensors: real encodings where the header is consistent, else random bytes."""
        out = b""
        for t in header.tensors:
            size = t.payload_bytes + t.scale_bytes
            if size > 1 << 16:
                return out + self.blob(self.rng.randrange(0, 64))
            try:
                numel = math.prod(t.shape)
                if numel > 4096 or self.rng.random() < 0.3:
                    raise ValueError
                e = get_codec(t.codec, t.block or DEFAULT_BLOCK).encode(torch.randn(numel, generator=self.torch))
                piece = e.payload + e.scales
                if len(piece) != size:
                    raise ValueError
                out += piece
            except Exception:
                out += self.blob(size)
        return out

    # ------------------------------------------------------------ pushes

    def corrupted_push(self) -> tuple[str, list[pb.Frame]]:
        """A push of the real learner, valid but for one corruption of its data or tensor headers."""
        p = self.rng.choice(list(self.view.fragments))
        tensors = self.encoded(self.view.fragments[p])
        header = self.push_header(p, tensors)
        data = bytearray(b"".join(e.payload + e.scales for e in tensors.values()))
        mode = self.pick("truncate", "extend", "trailing", "non-finite", "non-finite", "bitflip", "header-bytes",
                         "header-shape", "header-codec", "header-block")
        if mode == "truncate":
            del data[len(data) - self.rng.randrange(1, len(data) + 1):]
        elif mode == "extend":
            at = self.rng.randrange(len(data) + 1)
            data[at:at] = self.blob(self.rng.randrange(1, 9))
        elif mode == "bitflip":
            for _ in range(self.rng.randrange(1, 9)):
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        elif mode == "non-finite":
            self.poison(tensors, data)
        elif mode.startswith("header-"):
            t = self.rng.choice(header.tensors)
            if mode == "header-bytes":
                field = self.pick("payload_bytes", "scale_bytes")
                setattr(t, field, max(0, getattr(t, field) + self.pick(-4, -1, 1, 4, 2**40)))
            elif mode == "header-shape":
                numel = math.prod(t.shape)
                t.ClearField("shape")
                t.shape.extend(self.pick([numel], [1, numel], [numel, 1], list(reversed(self.view.fragments[p][t.name]))
                                         if len(self.view.fragments[p][t.name]) > 1 else [numel, 1, 1]))
            elif mode == "header-codec":
                t.codec = self.rng.choice([c for c in CODECS if c != t.codec])
            else:
                t.block = self.pick(0, 1, 2, (t.block + 1) % 2**32, U32)
        frames = [pb.Frame(push=header), *self.split(bytes(data))]
        if mode == "trailing":
            frames.append(self.pick(pb.Frame(data=self.blob(self.rng.randrange(0, 9))), pb.Frame(push=header),
                                    pb.Frame(), pb.Frame(state=pb.StateHeader())))
        return f"corrupted:{mode}", frames

    def poison(self, tensors: dict, data: bytearray) -> None:
        """Write a value no encoder produces into one tensor: NaN or Inf, a code no encoder writes, a bad scale."""
        offset = 0
        name = self.rng.choice(list(tensors))
        for n, e in tensors.items():
            if n == name:
                break
            offset += len(e.payload) + len(e.scales)
        e = tensors[name]
        numel = math.prod(e.shape)
        scales_at = offset + len(e.payload)
        bad_float = struct.pack("<f", self.pick(math.nan, math.inf, -math.inf))
        if e.codec == "fp32":
            at = offset + 4 * self.rng.randrange(numel)
            data[at:at + 4] = bad_float
        elif e.codec == "bf16":
            at = offset + 2 * self.rng.randrange(numel)
            data[at:at + 2] = bad_float[2:]
        elif e.codec in ("int8", "int4") and self.rng.random() < 0.5:
            i = self.rng.randrange(numel)
            if e.codec == "int8":
                data[offset + i] = 0x80  # -128: never written
            else:  # -8 in the nibble of element i: never written
                byte = data[offset + i // 2]
                data[offset + i // 2] = (byte & 0xF0) | 0x08 if i % 2 == 0 else (byte & 0x0F) | 0x80
        else:  # block codecs: a non-finite or negative scale
            at = scales_at + 4 * self.rng.randrange(len(e.scales) // 4)
            data[at:at + 4] = self.pick(bad_float, struct.pack("<f", -1.0), struct.pack("<f", -1e-30))

    def flipped_push_of_a_stranger(self) -> tuple[str, list[pb.Frame]]:
        """Random bit flips, truncations and extensions of the data of a push by a learner that never
        joined: the data reaches the decoders, the push is refused anyway."""
        p = self.rng.choice(list(self.view.fragments))
        tensors = self.encoded(self.view.fragments[p])
        header = self.push_header(p, tensors, learner=self.unknown_id())
        data = bytearray(b"".join(e.payload + e.scales for e in tensors.values()))
        for _ in range(self.rng.randrange(1, 17)):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        if self.rng.random() < 0.2:
            del data[len(data) - self.rng.randrange(1, len(data) + 1):]
        elif self.rng.random() < 0.2:
            data += self.blob(self.rng.randrange(1, 9))
        return "stranger:bitflip", [pb.Frame(push=header), *self.split(bytes(data))]

    def random_push(self) -> tuple[str, list[pb.Frame]]:
        """Every header field drawn from values at and beyond its edges."""
        v = self.view
        p_known = self.rng.choice(list(v.fragments))
        header = pb.PushHeader(
            learner=self.pick(REAL, REAL, self.unknown_id()),
            fragment=self.pick(p_known, p_known, 2, 3, U32),
            base_version=self.pick(0, v.versions[p_known], v.versions[p_known] + 1, 2**63, U64),
            seq=self.pick(0, 1, v.last_seq, v.last_seq + 1, 2**63, U64),  # U64: -1 wrapped around
            tokens=self.pick(0, 1, 8, 2**32, U64), steps=self.pick(0, 1, U64),
            step_time_s=self.rng.choice(FLOATS), sent_at=self.pick(*FLOATS, time.time(), time.time() + 1e6))
        if self.rng.random() < 0.5:  # the fragment's own tensors, now and then one dropped or one added
            p = header.fragment if header.fragment in v.fragments else p_known
            tensors = self.encoded(v.fragments[p])
            headers = [tensor_header(n, e) for n, e in tensors.items()]
            if self.rng.random() < 0.5:
                del headers[self.rng.randrange(len(headers))]
            if self.rng.random() < 0.5:
                headers.insert(self.rng.randrange(len(headers) + 1), self.random_tensor_header())
            header.tensors.extend(headers)
            data = b"".join(e.payload + e.scales for n, e in tensors.items() if any(t.name == n for t in headers))
            if self.rng.random() < 0.5:
                data = self.plausible_data(header)
        else:
            header.tensors.extend(self.random_tensor_header() for _ in range(self.rng.randrange(0, 4)))
            data = self.plausible_data(header)
        return "random-header", [pb.Frame(push=header), *self.split(data)]

    def malformed_stream(self) -> tuple[str, list[pb.Frame]]:
        p = self.rng.choice(list(self.view.fragments))
        tensors = self.encoded(self.view.fragments[p])
        header = self.push_header(p, tensors)
        data = b"".join(e.payload + e.scales for e in tensors.values())
        body = self.split(data) or [pb.Frame(data=b"")]
        mode = self.pick("empty", "empty-frame", "data-first", "state-header", "update-header", "two-headers",
                         "duplicate-tensor", "header-only", "two-messages", "no-tensors")
        if mode == "empty":
            frames = []
        elif mode == "empty-frame":
            frames = [pb.Frame(), *body]
        elif mode == "data-first":
            frames = [*body, pb.Frame(push=header)]
        elif mode == "state-header":
            frames = [pb.Frame(state=pb.StateHeader(tensors=header.tensors)), *body]
        elif mode == "update-header":
            frames = [pb.Frame(update=pb.UpdateHeader(fragment=p, version=1, tensors=header.tensors)), *body]
        elif mode == "two-headers":
            frames = [pb.Frame(push=header), pb.Frame(push=header), *body]
        elif mode == "duplicate-tensor":
            t = self.rng.choice(header.tensors)
            header.tensors.add().CopyFrom(t)
            frames = [pb.Frame(push=header), *self.split(data + tensors[t.name].payload + tensors[t.name].scales)]
        elif mode == "header-only":
            frames = [pb.Frame(push=header)]
        elif mode == "two-messages":
            frames = [pb.Frame(push=header), *body, pb.Frame(push=header), *body]
        else:
            header.ClearField("tensors")
            frames = [pb.Frame(push=header)]
        return f"stream:{mode}", frames

    def raw_push_bytes(self) -> tuple[str, list[bytes]]:
        """Serialized frames with random bytes mutated, or random bytes altogether."""
        if self.rng.random() < 0.3:
            return "raw:random", [self.blob(self.rng.randrange(0, 48)) for _ in range(self.rng.randrange(1, 4))]
        p = self.rng.choice(list(self.view.fragments))
        tensors = self.encoded(self.view.fragments[p], "fp32")
        header = self.push_header(p, tensors, learner=self.pick(REAL, self.unknown_id()))
        frames = [f.SerializeToString() for f in
                  [pb.Frame(push=header), *self.split(b"".join(e.payload + e.scales for e in tensors.values()))]]
        for _ in range(self.rng.randrange(1, 5)):
            i = self.rng.randrange(len(frames))
            blob = bytearray(frames[i])
            op = self.pick("flip", "cut", "insert")
            if op == "flip" and blob:
                blob[self.rng.randrange(len(blob))] ^= 1 << self.rng.randrange(8)
            elif op == "cut" and blob:
                at = self.rng.randrange(len(blob))
                del blob[at:at + self.rng.randrange(1, 6)]
            else:
                at = self.rng.randrange(len(blob) + 1)
                blob[at:at] = self.blob(self.rng.randrange(1, 6))
            frames[i] = bytes(blob)
        return "raw:mutated", frames

    def fuzz_push(self) -> None:
        allowed = {"INVALID_ARGUMENT"} if self.seeded else {"FAILED_PRECONDITION"}
        if self.rng.random() < 0.12:
            what, blobs = self.raw_push_bytes()
            try:
                frames = [pb.Frame.FromString(b) for b in blobs]
            except Exception:
                frames = None
            if frames is not None and push_could_be_taken(frames, self.view):
                self.skipped += 1
                return
            self.send("Push", allowed | {"INTERNAL(deserialize)"}, lambda: self.raw_push(iter(blobs), timeout=10),
                      what, raw=True)
            return
        maker = self.rng.choices([self.corrupted_push, self.flipped_push_of_a_stranger, self.random_push,
                                  self.malformed_stream], weights=[4, 2, 4, 2])[0]
        what, frames = maker()
        if push_could_be_taken(frames, self.view):  # make it certainly refused: based on a future version
            header = frames[0].push
            header.base_version = self.view.versions[header.fragment] + self.pick(1, 2, 2**40)
            what += "+future-base"
        self.send("Push", allowed, lambda: self.stub.Push(iter(frames), timeout=10), what)

    # ------------------------------------------------------------ Init

    def init_frames(self) -> tuple[str, list[pb.Frame]]:
        v = self.view
        shapes = {n: s for f in v.fragments.values() for n, s in f.items()}
        values = {n: torch.randn(s, generator=self.torch) for n, s in shapes.items()}
        encoded = encode_fp32(values)
        header = pb.StateHeader(layout=[pb.FragmentLayout.FromString(f.SerializeToString()) for f in v.layout],
                                tensors=[tensor_header(n, e) for n, e in encoded.items()])
        data = bytearray(b"".join(e.payload for e in encoded.values()))
        mode = self.pick("valid", "drop-fragment", "extra-fragment", "fragment-twice", "tensor-twice", "codec",
                         "shape", "missing-value", "extra-value", "non-finite", "truncate", "extend", "random-layout",
                         "header-bytes", "push-header", "empty")
        layout = header.layout
        if mode == "drop-fragment":
            del layout[self.rng.randrange(len(layout))]
        elif mode == "extra-fragment":
            layout.add(index=self.pick(2, 3, U32))
        elif mode == "fragment-twice":
            layout.add().CopyFrom(layout[0])
        elif mode == "tensor-twice":
            layout[-1].tensors.add().CopyFrom(layout[0].tensors[0])
        elif mode == "codec":
            t = self.rng.choice(header.tensors)
            t.codec = self.pick("bf16", "int8", "pickle")
        elif mode == "shape":
            spec = self.rng.choice([t for f in layout for t in f.tensors])
            spec.ClearField("shape")
            spec.shape.extend(self.shape())
        elif mode == "missing-value":
            i = self.rng.randrange(len(header.tensors))
            n = header.tensors[i].name
            del header.tensors[i]
            data = bytearray(b"".join(e.payload for k, e in encoded.items() if k != n))
        elif mode == "extra-value":
            header.tensors.add(name="intruder", codec="fp32", shape=[2], payload_bytes=8)
            data += struct.pack("<ff", 1.0, 2.0)
        elif mode == "non-finite":
            at = 4 * self.rng.randrange(len(data) // 4)
            data[at:at + 4] = struct.pack("<f", self.pick(math.nan, math.inf, -math.inf))
        elif mode == "truncate":
            del data[len(data) - self.rng.randrange(1, len(data) + 1):]
        elif mode == "extend":
            data += self.blob(self.rng.randrange(1, 9))
        elif mode == "random-layout":
            header.ClearField("layout")
            for _ in range(self.rng.randrange(0, 4)):
                f = header.layout.add(index=self.pick(0, 1, 2, U32))
                for _ in range(self.rng.randrange(0, 3)):
                    f.tensors.add(name=self.rng.choice([*shapes, self.text()]), shape=self.shape(),
                                  embedding=self.rng.random() < 0.3)
            header.ClearField("tensors")
            header.tensors.extend(self.random_tensor_header() for _ in range(self.rng.randrange(0, 4)))
            data = bytearray(self.plausible_data(header))
        elif mode == "header-bytes":
            t = self.rng.choice(header.tensors)
            t.payload_bytes = self.pick(0, t.payload_bytes + 4, 2**37, U64)
        if mode == "push-header":
            frames = [pb.Frame(push=pb.PushHeader(tensors=header.tensors)), *self.split(bytes(data))]
        elif mode == "empty":
            frames = self.pick([], [pb.Frame()], self.split(bytes(data)))
        else:
            frames = [pb.Frame(state=header), *self.split(bytes(data))]
        return f"init:{mode}", frames

    def fuzz_init(self) -> None:
        if self.rng.random() < 0.1:
            blobs = [self.blob(self.rng.randrange(0, 40)) for _ in range(self.rng.randrange(1, 3))]
            try:
                frames = [pb.Frame.FromString(b) for b in blobs]
            except Exception:
                frames = None
            if not self.seeded and frames is not None and init_could_be_taken(frames, self.view):
                self.skipped += 1
                return
            allowed = {"OK", "INVALID_ARGUMENT", "INTERNAL(deserialize)"} if self.seeded \
                else {"INVALID_ARGUMENT", "INTERNAL(deserialize)"}
            code, reply = self.send("Init", allowed, lambda: self.raw_init(iter(blobs), timeout=10), "init:raw",
                                    raw=True)
            if code == "OK" and reply.accepted:
                self.violations.append("Init [init:raw] was accepted by a seeded shard")
            return
        what, frames = self.init_frames()
        if not self.seeded and init_could_be_taken(frames, self.view):
            header = frames[0].state  # make it certainly refused: a fragment this shard does not own
            header.layout.add(index=self.pick(2, 7, U32))
            what += "+foreign-fragment"
        allowed = {"OK", "INVALID_ARGUMENT"} if self.seeded else {"INVALID_ARGUMENT"}
        code, reply = self.send("Init", allowed, lambda: self.stub.Init(iter(frames), timeout=10), what)
        if code == "OK" and reply.accepted:
            self.violations.append(f"Init [{what}] was accepted by a seeded shard")

    # ------------------------------------------------------------ the unary RPCs

    def pull_request(self) -> pb.PullRequest:
        member = self.rng.random() < 0.15
        request = pb.PullRequest(learner=self.rng.choice(MEMBERS) if member else self.pick(REAL, *UNKNOWN_IDS),
                                 observer=not member, after_seq=self.pick(0, 1, 2**63, U64))
        if "fragments" in pb.PullRequest.DESCRIPTOR.fields_by_name and self.rng.random() < 0.5:
            request.fragments.extend(self.pick(0, 1, 2, U32) for _ in range(self.rng.randrange(0, 4)))
        return request

    def pull_allowed(self, request: pb.PullRequest) -> bool:
        """No member Pull under an id outside MEMBERS: it would join that learner (or reset the real one)."""
        return request.observer or request.learner in MEMBERS

    def fuzz_pull(self) -> None:
        allowed = {"OK", "INVALID_ARGUMENT"} if self.seeded else {"FAILED_PRECONDITION"}
        raw = self.rng.random() < 0.1
        request = self.pull_request()
        blob = self.mutated(request.SerializeToString()) if raw else None
        if raw:
            try:
                parsed = pb.PullRequest.FromString(blob)
            except Exception:
                parsed = None
            if parsed is not None and not self.pull_allowed(parsed):
                self.skipped += 1
                return
            def call():
                return list(self.raw_pull(blob, timeout=10))
            allowed = allowed | {"INTERNAL(deserialize)"}
        else:
            def call():
                return list(self.stub.Pull(request, timeout=10))
        code, frames = self.send("Pull", allowed, call, f"pull observer={request.observer}", raw=raw)
        if code == "OK":  # what came back is well-formed: the state message, whole
            try:
                message = read_message(iter(frames), "state", 1 << 30)
                assert message is not None
                for e in message[1].values():
                    decode(e)
            except Exception as exc:
                self.violations.append(f"Pull answered a malformed state message: {exc}")

    def mutated(self, blob: bytes) -> bytes:
        if self.rng.random() < 0.3:
            return self.blob(self.rng.randrange(0, 24))
        out = bytearray(blob)
        for _ in range(self.rng.randrange(1, 4)):
            op = self.pick("flip", "cut", "insert")
            if op == "flip" and out:
                out[self.rng.randrange(len(out))] ^= 1 << self.rng.randrange(8)
            elif op == "cut" and out:
                del out[self.rng.randrange(len(out))]
            else:
                at = self.rng.randrange(len(out) + 1)
                out[at:at] = self.blob(self.rng.randrange(1, 4))
        return bytes(out)

    def join_allowed_codes(self, learner: int) -> set[str]:
        return {"OK"} if learner <= U32 else {"INVALID_ARGUMENT", "OUT_OF_RANGE"}

    def fuzz_unary(self, rpc: str) -> None:
        if rpc == "Heartbeat":
            request = pb.HeartbeatRequest(learner=self.pick(*UNKNOWN_IDS, *MEMBERS), tokens=self.pick(0, 1, 2**40, U64),
                                          steps=self.pick(0, 1, U64))
        elif rpc == "Leave":
            request = pb.LeaveRequest(learner=self.pick(*UNKNOWN_IDS))
            if "finished" in pb.LeaveRequest.DESCRIPTOR.fields_by_name:
                request.finished = self.rng.random() < 0.5
        elif rpc == "Join":
            request = pb.JoinRequest(learner=self.pick(REAL, -1, -2, -2**63, 5, U32, 2**32, 2**40, I64),
                                     host=self.text())
        else:
            request = pb.StatusRequest()
        allowed = self.join_allowed_codes(request.learner) if rpc == "Join" else {"OK"}
        if rpc == "Heartbeat" and self.seeded:
            allowed = {"OK", "INVALID_ARGUMENT"}  # progress of a stranger, or counters out of range
        if self.rng.random() < 0.15:
            stub, kind = self.raw_unary[rpc]
            blob = self.mutated(request.SerializeToString())
            try:
                parsed = kind.FromString(blob)
            except Exception:
                parsed = None
            if parsed is not None and rpc in ("Heartbeat", "Leave") and parsed.learner in (REAL, *MEMBERS):
                self.skipped += 1  # the real learner's and the members' membership is not fuzzed
                return
            if parsed is not None and rpc == "Join":
                allowed = self.join_allowed_codes(parsed.learner)
            self.send(rpc, allowed | {"INTERNAL(deserialize)"}, lambda: stub(blob, timeout=10), f"{rpc}:raw", raw=True)
            return
        method = getattr(self.stub, rpc)
        self.send(rpc, allowed, lambda: method(request, timeout=10), f"{rpc}:{str(request)[:120]!r}")

    def fuzz_updates(self) -> None:
        """A short-lived update stream of an id that is not the real learner's (a newer stream of the
        real learner would retire its own, by design). Each holds a server thread ~OUTBOX_POLL_S."""
        request = pb.UpdatesRequest(learner=self.pick(*UNKNOWN_IDS))
        self.send("Updates", {"DEADLINE_EXCEEDED", "CANCELLED", "OK"},
                  lambda: list(self.stub.Updates(request, timeout=self.pick(0.01, 0.05))), "updates")

    def tripwire(self) -> None:
        """After each message, a cheap look at the core: what changed it is among the last messages
        (a handler may still be at work after its client has its answer)."""
        marks = core_marks(self.shard)
        if marks != self.marks:
            self.tripped += 1
            if self.tripped <= 5:
                self.violations.append(f"the core changed ({self.marks} -> {marks}) after one of {list(self.recent)}")
            self.marks = marks

    def run(self, count: int) -> None:
        rpcs = ["Push", "Init", "Pull", "Heartbeat", "Join", "Leave", "Status", "Updates"]
        weights = [60, 9, 9, 6, 6, 5, 4, 1]
        for _ in range(count):
            self.tripwire()
            rpc = self.rng.choices(rpcs, weights)[0]
            if rpc == "Push":
                self.fuzz_push()
            elif rpc == "Init":
                self.fuzz_init()
            elif rpc == "Pull":
                self.fuzz_pull()
            elif rpc == "Updates":
                self.fuzz_updates()
            else:
                self.fuzz_unary(rpc)

    def histogram(self) -> str:
        return "\n".join(f"  {rpc:<10} {code:<22} {n}" for (rpc, code), n in sorted(self.codes.items()))


def leave_members(address: str) -> None:
    client = ShardClient(address)
    for m in MEMBERS:
        client.leave(m)  # interrupted, not finished: they took the state and go
    client.close()


# ---------------------------------------------------------------- the fuzz tests


def still_trains(shard: SyncerShard, learner: Learner, seed: int) -> list[str]:
    """The learner trains, pushes and merges; the shard counts each of its pushes once."""
    merges, seq = learner.merges, learner.core.seq
    with shard.lock:
        entry = shard.core.ledger.get(learner.id)
        pushes, duplicates = (entry.pushes, entry.duplicates) if entry else (0, 0)
    for attempt in range(8):  # answers are merged τ steps after their push, once they have arrived
        train(learner, 4, seed + attempt)
        try:
            settle(shard, learner, timeout_s=5)
        except AssertionError as exc:
            entry = shard.core.ledger.get(learner.id)
            return [f"{exc}: the shard counted {entry.pushes if entry else 0} pushes, last seq "
                    f"{entry.last_seq if entry else 0}, {entry.duplicates if entry else 0} duplicates"]
        if learner.merges > merges and attempt >= 2:
            break
    entry = shard.core.ledger[learner.id]
    problems = []
    if learner.merges <= merges:
        problems.append(f"the learner merged nothing ({learner.merges} merges, as before)")
    if entry.pushes != pushes + learner.core.seq - seq or entry.duplicates != duplicates:
        problems.append(f"the ledger counts {entry.pushes} pushes ({pushes} before, {learner.core.seq - seq} sent "
                        f"since), {entry.duplicates} duplicates ({duplicates} before)")
    return problems


def status_problems(address: str, seeded: bool, versions: dict | None = None) -> list[str]:
    client = ShardClient(address)
    try:
        status = client.status()
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is the finding
        return [f"the shard no longer answers Status: {exc}"]
    finally:
        client.close()
    got = {v.fragment: v.version for v in status.versions}
    if status.initialised != seeded or (versions is not None and got != versions):
        return [f"Status after fuzzing: initialised {status.initialised}, versions {got}"]
    return []


def test_fuzzed_messages_to_a_seeded_shard_are_refused_and_change_nothing():
    seed, count = SEED, MESSAGES
    print(f"\nfuzz seed {seed}, {count} messages (DILOCO_FUZZ_SEED={seed} reproduces)")
    started = time.monotonic()
    problems: list[str] = []
    with live_shard("learners.count=1") as (shard, address), learner_of(address) as learner:
        train(learner, 8, seed)
        settle(shard, learner)
        before = core_state(shard)
        fuzzer = Fuzzer(random.Random(seed), shard, address, view_of_shard(shard), seeded=True)
        try:
            fuzzer.run(count)
        finally:
            fuzzer.close()
        leave_members(address)
        print(f"{count} messages in {time.monotonic() - started:.1f} s "
              f"({fuzzer.skipped} left unsent: they could have been valid)")
        print(fuzzer.histogram())
        problems += fuzzer.problems()
        if not shard.waker.is_alive():
            problems.append("the shard's timer thread died")
        problems += status_problems(address, True, {p: f["version"] for p, f in before["fragments"].items()})
        problems += [f"state changed: {d}" for d in differences(before, core_state(shard))][:20]
        problems += still_trains(shard, learner, seed + 1)
    print(f"whole test {time.monotonic() - started:.1f} s")
    assert not problems, f"fuzz seed {seed}:\n" + "\n".join(problems)


def test_fuzzed_messages_leave_an_unseeded_shard_unseeded():
    seed, count = SEED + 1, max(200, MESSAGES // 4)
    print(f"\nfuzz seed {seed}, {count} messages to an unseeded shard")
    problems: list[str] = []
    with live_shard("learners.count=1") as (shard, address):
        fuzzer = Fuzzer(random.Random(seed), shard, address, view_of_model(tiny_model()), seeded=False)
        try:
            fuzzer.run(count)
        finally:
            fuzzer.close()
        print(fuzzer.histogram())
        problems += fuzzer.problems()
        if shard.core is not None or shard.layout:
            problems.append("a fuzzed Init seeded the shard")
        problems += status_problems(address, False)
        if shard.core is None:  # a correct learner seeds it and trains
            with learner_of(address) as learner:
                problems += still_trains(shard, learner, seed)
    assert not problems, f"fuzz seed {seed}:\n" + "\n".join(problems)


def test_the_same_valid_push_replayed_100_times_is_counted_once():
    with live_shard("learners.count=1") as (shard, address):
        learner = Learner(tiny_model(), syncer=address, learner=REAL)
        fragment = learner.fragments[0]
        encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in fragment.names})
        header = pb.PushHeader(learner=REAL, fragment=fragment.index, base_version=0, seq=learner.core.seq + 1,
                               tokens=16, steps=1, step_time_s=0.01, sent_at=time.time(),
                               tensors=[tensor_header(n, encoded[n]) for n in fragment.names])
        clients = [ShardClient(address) for _ in range(4)]
        first = clients[0].push(header, encoded)
        theta = {n: t.clone() for n, t in shard.core.theta.items()}
        with ThreadPoolExecutor(8) as pool:  # replays, some at once
            replies = list(pool.map(lambda i: clients[i % 4].push(header, encoded), range(99)))
        assert not first.duplicate and all(r.duplicate for r in replies)
        entry = shard.core.ledger[REAL]
        assert (entry.pushes, entry.duplicates, entry.last_seq) == (1, 99, header.seq)
        assert shard.core.rounds_closed == 1 and shard.core.version(fragment.index) == 1
        assert all(torch.equal(shard.core.theta[n], theta[n]) for n in theta)
        for client in clients:
            client.close()
        learner.close()


# ---------------------------------------------------------------- what fuzzing found, one by one


@contextmanager
def syncer_stub(address: str):
    channel = grpc.insecure_channel(address)
    try:
        yield pb_grpc.SyncerStub(channel)
    finally:
        channel.close()


def rpc_code(call) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def test_a_join_asking_for_an_id_beyond_32_bits_is_refused_and_joins_nobody():
    """JoinRequest.learner is int64 and JoinReply.learner uint32: an id in between cannot be answered."""
    with live_shard("learners.count=1") as (shard, address), syncer_stub(address) as stub:
        code = rpc_code(lambda: stub.Join(pb.JoinRequest(learner=2**32, host="h"), timeout=10))
        assert code in ("INVALID_ARGUMENT", "OUT_OF_RANGE")
        assert 2**32 not in shard.joined and 2**32 not in shard.hosts


@pytest.mark.parametrize("codec, block, shape", [("fp32", 0, [0, 2**63]), ("int8", 1, [0, 2**63]),
                                                 ("bf16", 0, [0, U64]), ("fp32", 0, [2**63, 0])])
def test_a_push_whose_shape_overflows_is_refused_as_invalid(codec, block, shape):
    """An empty tensor (a zero dimension) whose other dimensions do not fit torch's int64 sizes."""
    with live_shard("learners.count=1") as (_, address), learner_of(address) as learner, \
            syncer_stub(address) as stub:
        name = learner.fragments[0].names[0]
        header = pb.PushHeader(learner=REAL, fragment=0, base_version=0, seq=learner.core.seq + 1, tokens=1, steps=1,
                               tensors=[pb.TensorHeader(name=name, codec=codec, block=block, shape=shape)])
        assert rpc_code(lambda: stub.Push(iter([pb.Frame(push=header)]), timeout=10)) == "INVALID_ARGUMENT"


def test_an_init_whose_shape_overflows_is_refused_as_invalid():
    with live_shard("learners.count=1") as (shard, address), syncer_stub(address) as stub:
        spec = pb.TensorSpec(name="w", shape=[0, 2**63])
        state = pb.StateHeader(layout=[pb.FragmentLayout(index=0, tensors=[spec]), pb.FragmentLayout(index=1)],
                               tensors=[pb.TensorHeader(name="w", codec="fp32", shape=[0, 2**63])])
        assert rpc_code(lambda: stub.Init(iter([pb.Frame(state=state)]), timeout=10)) == "INVALID_ARGUMENT"
        assert shard.core is None


def test_heartbeats_whose_tokens_add_up_beyond_64_bits_leave_heartbeat_and_status_working():
    """tokens_reported is uint64: the sum over learners must not make every later reply fail."""
    with live_shard("learners.count=1") as (_, address), syncer_stub(address) as stub:
        codes = [rpc_code(lambda m=m: stub.Heartbeat(pb.HeartbeatRequest(learner=m, tokens=U64), timeout=10))
                 for m in (7, 8)]
        assert codes == ["OK", "OK"]
        assert rpc_code(lambda: stub.Status(pb.StatusRequest(), timeout=10)) == "OK"


def test_a_leave_from_a_learner_that_never_joined_changes_no_membership():
    """Leave of an id the shard never saw (claiming it finished its share) must not add a learner that
    every later round's participation share counts as absent."""
    with live_shard("learners.count=1") as (shard, address), learner_of(address), syncer_stub(address) as stub:
        before = core_state(shard)
        request = pb.LeaveRequest(learner=12345)
        if "finished" in pb.LeaveRequest.DESCRIPTOR.fields_by_name:
            request.finished = True
        stub.Leave(request, timeout=10)
        assert differences(before, core_state(shard)) == []


@pytest.mark.parametrize("field, value", [("step_time_s", math.inf), ("step_time_s", 1e300),
                                          ("step_time_s", math.nan), ("sent_at", -math.inf),
                                          ("sent_at", -1e300), ("sent_at", math.nan), ("sent_at", math.inf)])
def test_a_push_with_absurd_timings_leaves_grace_windows_bounded(field, value):
    """A push whose step time or send time is not finite (or absurd) is refused, or taken without
    letting it into the estimates that size grace windows: a later round still closes on time and the
    timer thread lives. Learner 1 is configured but absent, so rounds close by their grace window."""
    with live_shard("learners.count=2") as (shard, address), learner_of(address) as learner, \
            syncer_stub(address) as stub:
        seq = learner.core.seq

        def push(p: int, **fields) -> str:
            nonlocal seq
            seq += 1
            names = learner.fragments[p].names
            encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in names})
            header = pb.PushHeader(learner=REAL, fragment=p, base_version=shard.core.version(p), seq=seq, tokens=16,
                                   steps=1, step_time_s=0.01, sent_at=time.time(),
                                   tensors=[tensor_header(n, encoded[n]) for n in names])
            for key, v in fields.items():
                setattr(header, key, v)
            frames = [pb.Frame(push=header), *data_frames(encoded.values())]
            return rpc_code(lambda: stub.Push(iter(frames), timeout=10))

        assert push(0, **{field: value}) in ("OK", "INVALID_ARGUMENT")

        def stalled() -> str:
            return (f"the round to close: step time {shard.core.step_time}, one-way {shard.core.one_way_s}, "
                    f"timer alive {shard.waker.is_alive()}")

        # Refused, or taken and merged once its grace window (if sane) is over: the timer is free for fragment 1.
        wait_for(lambda: not shard.core.fragments[0].pending, 5, stalled, poll_s=0.02)
        assert push(1) == "OK"  # a sound push: its round closes within its grace window (≤ 2 step times)
        wait_for(lambda: shard.core.version(1) == 1, 5, stalled, poll_s=0.02)
        assert shard.waker.is_alive()


def test_a_grace_window_that_ends_after_another_still_closes_its_round():
    """Two fragments' rounds wait out grace windows at once; the one that ends later must be timed too
    (the shard keeps one deadline: once the earlier fires, the later one must be armed again)."""
    with live_shard("learners.count=2") as (shard, address), learner_of(address) as learner, \
            syncer_stub(address) as stub:
        for i, (p, step_time) in enumerate([(0, 0.01), (1, 0.5)]):  # grace ≈ 0.02 s, then ≈ 0.3 s
            names = learner.fragments[p].names
            encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in names})
            header = pb.PushHeader(learner=REAL, fragment=p, base_version=0, seq=learner.core.seq + 1 + i, tokens=16,
                                   steps=1, step_time_s=step_time, sent_at=time.time(),
                                   tensors=[tensor_header(n, encoded[n]) for n in names])
            stub.Push(iter([pb.Frame(push=header), *data_frames(encoded.values())]), timeout=10)

        def open_rounds() -> str:
            with shard.lock:
                return "both rounds to close; open: " + str(
                    {p: (s.deadline, list(s.pending)) for p, s in shard.core.fragments.items() if s.pending})

        wait_for(lambda: (shard.core.version(0), shard.core.version(1)) == (1, 1), 3, open_rounds, poll_s=0.02)


def test_a_push_whose_stream_breaks_after_the_message_is_not_taken(monkeypatch):
    """A valid push followed by a message that does not parse: gRPC answers INTERNAL and ends the
    handler's request iterator as if the stream had ended cleanly. The client is told the push failed,
    so the shard must not have taken it."""
    handled = threading.Event()
    push = SyncerShard.Push

    def push_then_tell(self, request_iterator, context):
        try:
            return push(self, request_iterator, context)
        finally:
            handled.set()

    monkeypatch.setattr(SyncerShard, "Push", push_then_tell)  # before serving: gRPC takes the handler then
    with live_shard("learners.count=1") as (shard, address), learner_of(address) as learner:
        channel = grpc.insecure_channel(address)
        raw_push = channel.stream_unary("/diloco.v1.Syncer/Push", request_serializer=lambda b: b,
                                        response_deserializer=pb.PushReply.FromString)
        names = learner.fragments[0].names
        encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in names})
        header = pb.PushHeader(learner=REAL, fragment=0, base_version=0, seq=learner.core.seq + 1, tokens=16, steps=1,
                               tensors=[tensor_header(n, encoded[n]) for n in names])
        blobs = [pb.Frame(push=header).SerializeToString(),
                 *(f.SerializeToString() for f in data_frames(encoded.values())), b"\xff\xff"]
        try:
            code = rpc_code(lambda: raw_push(iter(blobs), timeout=10))
            assert handled.wait(10)  # the handler may still be at work after the client has its answer
            entry = shard.core.ledger[REAL]
            assert code == "INTERNAL"
            assert (entry.pushes, entry.last_seq, shard.core.version(0)) == (0, 0, 0)
        finally:
            channel.close()
