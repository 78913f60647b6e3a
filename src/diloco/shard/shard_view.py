"""What a syncer shard is to the modules that work on it (resuming it, reporting on it, serving it, making it
a region's syncer): the shard's state and the few calls they make, as a Protocol. They type against this,
not against `SyncerShard`, so that the shard can import them without an import cycle through type hints."""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

import torch

from diloco.clock import Clock
from diloco.config import Config
from diloco.core.actions import Action
from diloco.core.events import SyncerEvent
from diloco.core.messages import Update
from diloco.core.syncer_core import SyncerCore
from diloco.fragments import Fragment
from diloco.metrics import MetricsLog
from diloco.metrics.records import RoundMeter
from diloco.shard.ownership import ShardPlan
from diloco.shard.store import ShardStore
from diloco.strategies.spec import StrategySpec
from diloco.transport.bulk import BulkServer
from diloco.v1 import diloco_pb2 as pb


class ShardView(Protocol):
    config: Config
    plan: ShardPlan
    clock: Clock
    spec: StrategySpec
    settings: pb.Settings
    owned: list[int]
    lock: threading.RLock
    core: SyncerCore | None
    layout: list[pb.FragmentLayout]
    outboxes: dict[int, queue.Queue[Update]]
    joined: set[int]
    left: set[int]
    steps: dict[int, int]
    hosts: dict[int, str]
    declared: dict[int, int]
    push_errors: int
    answers_sent: int
    answer_bytes_sent: int
    bulk: BulkServer | None
    finished: bool
    stop_said: bool
    started: float
    last_updates: dict[int, dict[int, Update]]
    store: ShardStore | None
    metrics: MetricsLog
    round_meter: RoundMeter
    run_id: str
    tier: Any
    """The region's tier (`regional_shard.RegionTier`) or None: typed loosely, since that module uses this one."""
    _replaying: bool

    def start(self) -> Any: ...

    def apply(self, event: SyncerEvent, now: float, push_frames: bytes = b"") -> list[Action]: ...

    def carry_out(self, actions: list[Action]) -> None: ...

    def save_state(self) -> None: ...

    def _make_core(self, values: dict[str, torch.Tensor], fragments: list[Fragment], embeddings: set[str]
                   ) -> SyncerCore: ...
