"""The fuzzer's pushes: corrupted, poisoned, a stranger's, random, malformed streams and raw bytes, each
built to be refused."""

from __future__ import annotations

import math
import struct
import time

from diloco.transport.frames import tensor_header
from diloco.v1 import diloco_pb2 as pb

from fuzz_messages import FuzzMessages
from fuzz_shard import CODECS, FLOATS, REAL, U32, U64, push_could_be_taken


class FuzzPushes(FuzzMessages):
    """Push streams that the shard must refuse."""

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
