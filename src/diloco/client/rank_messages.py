"""Small messages between the ranks of one learner, over its own process group: rank 0's events, step ends
and join info to the others (`rank_sync.ShardedRanks`), and the tokens every rank trained in a step.

A sharded learner sends several such messages every step (the step's events, then its end), so each costs
one collective where it fits `FRAME` bytes: the pickled message goes in a fixed-size frame with its length
in front, and only a longer one takes a second broadcast for the rest (torch's `broadcast_object_list`
always takes two: the size, then the bytes).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from diloco.client.row_moves import collective_error

FRAME = 1024
"""Bytes of the one broadcast a small message takes (its length, 8 bytes, then the pickle)."""
_HEADER = 8


def summed(tokens: int, world: int) -> int:
    """Tokens trained this step by every rank of the learner."""
    if world == 1:
        return tokens
    count = torch.tensor([tokens], dtype=torch.int64)
    try:
        dist.all_reduce(count)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise collective_error(exc) from exc
    return int(count)


def broadcast(message: Any) -> Any:
    """Rank 0's `message` on every rank of the learner (a collective; the other ranks pass None)."""
    leader, device, room = dist.get_rank() == 0, _device(), FRAME - _HEADER
    try:
        data = pickle.dumps(message) if leader else b""
        frame = torch.zeros(FRAME, dtype=torch.uint8)
        if leader:
            frame[:_HEADER + min(len(data), room)] = _tensor(len(data).to_bytes(_HEADER, "little") + data[:room])
        frame = frame.to(device)
        dist.broadcast(frame, 0)
        frame = frame.cpu()
        length = int.from_bytes(frame[:_HEADER].numpy().tobytes(), "little")
        payload = frame[_HEADER:_HEADER + min(length, room)].numpy().tobytes()
        if length > room:  # the rest of a long message
            rest = _tensor(data[room:]).to(device) if leader else torch.empty(length - room, dtype=torch.uint8,
                                                                              device=device)
            dist.broadcast(rest, 0)
            payload += rest.cpu().numpy().tobytes()
    except (RuntimeError, dist.DistBackendError) as exc:
        raise collective_error(exc) from exc
    return message if leader else pickle.loads(payload)


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _device() -> torch.device:
    """Where the learner's group takes its tensors (NCCL: the rank's GPU), as `broadcast_object_list` does."""
    try:
        return dist.distributed_c10d._get_object_coll_device(None)
    except AttributeError:  # pragma: no cover - an older torch
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else \
            torch.device("cpu")
