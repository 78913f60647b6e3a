"""The fuzzer: Init and the unary RPCs on top of the pushes, a tripwire after every message, and the run."""

from __future__ import annotations

import math
import struct

import torch

from diloco.transport.calls import ShardClient
from diloco.transport.frames import decode, encode_fp32, read_message, tensor_header
from diloco.v1 import diloco_pb2 as pb

from fuzz_pushes import FuzzPushes
from fuzz_shard import I64, MEMBERS, REAL, U32, U64, UNKNOWN_IDS, core_marks, init_could_be_taken


class Fuzzer(FuzzPushes):
    """A seeded stream of messages to every RPC that takes input."""

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
