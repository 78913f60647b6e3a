"""How a config rule fails: one line that names the key, the rule and the value; and the bounds no run
can go beyond, shared by the sections' checks."""

from __future__ import annotations

from typing import Any

from diloco.errors import ConfigError

MAX_TOKENS = 2**53
"""Token counts above it are no longer exact as floats (rates, shares and budgets are computed in floats)."""
MAX_LEARNERS = 4096
"""The syncer keeps a copy of Θ (or of its fragments) and a ledger per learner: more cannot fit in memory."""
MAX_CODEC_BLOCK = 2**20
"""Elements per scale of the block codecs: one scale per million elements already quantizes coarsely."""
MAX_STEPS = 2**31 - 1
"""Step counts (H, warmup, checkpoint and metrics intervals): far beyond any run, still a 32-bit int."""
MAX_SEED = 2**63 - 1
"""The largest seed torch and numpy both take."""
MAX_QUANTITY = 1e9
"""Largest magnitude of any non-integer number in a config (a time of 30 years, a rate of 10^9): above
it no run has such a quantity, and products of it (lr × Δ, a time × a rate) leave float32."""
LEARNING_RATES = {"train.lr": 1.0, "outer.lr": 10.0, "regional.lr": 10.0}
"""The largest learning rate each step can live with: the inner AdamW moves each weight by about lr per
step; the outer Nesterov step moves Θ by lr × the merged progress (honest: 0.7 to 1)."""


def require(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {rule}; got {value!r}")


def require_at_most(value: int, high: int, key: str, low: int = 1, why: str = "") -> None:
    """An upper bound, checked once the lower one holds; the message gives the whole range."""
    require(value <= high, key, f"must be in [{low:,}, {high:,}]" + (f": {why}" if why else ""), value)


def known(names: list[str]) -> str:
    return f"known: {', '.join(names)}" if names else "no regions are configured"
