"""Pre-started spares (`launch/spare.py`, `diloco chaos`'s restarts): a spare becomes the killed process in its
own process, with the restart's arguments, where it fits; anything else is started afresh. (A spare that
becomes a learner, and resumes as a fresh one would: `test_crash_resume.py`.)"""

from __future__ import annotations

import sys

import pytest

from conftest import TINY, child_env
from diloco.launch.processes import Children
from diloco.launch.spare import Spares
from diloco.transport.calls import ShardClient
from diloco.transport.ports import wait_for_port

pytestmark = pytest.mark.integration  # syncer shards and spares as processes


def test_a_spare_becomes_a_killed_shard_with_resume_on_its_port(tmp_path):
    children, env = Children(tmp_path / "logs"), child_env()
    spares = Spares(children, env, 1, "syncer")
    port_file = tmp_path / "syncer-0.port"
    sets = [x for o in TINY for x in ("--set", o)]
    argv = [sys.executable, "-m", "diloco", "syncer", "--bind", "127.0.0.1:0", "--port-file", str(port_file),
            "--out", str(tmp_path / "out"), *sets]
    try:
        spares.fill()
        first = children.start("syncer-0", argv, env)
        port = wait_for_port(port_file, "syncer-0", gone=lambda: first.log_tail() if first.returncode else None)
        first.set_option("--bind", f"127.0.0.1:{port}")
        children.kill("syncer-0")
        port_file.unlink()
        waiting = [c.process.pid for c in spares.waiting()]
        second = spares.restart("syncer-0", ("--resume",))
        assert second.process.pid in waiting and second.argv[-1] == "--resume"
        assert wait_for_port(port_file, "syncer-0", gone=lambda: second.log_tail() if second.returncode else None,
                             timeout_s=120) == port
        client = ShardClient(f"127.0.0.1:{port}")
        try:
            assert not client.status().finished  # it serves
        finally:
            client.close()
        assert [c.name for c in spares.waiting()] == ["spare-syncer-1"]  # its replacement, started at once
        other = children.start("learner-0", [sys.executable, "-c", "import time; time.sleep(600)"], env)
        children.kill("learner-0")
        again = spares.restart("learner-0")
        assert again.process.pid != other.process.pid and again.process.pid not in [
            c.process.pid for c in spares.waiting()]  # not `python -m diloco`: started afresh
    finally:
        children.close()


def test_spares_say_when_their_imports_are_done_and_a_refill_of_one_starts_one(tmp_path):
    children, env = Children(tmp_path / "logs"), child_env()
    spares = Spares(children, env, 2, "syncer")
    try:
        spares.fill()
        assert not spares.wait_ready(0.0)  # just started: still importing
        assert spares.wait_ready(120.0)
        assert all((tmp_path / "logs" / f"{c.name}.ready").is_file() for c in spares.waiting())
        spares.fill(1)
        assert len(spares.waiting()) == 2  # two waiting already: none started
        for spare in spares.waiting():
            children.kill(spare.name)
        spares.fill(1)
        assert [c.name for c in spares.waiting()] == ["spare-syncer-2"]
        assert spares.wait_ready(120.0)
    finally:
        children.close()
