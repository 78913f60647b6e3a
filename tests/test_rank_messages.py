"""Small messages between a learner's ranks (`client/rank_messages.py`): rank 0's message reaches every rank
whole, whether it fits the one-collective frame, just fills it, or needs the second broadcast."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.integration,  # two processes, Gloo
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="torch.distributed with Gloo is not available")]

ROOM = 1024 - 8


def _messages() -> list[object]:
    """Pickles shorter than the frame, exactly its room, one byte over, and far over; and None."""
    exact = next(b"x" * n for n in range(ROOM) if len(pickle.dumps(b"x" * n)) == ROOM)
    return [("event", 3, 1.5), None, exact, exact + b"y", {"settings": b"z" * 50_000}, ("end", False, None)]


def _rank(rank: int, store: str, result: str) -> None:
    sys.path[:0] = [str(Path(__file__).parent.parent / "src")]
    from diloco.client.rank_messages import broadcast, summed
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    heard = [broadcast(m if rank == 0 else None) for m in _messages()]
    total = summed(rank + 5, 2)
    Path(f"{result}-{rank}").write_bytes(pickle.dumps((heard, total)))
    dist.barrier()
    dist.destroy_process_group()


def test_every_rank_hears_rank_0s_message_whole_at_every_length(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path / "heard")), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        heard, total = pickle.loads((tmp_path / f"heard-{rank}").read_bytes())
        assert heard == _messages() and total == 11
