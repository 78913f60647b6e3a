"""The fuzzer's base: its channel to the shard, how it sends and judges each answer, and its random values."""

from __future__ import annotations

import math
import random
import re
import time
from collections import Counter, deque

import grpc
import torch

from diloco.codecs import CODEC_NAMES, DEFAULT_BLOCK, get_codec
from diloco.shard.server import SyncerShard
from diloco.transport.frames import tensor_header
from diloco.transport.stream_calls import syncer_stub
from diloco.v1 import diloco_pb2 as pb

from fuzz_shard import CODECS, DESERIALIZE, I64, NAME_CHARS, REAL, U32, U64, UNKNOWN_IDS, View, core_marks


class FuzzMessages:
    """Sends messages to one shard and records every answer whose code the protocol does not allow."""

    def __init__(self, rng: random.Random, shard: SyncerShard, address: str, view: View, seeded: bool) -> None:
        self.rng, self.shard, self.view, self.seeded = rng, shard, view, seeded
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                               ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = syncer_stub(self.channel)
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
