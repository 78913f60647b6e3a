"""Fuzzing a live syncer shard: thousands of random and mutated messages to every RPC that takes input.

In the manner of fault-injection suites: an in-process shard served over real gRPC on loopback, one
correct learner joined (Θ seeded, a few rounds merged), then a seeded stream of messages that a
faulty or hostile client could send. Afterwards the shard must still answer, must have refused every
malformed message with INVALID_ARGUMENT or FAILED_PRECONDITION (UNKNOWN or INTERNAL would be an
unhandled exception in a handler), must hold exactly the state it held before, and the correct
learner must still train, push and merge.

What the fuzzer sends, and what may legitimately change:
- Push: every fuzzed push is built to be refused (a local oracle that mirrors the protocol's rules
  turns any message that could be valid into one based on a future version). Refusals change nothing
  but the shard's `push_errors` counter.
- Init: on the seeded shard a valid one is answered accepted=False; on an unseeded shard only invalid
  ones are sent and it must stay unseeded.
- Pull: by observers, for any id; as a member only for the ids in MEMBERS, which thereby take the
  state and join (that is what a Pull does), and leave (not finished) once fuzzing is over. Their
  ledger, held-state and membership entries are excluded from the comparison.
- A heartbeat carries progress; on a seeded shard the core refuses (INVALID_ARGUMENT) progress of an
  id that never joined and counters out of range.
- Heartbeat, Join, Leave, Updates of arbitrary ids are accepted by design (the protocol has no
  authentication): they change the shard's bookkeeping of those ids (tokens, steps, last seen, hosts,
  joined/left, update streams), which the comparison excludes. They must not change the core: Θ,
  versions, rounds, pending contributions, ledger, alive and finished learners.
- The real learner's id is not impersonated where a message under it legitimately acts for it
  (Leave, Updates, Heartbeat, a member Pull). Join under its id is sent: it must not touch the core.
- Raw bytes that do not parse as the request type are answered by gRPC itself with INTERNAL
  "Exception deserializing request!"; that is the one INTERNAL allowed. (The handler then sees its
  request stream end as if cleanly; what it read before must still be refused.)
- After every message a tripwire looks at the core, so a change is blamed on the last few messages.

The tests in test_fuzz_findings.py each pin one defect the fuzzer found, as a minimal reproduction.
The shard, its deep snapshots and the oracle are in fuzz_shard.py; the fuzzer in fuzzer.py (its base
and its pushes in fuzz_messages.py and fuzz_pushes.py).

DILOCO_FUZZ_SEED and DILOCO_FUZZ_MESSAGES pick the seed and the number of messages; the seed is
printed, so a failure reproduces with `DILOCO_FUZZ_SEED=<seed> pytest tests/test_fuzz.py -s`.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from diloco.client.learner_client import Learner
from diloco.shard.server import SyncerShard
from diloco.transport.calls import ShardClient
from diloco.transport.frames import encode_fp32, tensor_header
from diloco.v1 import diloco_pb2 as pb

from fuzz_shard import (MESSAGES, REAL, SEED, core_state, differences, learner_of, live_shard, settle, tiny_model,
                        train, view_of_model, view_of_shard)
from fuzzer import Fuzzer, leave_members

pytestmark = pytest.mark.integration  # every test fuzzes a live shard over real gRPC


# ---------------------------------------------------------------- the fuzz tests


def still_trains(shard: SyncerShard, learner: Learner, seed: int) -> list[str]:
    """The learner trains, pushes and merges; the shard counts each of its pushes once."""
    merges, seq = learner.merges, learner.core.seq
    with shard.lock:
        entry = shard.core.ledger.get(learner.id)
        pushes, duplicates = (entry.pushes, entry.duplicates) if entry else (0, 0)
    for attempt in range(8):  # answers are merged τ steps after their push, once they have arrived
        train(learner, 4, seed + attempt)
        try:
            settle(shard, learner, timeout_s=5)
        except AssertionError as exc:
            entry = shard.core.ledger.get(learner.id)
            return [f"{exc}: the shard counted {entry.pushes if entry else 0} pushes, last seq "
                    f"{entry.last_seq if entry else 0}, {entry.duplicates if entry else 0} duplicates"]
        if learner.merges > merges and attempt >= 2:
            break
    entry = shard.core.ledger[learner.id]
    problems = []
    if learner.merges <= merges:
        problems.append(f"the learner merged nothing ({learner.merges} merges, as before)")
    if entry.pushes != pushes + learner.core.seq - seq or entry.duplicates != duplicates:
        problems.append(f"the ledger counts {entry.pushes} pushes ({pushes} before, {learner.core.seq - seq} sent "
                        f"since), {entry.duplicates} duplicates ({duplicates} before)")
    return problems


def status_problems(address: str, seeded: bool, versions: dict | None = None) -> list[str]:
    client = ShardClient(address)
    try:
        status = client.status()
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is the finding
        return [f"the shard no longer answers Status: {exc}"]
    finally:
        client.close()
    got = {v.fragment: v.version for v in status.versions}
    if status.initialised != seeded or (versions is not None and got != versions):
        return [f"Status after fuzzing: initialised {status.initialised}, versions {got}"]
    return []


def test_fuzzed_messages_to_a_seeded_shard_are_refused_and_change_nothing():
    seed, count = SEED, MESSAGES
    print(f"\nfuzz seed {seed}, {count} messages (DILOCO_FUZZ_SEED={seed} reproduces)")
    started = time.monotonic()
    problems: list[str] = []
    with live_shard("learners.count=1") as (shard, address), learner_of(address) as learner:
        train(learner, 8, seed)
        settle(shard, learner)
        before = core_state(shard)
        fuzzer = Fuzzer(random.Random(seed), shard, address, view_of_shard(shard), seeded=True)
        try:
            fuzzer.run(count)
        finally:
            fuzzer.close()
        leave_members(address)
        print(f"{count} messages in {time.monotonic() - started:.1f} s "
              f"({fuzzer.skipped} left unsent: they could have been valid)")
        print(fuzzer.histogram())
        problems += fuzzer.problems()
        if not shard.waker.is_alive():
            problems.append("the shard's timer thread died")
        problems += status_problems(address, True, {p: f["version"] for p, f in before["fragments"].items()})
        problems += [f"state changed: {d}" for d in differences(before, core_state(shard))][:20]
        problems += still_trains(shard, learner, seed + 1)
    print(f"whole test {time.monotonic() - started:.1f} s")
    assert not problems, f"fuzz seed {seed}:\n" + "\n".join(problems)


def test_fuzzed_messages_leave_an_unseeded_shard_unseeded():
    seed, count = SEED + 1, max(200, MESSAGES // 4)
    print(f"\nfuzz seed {seed}, {count} messages to an unseeded shard")
    problems: list[str] = []
    with live_shard("learners.count=1") as (shard, address):
        fuzzer = Fuzzer(random.Random(seed), shard, address, view_of_model(tiny_model()), seeded=False)
        try:
            fuzzer.run(count)
        finally:
            fuzzer.close()
        print(fuzzer.histogram())
        problems += fuzzer.problems()
        if shard.core is not None or shard.layout:
            problems.append("a fuzzed Init seeded the shard")
        problems += status_problems(address, False)
        if shard.core is None:  # a correct learner seeds it and trains
            with learner_of(address) as learner:
                problems += still_trains(shard, learner, seed)
    assert not problems, f"fuzz seed {seed}:\n" + "\n".join(problems)


def test_the_same_valid_push_replayed_100_times_is_counted_once():
    with live_shard("learners.count=1") as (shard, address):
        learner = Learner(tiny_model(), syncer=address, learner=REAL)
        fragment = learner.fragments[0]
        encoded = encode_fp32({n: torch.full_like(learner.params[n], 0.01) for n in fragment.names})
        header = pb.PushHeader(learner=REAL, fragment=fragment.index, base_version=0, seq=learner.core.seq + 1,
                               tokens=16, steps=1, step_time_s=0.01, sent_at=time.time(),
                               tensors=[tensor_header(n, encoded[n]) for n in fragment.names])
        clients = [ShardClient(address) for _ in range(4)]
        first = clients[0].push(header, encoded)
        theta = {n: t.clone() for n, t in shard.core.theta.items()}
        with ThreadPoolExecutor(8) as pool:  # replays, some at once
            replies = list(pool.map(lambda i: clients[i % 4].push(header, encoded), range(99)))
        assert not first.duplicate and all(r.duplicate for r in replies)
        entry = shard.core.ledger[REAL]
        assert (entry.pushes, entry.duplicates, entry.last_seq) == (1, 99, header.seq)
        assert shard.core.rounds_closed == 1 and shard.core.version(fragment.index) == 1
        assert all(torch.equal(shard.core.theta[n], theta[n]) for n in theta)
        for client in clients:
            client.close()
        learner.close()
