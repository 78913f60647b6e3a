"""scale.py's synthetic learner (`scale.py --worker SPEC`): joins every shard and pushes the same encoded
bytes as fast as each shard takes them (or, paced, when the syncer's answers say), counting what it sent and
received."""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import mmap
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from children import PARENT_ENV  # benchmarks/children.py
from scale_model import (DRAIN_S, HEARTBEAT_S, PR_SET_PDEATHSIG, PUSH_BOUND_S, STARTUP_S, STEPS_PER_PUSH,
                         STEP_TIME_S)

ANSWER_BOUND_S = 30.0
"""Paced, the longest a learner waits for the answer to its last push of a fragment before pushing it again."""
RELEASE_BOUND_S = 300.0
"""The longest a worker stays connected after its report, waiting for the parent to have read Status."""


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        parent = os.environ.get(PARENT_ENV)
        if parent and os.getppid() != int(parent):
            os._exit(1)


@dataclass
class ShardEvents:
    """What one learner saw of one shard, with times (time.time()); reduced to figures once the window
    is known (`window_stats`)."""

    pushes: list[tuple[float, float, int, int]] = field(default_factory=list)
    """(sent, taken, tensor bytes, parameters) of every push the shard took."""
    pulls: list[tuple[float, int]] = field(default_factory=list)
    """(received, tensor bytes) of every data frame of the update stream."""
    answers: list[tuple[float, int, int]] = field(default_factory=list)
    """(fully received, fragment, version) of every answer."""
    latencies: list[tuple[float, float]] = field(default_factory=list)
    """(sent, answered) of every push whose answer came."""
    sent: dict[int, float] = field(default_factory=dict)
    """Per seq of a push not answered yet, when it was sent."""
    refused: int = 0
    busy: int = 0
    first_error: str = ""
    step: int = 0
    """The learner's inner step as this shard has been told (pushes and heartbeats claim the same)."""


def overlap(start: float, end: float, w0: float, w1: float) -> float:
    """The share of [start, end] inside [w0, w1]."""
    if end <= start:
        return 1.0 if w0 <= end <= w1 else 0.0
    return max(0.0, min(end, w1) - max(start, w0)) / (end - start)


def window_stats(e: ShardEvents, w0: float, w1: float) -> dict[str, Any]:
    """One learner's figures for one shard over [w0, w1]: a push counts by its overlap with the window
    (sent to taken), a frame by when it arrived, a latency if its push was sent in the window."""
    inside = lambda t: w0 <= t <= w1  # noqa: E731
    return {"push_bytes": sum(n * overlap(a, b, w0, w1) for a, b, n, _ in e.pushes),
            "push_params": sum(k * overlap(a, b, w0, w1) for a, b, _, k in e.pushes),
            "pushes": sum(1 for a, b, _, _ in e.pushes if overlap(a, b, w0, w1) > 0),
            "pull_bytes": sum(n for t, n in e.pulls if inside(t)),
            "answers": sum(1 for t, _, _ in e.answers if inside(t)),
            "rounds": sorted({(p, v) for t, p, v in e.answers if inside(t)}),
            "latencies": [b - a for a, b in e.latencies if inside(a)],
            "unanswered": sum(1 for t in e.sent.values() if inside(t)),
            "refused": e.refused, "busy": e.busy, "first_error": e.first_error}


