"""What a run's config must allow before its shards serve it (their settings travel as `wire_messages.settings_of`)."""

from __future__ import annotations

from diloco.config import Config
from diloco.errors import DilocoError
from diloco.strategies import build_strategy


def check_shards(config: Config, count: int) -> None:
    fragments = build_strategy(config).fragments
    if count > fragments:
        raise DilocoError(f"{count} syncer shards but only {fragments} fragments (outer.fragments): every shard "
                          f"must own at least one fragment")
