"""scale.py's constants and its synthetic model: tensors in fragments, fragments on shards, the encoded
pushes every learner maps, and the frames that seed Θ."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any


RSS_RATIO_TARGET = 1.2
"""Syncer RSS with 16 learners over RSS with 1 learner: at most this."""
SOCKET_RATIO_TARGET = 0.5
"""Push MB/s of one shard over a plain socket on loopback: at least this."""
CPU_ROOFLINE_TARGET = 4.0
"""Shard CPU-seconds per pushed parameter (8 learners) over the roofline (one fused in-place pass over a
fragment's fp32 tensor, measured in the same invocation): at most this."""
JOIN_RATIO_TARGET = 2.0
"""A join's pull of Θ (every shard, fp32) over a plain socket's time for the same bytes: at most this."""
SCALING_TARGET = 3.0
"""A shard's push (and pull) MB/s with 8 learners over 1 learner: at least this."""

THETA_RANGE = 0.05
"""Θ is seeded uniform in ±THETA_RANGE."""
DELTA_STD = 1e-3
"""Outer gradients are N(0, DELTA_STD²): ‖Δ‖/‖Θ‖ ≈ 0.035, far under the hard outlier bound (10x)."""
STEPS_PER_PUSH = 4
"""Inner steps each push claims. Constant, so every push of a fragment has the same size per √step (the
outlier history's reference) and each claim rises less than the 64 steps of slack the claims allow."""
STEP_TIME_S = 0.01
HEARTBEAT_S = 1.0
MB = 1e6
GIB = 1 << 30
BASE_RSS_BYTES = 256 << 20
"""A shard's RSS before Θ: the interpreter, torch, gRPC (240 MiB measured)."""
LEARNER_RSS_BYTES = 250 << 20
"""A synthetic learner's RSS (it imports torch through the client; most of it shared libraries)."""
DEFAULT_BYTES_PER_PARAM = (28.0, 1.0)
"""(a, b): a shard's peak RSS ≈ BASE + P_shard x (a + b x learners) bytes, before any run of this
invocation measured better. Measured here (int4 both ways, 4 fragments, 2026-12-03): 24.5 bytes per
parameter with one learner at 100M parameters, 26.8 with sixteen. The Init holds several copies of Θ at
once; the shard keeps Θ, the outer optimizer's two buffers and the published copy (a lossy downlink),
plus about one fragment per answer or push in flight. b is kept above what was measured, to plan by."""
DRAIN_S = 30.0
"""After its last push was taken, how long a learner waits for the answers to its pushes of the window."""
PUSH_BOUND_S = 900.0
"""How long a learner waits for its push in flight when the window closes (behind 15 others' merges)."""
STARTUP_S = 120.0
"""Bound on the shards' and learners' start (imports, joins, mapping the payload)."""
PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------- the synthetic model


@dataclass(frozen=True)
class TensorMeta:
    name: str
    numel: int


def model_layout(params: int, fragments: int, max_tensor: int) -> list[list[TensorMeta]]:
    """`params` elements in `fragments` fragments of (nearly) equal size, each cut into tensors of at most
    `max_tensor` elements."""
    layout = []
    for p in range(fragments):
        numel = params // fragments + (1 if p < params % fragments else 0)
        pieces = max(1, math.ceil(numel / max_tensor))
        sizes = [numel // pieces + (1 if k < numel % pieces else 0) for k in range(pieces)]
        layout.append([TensorMeta(f"f{p}.t{k}", n) for k, n in enumerate(sizes)])
    return layout


def shard_fragments(fragments: int, shards: int) -> list[list[int]]:
    """Fragment p belongs to shard p mod N (shard/ownership.py)."""
    from diloco.shard.ownership import ShardPlan

    return [ShardPlan(i, shards, ()).fragments(fragments) for i in range(shards)]


def write_payloads(folder: Path, layout: list[list[TensorMeta]], codec_name: str, block: int) -> dict[str, Any]:
    """One file per fragment: each tensor's encoded payload then scales, in order (exactly the data a push
    streams), and their headers. Encoded once, one tensor at a time."""
    import torch

    from diloco.codecs import get_codec

    folder.mkdir(parents=True, exist_ok=True)
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    codec = get_codec(codec_name, block)
    meta: dict[str, Any] = {"codec": codec_name, "fragments": {}}
    for p, tensors in enumerate(layout):
        gen = torch.Generator().manual_seed(1000 + p)
        path = folder / f"fragment-{p}.bin"
        entries = []
        with open(path, "wb") as out:
            for t in tensors:
                encoded = codec.encode(torch.randn(t.numel, generator=gen).mul_(DELTA_STD))
                out.write(encoded.payload)
                out.write(encoded.scales)
                entries.append({"name": t.name, "codec": encoded.codec, "shape": list(encoded.shape),
                                "block": encoded.block, "payload_bytes": len(encoded.payload),
                                "scale_bytes": len(encoded.scales)})
                del encoded
        meta["fragments"][str(p)] = {"file": str(path), "tensors": entries,
                                     "bytes": sum(e["payload_bytes"] + e["scale_bytes"] for e in entries)}
    meta_path.write_text(json.dumps(meta))
    return meta


def init_frames(layout: list[list[TensorMeta]], owned: list[int]):
    """An Init stream for the fragments `owned`: the StateHeader with the layout, then every tensor's fp32
    values, generated and sent one tensor at a time (no copy of Θ is ever held here)."""
    import torch

    from diloco.codecs import get_codec
    from diloco.transport.frames import data_frames
    from diloco.v1 import diloco_pb2 as pb

    fp32 = get_codec("fp32")
    tensors = [t for p in owned for t in layout[p]]
    header = pb.StateHeader(
        layout=[pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=t.name, shape=[t.numel]) for t in layout[p]])
                for p in owned],
        tensors=[pb.TensorHeader(name=t.name, codec="fp32", shape=[t.numel], block=0,
                                 payload_bytes=fp32.payload_bytes(t.numel), scale_bytes=fp32.scale_bytes(t.numel, 0))
                 for t in tensors])
    yield pb.Frame(state=header)

    def values():
        for t in tensors:
            gen = torch.Generator().manual_seed(zlib.crc32(t.name.encode()))
            yield fp32.encode(torch.rand(t.numel, generator=gen).mul_(2 * THETA_RANGE).sub_(THETA_RANGE))

    yield from data_frames(values())
