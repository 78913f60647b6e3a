"""A shard's outage, the seconds after its restart: its saves keep the journal a restart replays short,
learners get through to it as soon as it serves (not at their next backoff step), a resumed shard is where it
was without a save at its resume (even resumed again before its next save), and `diloco chaos` explains each
shard kill with its timeline."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from diloco.client.reachability import Reachability
from diloco.errors import DilocoError
from diloco.launch.outage_timeline import describe, shard_outages
from diloco.transport import calls
from diloco.transport.calls import RECONNECT_MAX_S, SyncerUnavailable, with_retries
from shard_on_disk import SeededShard, _no_shard_left  # noqa: F401 - the fixture that kills leftover shards

integration = pytest.mark.integration  # live shards over real gRPC


class Channel:
    """A client's connection as `with_retries` sees it: `connected`, and a wait that ends when it is back."""

    def __init__(self, connected: bool) -> None:
        self.connected = connected
        self.waits: list[float] = []

    def wait_connected(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        self.connected = True  # it came back during the wait
        return True


def raising(exc: Exception):
    def fn():
        raise exc
    return fn


def failing(times: int):
    calls_made = []

    def fn():
        calls_made.append(1)
        if len(calls_made) <= times:
            raise SyncerUnavailable("down")
        return "through"
    return fn, calls_made


@pytest.mark.parametrize("connected", [False, True])
def test_a_call_without_a_connection_is_tried_again_once_it_is_back_and_a_busy_one_backs_off(monkeypatch, connected):
    slept: list[float] = []
    monkeypatch.setattr(calls.clock, "sleep", slept.append)
    channel = Channel(connected)
    fn, made = failing(1 if not connected else 3)
    assert with_retries(fn, client=channel) == "through"
    if connected:  # refused over a standing connection (busy): the backoff spares the shard
        assert slept == [0.1, 0.2, 0.4] and channel.waits == []
    else:  # the connection was gone: tried again as soon as the channel had one, no backoff slept
        assert slept == [] and channel.waits == [0.1] and len(made) == 2


def test_reachability_pairs_each_calls_first_failure_with_the_first_that_got_through():
    reach = Reachability()
    reach.call(0, "heartbeat", lambda: "fine")  # no outage: nothing to say
    for _ in range(3):
        with pytest.raises(SyncerUnavailable):
            reach.call(1, "push", raising(SyncerUnavailable("down")))
    assert reach.take() == []
    with pytest.raises(DilocoError):  # refused with a reason: the shard answered
        reach.call(1, "push", raising(DilocoError("an outlier")))
    (back,) = reach.take()
    assert (back.shard, back.call) == (1, "push") and back.lost_at <= back.back_at
    assert reach.take() == []


def test_a_shard_kills_timeline_comes_from_every_process_records(tmp_path):
    origin = 1000.0
    lines = {
        "syncer-0": [{"kind": "resume", "time_s": 13.0, "shard": 0, "resume_s": 0.8, "events": 40, "load_s": 0.1,
                      "check_s": 0.1, "read_s": 0.2, "replay_s": 0.4},
                     {"kind": "serving", "time_s": 13.1, "shard": 0, "resumed": True}],
        "learner-0": [{"kind": "reconnect", "time_s": 13.3, "learner": 0, "shard": 0, "down_s": 2.9, "push": False},
                      {"kind": "reconnect", "time_s": 13.4, "learner": 0, "shard": 0, "down_s": 3.2, "push": True}],
        "learner-1": [{"kind": "reconnect", "time_s": 13.6, "learner": 1, "shard": 0, "down_s": 3.0, "push": False},
                      {"kind": "reconnect", "time_s": 30.0, "learner": 1, "shard": 0, "down_s": 1.0, "push": False}],
    }
    for name, records in lines.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    kills = [{"victim": "syncer-0", "at_s": 9.5, "killed_unix": origin + 10.0, "restarted_unix": origin + 12.0},
             {"victim": "syncer-0", "at_s": 28.5, "killed_unix": origin + 29.0, "restarted_unix": origin + 29.5},
             {"victim": "learner-1", "at_s": 5.0, "killed_unix": origin + 5.0, "restarted_unix": origin + 7.0}]
    first, second = shard_outages(tmp_path, kills, origin)
    assert first["restarted_s"] == pytest.approx(2.0) and first["resumed_s"] == pytest.approx(3.0)
    assert first["resume_began_s"] == pytest.approx(2.2) and first["serving_s"] == pytest.approx(3.1)
    assert first["events_replayed"] == 40 and first["resume_parts_s"]["replay_s"] == 0.4
    assert first["learners"] == {"learner-0": {"heartbeat": pytest.approx(3.3), "push": pytest.approx(3.4)},
                                 "learner-1": {"heartbeat": pytest.approx(3.6)}}
    assert first["outage_s"] == pytest.approx(3.6)  # the last learner's first call through
    assert second["learners"] == {"learner-1": {"heartbeat": pytest.approx(1.0)}} and "resumed_s" not in second
    assert "serving +3.10" in describe(first) and "replay 0.40 of 40 events" in describe(first)


def theta_and_ledger(seeded: SeededShard) -> tuple[dict, dict]:
    with seeded.shard.lock:
        core = seeded.shard.core
        theta = {n: t.clone() for n, t in core.theta.items()}
        entry = core.ledger[0]
        return theta, {"pushes": entry.pushes, "last_seq": entry.last_seq, "versions": core.version(0),
                       "rounds": core.rounds_closed}


@integration
def test_a_shard_resumed_twice_without_a_save_between_is_where_it_was(tmp_path, monkeypatch):
    """The resume saves nothing (it serves sooner): the journal goes on after the records it replayed, and a
    second crash before the next save replays them again, the first resume's own event among them."""
    from diloco.shard import shard_state

    monkeypatch.setattr(shard_state, "SAVE_MIN_S", 600.0)  # no periodic save during the test
    monkeypatch.setattr(shard_state, "SAVE_EVERY_S", 600.0)
    first = SeededShard(tmp_path)
    first.client.push(*first.push_message(1))
    before = theta_and_ledger(first)
    first.kill()
    second = SeededShard(tmp_path, resume=True)
    assert second.shard.store.saved_at is None  # nothing saved at the resume
    second.client.push(*second.push_message(2))
    second.client.push(*second.push_message(2))  # a retry: counted once
    middle = theta_and_ledger(second)
    assert middle[1]["pushes"] == 2 and not torch.equal(middle[0]["0.weight"], before[0]["0.weight"])
    second.kill()
    third = SeededShard(tmp_path, resume=True)
    try:
        after = theta_and_ledger(third)
        assert after[1] == middle[1]
        assert all(torch.equal(after[0][n], middle[0][n]) for n in middle[0])
    finally:
        third.kill()


class Kept:
    """A metrics sink that keeps its records."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass

    def rounds(self) -> list[tuple[int, int]]:
        return [(r["fragment"], r["version"]) for r in self.records if r["kind"] == "round"]


@integration
def test_a_resumed_shard_records_only_the_rounds_it_closes_itself(tmp_path, monkeypatch):
    """Before s54 a resumed shard recorded every round of its saved state and journal again, so each kill
    doubled the rounds before it in the run's metrics (its report, its plots, the stale share)."""
    from diloco.metrics import MetricsLog
    from diloco.shard import shard_state

    monkeypatch.setattr(shard_state, "SAVE_MIN_S", 0.0)  # a save after the first round: state and journal both
    first_kept, second_kept = Kept(), Kept()
    first = SeededShard(tmp_path, metrics=MetricsLog([first_kept]))
    first.client.push(*first.push_message(1))
    first.shard.save_state()
    first.client.push(*first.push_message(2))  # journaled after the save: replayed at the resume
    assert first_kept.rounds() == [(0, 1), (0, 2)]
    first.kill()
    second = SeededShard(tmp_path, resume=True, metrics=MetricsLog([second_kept]))
    assert second.shard.core.version(0) == 2 and second_kept.rounds() == []
    second.client.push(*second.push_message(3))
    assert second_kept.rounds() == [(0, 3)]
    second.kill()


@integration
def test_a_push_waiting_on_a_restarted_shard_gets_through_within_the_reconnect_bound(tmp_path):
    """Down long enough for the retry backoff to grow past a second: once the shard serves again on its
    address, the push goes at the channel's next reconnect (at most `RECONNECT_MAX_S`, plus gRPC's 20%
    jitter), not at the backoff's next step; the learner's `Reachability` says when it was lost and back."""
    first = SeededShard(tmp_path)
    message = first.push_message(1)
    client = calls.ShardClient(first.address)
    client.status()
    reach, through = Reachability(), []
    first.kill()
    pusher = threading.Thread(target=lambda: through.append(with_retries(
        lambda: reach.call(0, "push", lambda: client.push(*message)), attempts=None, client=client)))
    pusher.start()
    time.sleep(3.5)  # retries at 0.1, 0.3, 0.7, 1.5, 3.1 s failed; the backoff's next step is at 6.3 s
    second = SeededShard(tmp_path, resume=True, address=first.address)
    serving = time.time()
    try:
        pusher.join(timeout=30)
        (back,) = reach.take()
        assert through and second.shard.core.ledger[0].pushes == 1
        slack_s = 1.0  # a loaded host's scheduling, not the protocol
        assert back.lost_at < serving < back.back_at <= serving + RECONNECT_MAX_S * 1.2 + slack_s
    finally:
        client.close()
        second.kill()


@pytest.mark.parametrize("cost_s, apart_s", [(0.01, 2.0), (0.2, 4.0), (1.0, 10.0)])
def test_a_shard_saves_as_often_as_its_saves_cost_allows_within_its_bounds(monkeypatch, cost_s, apart_s):
    """A save holds the shard's lock: at most `SAVE_SHARE` of the time, and between the shard's bounds; the
    more often it saves, the less journal a restart replays."""
    from diloco.clock import ManualClock
    from diloco.shard import waker as waker_module
    from diloco.shard.waker import SAVE_SHARE, Waker

    assert cost_s / SAVE_SHARE == pytest.approx(apart_s) or apart_s in (2.0, 10.0)
    clock, saves, real = ManualClock(), [], iter([0.0, cost_s] * 10)
    monkeypatch.setattr(waker_module, "perf_counter", lambda: next(real))
    waker = Waker(threading.Condition(), lambda now: None, saves.append, save_every_s=10.0, clock=clock,
                  save_min_s=2.0)
    start = clock.now()
    for _ in range(3):
        waker.tick(waker._next_save)
    assert [round(t - start, 6) for t in saves] == [2.0, 2.0 + apart_s, 2.0 + 2 * apart_s]