def worker(spec_path: str) -> None:
    """One synthetic learner: join every shard, push the pre-encoded gradients, count the answers.
    Talks to the parent through files: `ready`, the `go` time, its `progress` (pushes taken since the
    window opened), the `stop` time the parent chose, and its `report`."""
    die_with_parent()
    spec = json.loads(Path(spec_path).read_text())
    import grpc

    from diloco.codecs import Encoded
    from diloco.errors import DilocoError
    from diloco.transport.calls import ShardClient, SyncerUnavailable, with_retries
    from diloco.transport.frames import tensor_header
    from diloco.transport.security import PLAINTEXT, TransportSecurity, learner_security
    from diloco.v1 import diloco_pb2 as pb

    me = spec["learner"]
    tokens_per_step = spec["tokens_per_step"]
    if spec["secret_file"]:
        security = learner_security(TransportSecurity(secret=Path(spec["secret_file"]).read_bytes()), me)
    else:
        security = PLAINTEXT

    # The pushes: every fragment's encoded bytes, mapped from the file this script wrote (shared by all).
    tensors: dict[int, dict[str, Encoded]] = {}
    headers: dict[int, list] = {}
    maps = []
    for p_text, frag in spec["payload"]["fragments"].items():
        p = int(p_text)
        with open(frag["file"], "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        maps.append(mm)
        view, offset, encoded = memoryview(mm), 0, {}
        for t in frag["tensors"]:
            end = offset + t["payload_bytes"]
            encoded[t["name"]] = Encoded(t["codec"], tuple(t["shape"]), t["block"], view[offset:end],
                                         view[end:end + t["scale_bytes"]])
            offset = end + t["scale_bytes"]
        tensors[p] = encoded
        headers[p] = [tensor_header(n, e) for n, e in encoded.items()]
    nbytes = {p: sum(h.payload_bytes + h.scale_bytes for h in hs) for p, hs in headers.items()}
    numels = {p: sum(math.prod(h.shape) for h in hs) for p, hs in headers.items()}

    clients = []
    for address in spec["addresses"]:
        client = ShardClient(address, security)
        client.wait_ready(STARTUP_S)
        reply = with_retries(lambda c=client: c.join(me, host=f"scale-learner-{me}", tokens_per_step=tokens_per_step),
                             what="join")
        if reply.learner != me:
            raise SystemExit(f"joined as learner {reply.learner}, not {me}")
        clients.append(client)

    lock = threading.Lock()
    events = [ShardEvents() for _ in clients]
    versions: dict[int, int] = {}
    stop = threading.Event()
    paced = bool(spec.get("paced"))
    """Follow the pacing grid, as a paced learner does: push a fragment at the time its last answer named
    (`next_push_at`, on this clock) and report after every push when each fragment is due, so that rounds
    wait for the learners about to land and gather them. Otherwise push as fast as the shard takes them."""
    due_at: dict[int, float] = {}
    """Per fragment, when the syncer's last answer of it said to push it next."""
    in_flight: dict[int, tuple[int, threading.Event]] = {}
    """Per fragment with a push in flight (paced): its seq, and an event set when its answer came."""
    fragment_count = len(spec["payload"]["fragments"])
    began: list[float] = [0.0]
    """When pushing began (time.time()), set once the window's clock starts: a paced learner's steps count from it."""

    def read_updates(i: int) -> None:
        e = events[i]
        call = clients[i].stub.Updates(pb.UpdatesRequest(learner=me, bulk=True))  # a shard without a port: frames
        remaining, ack, fragment, version, continued = 0, 0, 0, 0, False
        try:
            for frame in call:
                now = time.time()
                kind = frame.WhichOneof("body")
                if kind == "update":
                    h = frame.update
                    remaining = sum(t.payload_bytes + t.scale_bytes for t in h.tensors)
                    ack, fragment, version = h.ack_seq, h.fragment, h.version
                    continued = getattr(h, "continued", False)  # more messages of this answer follow
                    next_push_at = h.next_push_at if h.HasField("next_push_at") else None
                    if h.bulk_ticket:  # the data follows on the shard's bulk port, as a learner reads it
                        clients[i].receive_bulk(h, [memoryview(bytearray(remaining))])
                        now = time.time()
                        with lock:
                            e.pulls.append((now, remaining))
                        remaining = 0
                elif kind == "data":
                    remaining -= len(frame.data)
                    with lock:
                        e.pulls.append((now, len(frame.data)))
                else:
                    continue
                if remaining <= 0 and not continued:
                    with lock:
                        versions[fragment] = max(versions.get(fragment, 0), version)
                        e.answers.append((now, fragment, version))
                        if next_push_at is not None:
                            due_at[fragment] = next_push_at
                        if fragment in in_flight and ack >= in_flight[fragment][0]:
                            in_flight[fragment][1].set()
                        for seq in [q for q in e.sent if q <= ack]:
                            e.latencies.append((e.sent.pop(seq), now))
        except grpc.RpcError as exc:
            if not stop.is_set() and exc.code() != grpc.StatusCode.CANCELLED:
                with lock:
                    e.first_error = e.first_error or f"update stream: {exc.code().name} {exc.details()}"
        except DilocoError as exc:  # a bulk transfer that broke
            if not stop.is_set():
                with lock:
                    e.first_error = e.first_error or f"update stream: {exc}"

    interval = 1.0 / spec["push_rate"] if spec.get("push_rate") else 0.0

    def report(i: int) -> None:
        """A heartbeat; paced, a progress report too: the step its clock has reached, and when each fragment
        is due (now, for one whose answer has not named a time yet)."""
        now = time.time()
        with lock:
            if paced and began[0]:  # the step its clock reached since pushing began
                events[i].step = max(events[i].step, int((now - began[0]) / STEP_TIME_S))
            step = events[i].step
            due_in = tuple(max(0.0, due_at.get(f, now) - now) for f in range(fragment_count)) if paced else ()
        try:
            clients[i].heartbeat(me, tokens=step * tokens_per_step, steps=step,
                                 step_time_s=STEP_TIME_S if paced else 0.0, due_in_s=due_in)
        except DilocoError:
            pass

    def wait_for_grid(p: int) -> bool:
        """Paced: until the answer to the last push of `p` came (at most ANSWER_BOUND_S) and the time it
        named; True if stopped."""
        flight, until = in_flight.get(p), time.monotonic() + ANSWER_BOUND_S
        while flight is not None and not flight[1].wait(0.05) and time.monotonic() < until:
            if stop.is_set():
                return True
        with lock:
            at = due_at.get(p)
        return at is not None and stop.wait(max(0.0, at - time.time()))

    def push_loop(i: int, owned: list[int]) -> None:
        e, client, seq = events[i], clients[i], 0
        due = time.monotonic()
        for p in itertools.cycle(owned):
            if interval:  # a fixed rate: the next push is due one interval after the last one was
                due += interval
                if stop.wait(max(0.0, due - time.monotonic())):
                    return
            if paced and wait_for_grid(p):
                return
            if stop.is_set():
                return
            seq += 1
            with lock:  # paced: the step its clock reached (each push's claim of steps stays the same)
                e.step = max(e.step + STEPS_PER_PUSH, int((time.time() - began[0]) / STEP_TIME_S)) if paced \
                    else e.step + STEPS_PER_PUSH
                base = versions.get(p, 0)
                if paced:
                    in_flight[p] = (seq, threading.Event())
            header = pb.PushHeader(learner=me, fragment=p, base_version=base, seq=seq,
                                   tokens=STEPS_PER_PUSH * tokens_per_step, steps=STEPS_PER_PUSH,
                                   step_time_s=STEP_TIME_S, sent_at=time.time(), step=e.step, tensors=headers[p])
            while True:
                started = time.time()
                with lock:
                    e.sent.setdefault(seq, started)
                try:
                    client.push(header, tensors[p])
                except SyncerUnavailable as exc:  # busy or briefly away: the same push again (counted once)
                    with lock:
                        e.busy += 1
                        e.first_error = e.first_error or str(exc)
                    if stop.wait(0.05):
                        return
                    continue
                except DilocoError as exc:
                    with lock:
                        e.refused += 1
                        e.sent.pop(seq, None)
                        e.first_error = e.first_error or str(exc)
                        in_flight.pop(p, None)  # no answer comes to a refused push
                    if stop.wait(0.1):
                        return
                    break
                with lock:
                    e.pushes.append((started, time.time(), nbytes[p], numels[p]))
                if paced:
                    report(i)
                break

    def heartbeats() -> None:
        while not stop.wait(HEARTBEAT_S):
            for i in range(len(clients)):
                report(i)

    for i in range(len(clients)):
        threading.Thread(target=read_updates, args=(i,), daemon=True).start()
    threading.Thread(target=heartbeats, daemon=True).start()
    Path(spec["ready_file"]).write_text("ready\n")

    go, stop_file, progress = Path(spec["go_file"]), Path(spec["stop_file"]), Path(spec["progress_file"])
    while not go.is_file():
        time.sleep(0.01)
    t0 = float(go.read_text())
    w0 = t0 + spec["warmup_s"]
    time.sleep(max(0.0, t0 - time.time()))
    began[0] = time.time()
    pushers = [threading.Thread(target=push_loop, args=(i, owned), daemon=True)
               for i, owned in enumerate(spec["owned"])]
    for t in pushers:
        t.start()
    while not stop_file.is_file():  # the parent ends the window
        with lock:
            taken = sum(1 for e in events for a, _, _, _ in e.pushes if a >= w0)
        progress.with_suffix(".tmp").write_text(str(taken))
        progress.with_suffix(".tmp").rename(progress)
        time.sleep(0.2)
    w1 = float(stop_file.read_text())
    stop.set()
    for t in pushers:  # the push in flight at the window's end: its overlap counts, and its answer
        t.join(timeout=PUSH_BOUND_S)
    drain_until = time.time() + DRAIN_S
    while time.time() < drain_until:  # answers to the window's last pushes
        with lock:
            if not any(w0 <= sent <= w1 for e in events for sent in e.sent.values()):
                break
        time.sleep(0.02)
    with lock:
        report = {"learner": me, "window": [w0, w1], "shards": [window_stats(e, w0, w1) for e in events]}
    tmp = Path(spec["report_file"] + ".tmp")
    tmp.write_text(json.dumps(report))
    tmp.rename(spec["report_file"])
    release, until = Path(spec["release_file"]), time.monotonic() + RELEASE_BOUND_S
    while not release.is_file() and time.monotonic() < until:  # connected until the shards' Status is read:
        time.sleep(0.05)  # a learner whose connection ends without a goodbye counts dead at once
    os._exit(0)  # no waiting on gRPC's teardown or the update streams
