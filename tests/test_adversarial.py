"""The adversarial set, end to end: a live `diloco syncer` started with a secret, probed as an outsider,
as an insider holding its own credential, and for the resources a caller can make it spend, by the
probes of `benchmarks/adversarial.py` (which also probes the command line). Every probe must be
refused with one line and leave the shard healthy and as it was; none may be taken or stall it.

Layer by layer, with their final-state checks: tests/test_adversarial_core.py (Θ, weights, counters),
test_adversarial_transport.py (identity, threads, the waker), test_adversarial_journal.py (the journal,
state and checkpoint files), test_adversarial_cli.py (the command line, config, HTTP endpoints, SIGTERM).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import adversarial  # noqa: E402  (the benchmark's probes: one set serves both)

pytestmark = pytest.mark.integration  # a syncer subprocess, hundreds of calls and connections


def test_every_probe_against_a_live_shard_is_refused_and_none_crashes_it(tmp_path):
    outcomes = adversarial.probe_shard(tmp_path, half_open=32, idle=300)
    assert len(outcomes) >= 40
    bad = [f"{o.kind}: {o.probe}: {o.result} ({o.detail})" for o in outcomes if o.result != "refused"]
    assert not bad, "\n".join(bad)
    assert all(o.detail and "\n" not in o.detail for o in outcomes)
    kinds = {o.kind for o in outcomes}
    assert kinds == {"outsider", "insider", "resource"}


def test_bad_command_lines_get_one_line_and_no_traceback(tmp_path):
    outcomes = [adversarial.judge("cli", name, lambda arguments=arguments: adversarial.run_cli(arguments), None)
                for name, arguments in adversarial.cli_probes(tmp_path)]
    bad = [f"{o.probe}: {o.result} ({o.detail})" for o in outcomes if o.result != "refused"]
    assert not bad, "\n".join(bad)
