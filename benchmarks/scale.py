"""How the syncer scales: synthetic learners against real `diloco syncer` shard processes on this machine.

    python benchmarks/scale.py [--params 100M[,1B]] [--learners 1,16] [--shards 1[,2]] [--codec int4]
                               [--fragments F] [--seconds S] [--warmup W] [--json PATH] [--keep DIR]

With no arguments, a quick sweep (20M parameters, 1, 4, 8 and 16 learners, one shard, int4; about 2 to
3 minutes on 2 cores). For every combination of --params x --shards x --codec x --learners:

  shards    fresh `diloco syncer` processes, one per shard (`--shard i/N`, the shard map, a shared
            secret in a file, as `diloco run` starts them; no state folder unless --journal), Decoupled
            DiLoCo with quorum 1 and no pacing or grace: each push closes its own round at once, is
            merged and answered. Liveness allowances are set far above the run so that no synthetic
            learner is ever found dead. Θ is seeded by this script over the run secret (an Init that
            streams one tensor at a time: uniform values in ±0.05), in a layout of --fragments
            fragments (default max(4, 2 x shards)), each split into tensors of at most --max-tensor
            elements, fragment p on shard p mod N as the launcher's ShardPlan has it.
  learners  separate processes (this script with --worker), each joining every shard as learner m with
            its own credential derived from the run secret. No training: one outer gradient per
            fragment (N(0, 1e-3²), small against Θ so the outlier bounds never clip or refuse it) is
            encoded ONCE with --codec by this script and written to a file; every learner maps those
            files (mmap) and pushes the same bytes, so 16 learners hold one copy between them (page
            cache) and their CPU goes to the wire, not to encoding. Per shard, a learner has one push
            in flight at a time, cycling over the shard's fragments, as fast as the shard takes them:
            valid headers (seq +1, base_version = the newest version it was answered, 4 steps of
            --tokens-per-step tokens per push as declared at join, heartbeats every second with the same
            counters). Answers are read off the Updates stream frame by frame and counted, not
            assembled or decoded (so 16 learners' answers of a 1B model do not need 16 copies here).
  timing    all learners start together; --warmup seconds, then a window of at least --seconds that
            also lasts until --min-pushes pushes per shard were taken in it (at most --max-seconds: a
            100M-parameter push takes seconds to merge here), in which
            push MB/s   tensor bytes (payload + scales) of pushes taken, over the window (a push counts
                        by the share of its time, sent to taken, inside the window), over learners;
            pull MB/s   tensor bytes of answers received in the window;
            latency     per push sent in the window, push sent -> its answer (ack_seq >= its seq)
                        fully received (the learners wait for these after the window): median, p95;
            rounds/s    distinct versions answered in the window (each push closes its own round).
  memory    per shard, VmRSS and VmHWM from /proc/PID/status every 0.2 s: `rss_bytes` is the largest
            VmRSS from the learners' start to the window's end (under load, after Θ was seeded);
            `hwm_bytes` the kernel's peak, the seeding included. Θ bytes held: the Status report's
            `memory` dict where the shard reports one ("n/a" otherwise).
  socket    after the shards are stopped: a plain TCP socket on loopback to a Python subprocess that
            reads each message into a buffer and acks it with one byte, messages of one fragment's
            encoded push, request/response, for --socket-seconds (default 3): `socket_mb_s`.

Memory: before a combination starts, its peak is predicted per shard as base + P_shard x (a + b x
learners) bytes, a and b fitted on the runs already done in this invocation with the same codecs and
shard count (at first, what the syncer measured here needed: see DEFAULT_BYTES_PER_PARAM); a
combination that would leave less than --min-free-gib of MemAvailable is skipped with its reason
(--force runs it anyway). While it runs, a watchdog kills it if MemAvailable falls below --min-free-gib.

Prints a table of runs, one of shards and one of targets (measured against target, met or not); with
--json PATH writes the list of runs. Every process started is stopped at the end, on errors and on
Ctrl-C (SIGINT to its session, then SIGKILL); each child also dies with this script (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import math
import mmap
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from children import PARENT_ENV, Processes, diloco, tail  # benchmarks/children.py

# ---------------------------------------------------------------- constants

RSS_RATIO_TARGET = 1.2
"""Syncer RSS with 16 learners over RSS with 1 learner: at most this."""
SOCKET_RATIO_TARGET = 0.5
"""Push MB/s of one shard over a plain socket on loopback: at least this."""
SCALING_TARGET = 3.0
"""A shard's push (and pull) MB/s with 8 learners over 1 learner: at least this."""

THETA_RANGE = 0.05
"""Θ is seeded uniform in ±THETA_RANGE."""
DELTA_STD = 1e-3
"""Outer gradients are N(0, DELTA_STD²): ‖Δ‖/‖Θ‖ ≈ 0.035, far under the hard outlier bound (10x)."""
STEPS_PER_PUSH = 4
"""Inner steps each push claims. Constant, so every push of a fragment has the same size per √step (the
outlier history's reference) and each claim rises less than the 64 steps of slack the claims allow."""
STEP_TIME_S = 0.01
HEARTBEAT_S = 1.0
MB = 1e6
GIB = 1 << 30
BASE_RSS_BYTES = 256 << 20
"""A shard's RSS before Θ: the interpreter, torch, gRPC (240 MiB measured)."""
LEARNER_RSS_BYTES = 250 << 20
"""A synthetic learner's RSS (it imports torch through the client; most of it shared libraries)."""
DEFAULT_BYTES_PER_PARAM = (28.0, 1.0)
"""(a, b): a shard's peak RSS ≈ BASE + P_shard x (a + b x learners) bytes, before any run of this
invocation measured better. Measured here (int4 both ways, 4 fragments, 2026-12-03): 24.5 bytes per
parameter with one learner at 100M parameters, 26.8 with sixteen. The Init holds several copies of Θ at
once; the shard keeps Θ, the outer optimizer's two buffers and the published copy (a lossy downlink),
plus about one fragment per answer or push in flight. b is kept above what was measured, to plan by."""
DRAIN_S = 30.0
"""After its last push was taken, how long a learner waits for the answers to its pushes of the window."""
PUSH_BOUND_S = 900.0
"""How long a learner waits for its push in flight when the window closes (behind 15 others' merges)."""
STARTUP_S = 120.0
"""Bound on the shards' and learners' start (imports, joins, mapping the payload)."""
PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------- the synthetic model


@dataclass(frozen=True)
class TensorMeta:
    name: str
    numel: int


def model_layout(params: int, fragments: int, max_tensor: int) -> list[list[TensorMeta]]:
    """`params` elements in `fragments` fragments of (nearly) equal size, each cut into tensors of at most
    `max_tensor` elements."""
    layout = []
    for p in range(fragments):
        numel = params // fragments + (1 if p < params % fragments else 0)
        pieces = max(1, math.ceil(numel / max_tensor))
        sizes = [numel // pieces + (1 if k < numel % pieces else 0) for k in range(pieces)]
        layout.append([TensorMeta(f"f{p}.t{k}", n) for k, n in enumerate(sizes)])
    return layout


def shard_fragments(fragments: int, shards: int) -> list[list[int]]:
    """Fragment p belongs to shard p mod N (shard/ownership.py)."""
    from diloco.shard.ownership import ShardPlan

    return [ShardPlan(i, shards, ()).fragments(fragments) for i in range(shards)]


def write_payloads(folder: Path, layout: list[list[TensorMeta]], codec_name: str, block: int) -> dict[str, Any]:
    """One file per fragment: each tensor's encoded payload then scales, in order (exactly the data a push
    streams), and their headers. Encoded once, one tensor at a time."""
    import torch

    from diloco.codecs import get_codec

    folder.mkdir(parents=True, exist_ok=True)
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    codec = get_codec(codec_name, block)
    meta: dict[str, Any] = {"codec": codec_name, "fragments": {}}
    for p, tensors in enumerate(layout):
        gen = torch.Generator().manual_seed(1000 + p)
        path = folder / f"fragment-{p}.bin"
        entries = []
        with open(path, "wb") as out:
            for t in tensors:
                encoded = codec.encode(torch.randn(t.numel, generator=gen).mul_(DELTA_STD))
                out.write(encoded.payload)
                out.write(encoded.scales)
                entries.append({"name": t.name, "codec": encoded.codec, "shape": list(encoded.shape),
                                "block": encoded.block, "payload_bytes": len(encoded.payload),
                                "scale_bytes": len(encoded.scales)})
                del encoded
        meta["fragments"][str(p)] = {"file": str(path), "tensors": entries,
                                     "bytes": sum(e["payload_bytes"] + e["scale_bytes"] for e in entries)}
    meta_path.write_text(json.dumps(meta))
    return meta


def init_frames(layout: list[list[TensorMeta]], owned: list[int]):
    """An Init stream for the fragments `owned`: the StateHeader with the layout, then every tensor's fp32
    values, generated and sent one tensor at a time (no copy of Θ is ever held here)."""
    import torch

    from diloco.codecs import get_codec
    from diloco.transport.frames import data_frames
    from diloco.v1 import diloco_pb2 as pb

    fp32 = get_codec("fp32")
    tensors = [t for p in owned for t in layout[p]]
    header = pb.StateHeader(
        layout=[pb.FragmentLayout(index=p, tensors=[pb.TensorSpec(name=t.name, shape=[t.numel]) for t in layout[p]])
                for p in owned],
        tensors=[pb.TensorHeader(name=t.name, codec="fp32", shape=[t.numel], block=0,
                                 payload_bytes=fp32.payload_bytes(t.numel), scale_bytes=fp32.scale_bytes(t.numel, 0))
                 for t in tensors])
    yield pb.Frame(state=header)

    def values():
        for t in tensors:
            gen = torch.Generator().manual_seed(zlib.crc32(t.name.encode()))
            yield fp32.encode(torch.rand(t.numel, generator=gen).mul_(2 * THETA_RANGE).sub_(THETA_RANGE))

    yield from data_frames(values())


# ---------------------------------------------------------------- the synthetic learner (--worker)


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

    pushes: list[tuple[float, float, int]] = field(default_factory=list)
    """(sent, taken, tensor bytes) of every push the shard took."""
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
    return {"push_bytes": sum(n * overlap(a, b, w0, w1) for a, b, n in e.pushes),
            "pushes": sum(1 for a, b, _ in e.pushes if overlap(a, b, w0, w1) > 0),
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

    def read_updates(i: int) -> None:
        e = events[i]
        call = clients[i].stub.Updates(pb.UpdatesRequest(learner=me))
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
                        for seq in [q for q in e.sent if q <= ack]:
                            e.latencies.append((e.sent.pop(seq), now))
        except grpc.RpcError as exc:
            if not stop.is_set() and exc.code() != grpc.StatusCode.CANCELLED:
                with lock:
                    e.first_error = e.first_error or f"update stream: {exc.code().name} {exc.details()}"

    def push_loop(i: int, owned: list[int]) -> None:
        e, client, seq = events[i], clients[i], 0
        for p in itertools.cycle(owned):
            if stop.is_set():
                return
            seq += 1
            with lock:
                e.step += STEPS_PER_PUSH
                base = versions.get(p, 0)
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
                    if stop.wait(0.1):
                        return
                    break
                with lock:
                    e.pushes.append((started, time.time(), nbytes[p]))
                break

    def heartbeats() -> None:
        while not stop.wait(HEARTBEAT_S):
            for i, client in enumerate(clients):
                with lock:
                    step = events[i].step
                try:
                    client.heartbeat(me, tokens=step * tokens_per_step, steps=step)
                except DilocoError:
                    pass

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
    pushers = [threading.Thread(target=push_loop, args=(i, owned), daemon=True)
               for i, owned in enumerate(spec["owned"])]
    for t in pushers:
        t.start()
    while not stop_file.is_file():  # the parent ends the window
        with lock:
            taken = sum(1 for e in events for a, _, _ in e.pushes if a >= w0)
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
    os._exit(0)  # no waiting on gRPC's teardown or the update streams


# ---------------------------------------------------------------- child processes


# ---------------------------------------------------------------- memory


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """Every 0.2 s: each shard's VmRSS and VmHWM, the learners' RSS, and MemAvailable; below `min_free`,
    it kills every child of the run (the watchdog)."""

    def __init__(self, shards: list[subprocess.Popen], min_free: int, on_low: callable) -> None:
        self.shards, self.min_free, self.on_low = shards, min_free, on_low
        self.learners: list[subprocess.Popen] = []
        self.loaded = False
        """Set once the learners start: from then on, VmRSS counts towards `rss_load`."""
        self.rss_load = [0] * len(shards)
        self.rss_max = [0] * len(shards)
        self.hwm = [0] * len(shards)
        self.learners_rss = 0
        self.min_available = mem_available()
        self.low: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        for i, proc in enumerate(self.shards):
            s = proc_status(proc.pid)
            if not s:
                continue
            self.rss_max[i] = max(self.rss_max[i], s.get("VmRSS", 0))
            self.hwm[i] = max(self.hwm[i], s.get("VmHWM", 0))
            if self.loaded:
                self.rss_load[i] = max(self.rss_load[i], s.get("VmRSS", 0))
        if self.learners:
            self.learners_rss = max(self.learners_rss,
                                    sum(proc_status(p.pid).get("VmRSS", 0) for p in self.learners))
        available = mem_available()
        self.min_available = min(self.min_available, available)
        if available < self.min_free and self.low is None:
            self.low = (f"MemAvailable fell to {available / GIB:.2f} GiB (under --min-free-gib "
                        f"{self.min_free / GIB:g}); shard RSS {max(self.rss_max) / GIB:.2f} GiB: stopped")
            self.on_low()

    @contextlib.contextmanager
    def probing(self):
        """This script's own Status calls: what they cost the shard (building the report, and its
        `memory`) is no part of the load, so VmRSS meanwhile does not count towards `rss_load`."""
        loaded, self.loaded = self.loaded, False
        try:
            yield
        finally:
            self.sample()
            self.loaded = loaded

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


@dataclass
class MemoryModel:
    """A shard's peak RSS ≈ BASE + P_shard x (a + b x learners), fitted on this invocation's runs."""

    runs: list[dict[str, Any]] = field(default_factory=list)

    def coefficients(self, key: tuple) -> tuple[float, float, str]:
        points = [(r["learners"], (r["hwm_bytes"] - BASE_RSS_BYTES) / r["params_per_shard"]) for r in self.runs
                  if r["key"] == key and r["params_per_shard"] >= 5_000_000]
        a0, b0 = DEFAULT_BYTES_PER_PARAM
        if not points:
            return a0, b0, "default"
        xs = sorted({x for x, _ in points})
        if len(xs) == 1:
            x, y = xs[0], max(y for lx, y in points if lx == xs[0])
            return max(0.0, y - b0 * x), b0, f"fitted on {len(points)} run(s), learner slope default"
        mx = statistics.fmean(x for x, _ in points)
        my = statistics.fmean(y for _, y in points)
        b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
        b = max(0.0, b)
        a = max(max(y - b * x for x, y in points), 0.0)  # the upper envelope: a prediction to plan by
        return a, b, f"fitted on {len(points)} runs"

    def predict(self, key: tuple, params_per_shard: int, learners: int) -> tuple[int, str]:
        a, b, how = self.coefficients(key)
        return int(BASE_RSS_BYTES + params_per_shard * (a + b * learners)), how


# ---------------------------------------------------------------- one combination


@dataclass(frozen=True)
class Combo:
    params: int
    learners: int
    shards: int
    codec: str
    down: str
    fragments: int

    @property
    def key(self) -> tuple:
        return (self.codec, self.down, self.shards)


def syncer_sets(combo: Combo, args: argparse.Namespace) -> list[str]:
    sets = ["strategy=decoupled", f"learners.count={combo.learners}", "learners.speeds=[]",
            f"outer.fragments={combo.fragments}", f"outer.H={max(50, combo.fragments)}",
            f"outer.quorum={min(args.quorum, combo.learners)}", "outer.pacing=false", "outer.grace=0",
            f"codec.up={combo.codec}", f"codec.down={combo.down}", f"codec.block={args.block}",
            f"train.tokens={2**50}", "failures.detect_s=86400", *args.set]
    return [x for s in sets for x in ("--set", s)]


class Run:
    """Shards, learners and the measurement of one combination; `close` stops every child."""

    def __init__(self, procs: Processes, work: Path, combo: Combo, args: argparse.Namespace, payload: dict,
                 layout: list[list[TensorMeta]], console) -> None:
        self.procs, self.work, self.combo, self.args = procs, work, combo, args
        self.payload, self.layout, self.console = payload, layout, console
        self.shard_procs: list[subprocess.Popen] = []
        self.learner_procs: list[subprocess.Popen] = []
        self.clients: list = []
        self.sampler: Sampler | None = None

    def _kill_all(self) -> None:
        self.procs.kill(self.learner_procs + self.shard_procs)

    def start_shards(self) -> None:
        from diloco.transport.ports import wait_for_port
        from diloco.transport.calls import ShardClient
        from diloco.transport.security import PLAINTEXT, TransportSecurity

        n = self.combo.shards
        secret_file = None
        if not self.args.plaintext:
            secret_file = self.work / "secret"
            secret_file.write_bytes(os.urandom(24).hex().encode())
            secret_file.chmod(0o600)
        self.secret_file = secret_file
        port_files = [self.work / f"shard-{i}.port" for i in range(n)]
        shard_map = ",".join(f"127.0.0.1:@{p}" for p in port_files)
        for i, port_file in enumerate(port_files):
            argv = diloco("syncer", *syncer_sets(self.combo, self.args), "--bind", "127.0.0.1:0", "--port-file",
                          str(port_file), "--shards", shard_map, "--shard", f"{i}/{n}",
                          *(["--secret-file", str(secret_file)] if secret_file else []),
                          *(["--out", str(self.work / "state")] if self.args.journal else []))
            self.shard_procs.append(self.procs.start(argv, self.work / f"shard-{i}.log"))
        self.sampler = Sampler(self.shard_procs, int(self.args.min_free_gib * GIB), self._kill_all)
        addresses = []
        for i, (proc, port_file) in enumerate(zip(self.shard_procs, port_files)):
            try:
                port = wait_for_port(port_file, f"shard {i}", timeout_s=STARTUP_S,
                                     gone=lambda proc=proc: None if proc.poll() is None else
                                     f"exited with code {proc.returncode}")
            except Exception as exc:  # noqa: BLE001 — a one-line reason with the shard's log
                raise RuntimeError(f"shard {i} did not start: {exc}; its log ends:\n"
                                   f"{tail(self.work / f'shard-{i}.log')}") from None
            addresses.append(f"127.0.0.1:{port}")
        self.addresses = addresses
        security = TransportSecurity(secret=secret_file.read_bytes()) if secret_file else PLAINTEXT
        self.clients = [ShardClient(a, security) for a in addresses]

    def seed(self) -> float:
        """Θ of every shard, as its first learner would seed it (over the run secret)."""
        import grpc

        started = time.monotonic()
        owned = shard_fragments(self.combo.fragments, self.combo.shards)
        for i, client in enumerate(self.clients):
            try:
                reply = client.stub.Init(init_frames(self.layout, owned[i]), timeout=3600)
            except grpc.RpcError as exc:
                self._check_low()
                raise RuntimeError(f"shard {i} refused the Init: {exc.code().name} {exc.details()}; its log ends:\n"
                                   f"{tail(self.work / f'shard-{i}.log')}") from None
            if not reply.accepted:
                raise RuntimeError(f"shard {i} was seeded already")
        return time.monotonic() - started

    def start_learners(self) -> None:
        owned = shard_fragments(self.combo.fragments, self.combo.shards)
        for m in range(self.combo.learners):
            spec = {"learner": m, "addresses": self.addresses,
                    "secret_file": str(self.secret_file) if self.secret_file else None,
                    "owned": owned, "payload": self.payload, "tokens_per_step": self.args.tokens_per_step,
                    "warmup_s": self.args.warmup,
                    "go_file": str(self.work / "go"), "ready_file": str(self.work / f"ready-{m}"),
                    "stop_file": str(self.work / "stop"), "progress_file": str(self.work / f"progress-{m}"),
                    "report_file": str(self.work / f"report-{m}.json")}
            path = self.work / f"learner-{m}.json"
            path.write_text(json.dumps(spec))
            self.learner_procs.append(self.procs.start(
                [sys.executable, __file__, "--worker", str(path)], self.work / f"learner-{m}.log",
                env={"OMP_NUM_THREADS": "1"}))
        self.sampler.learners = list(self.learner_procs)
        deadline = time.monotonic() + STARTUP_S
        while not all((self.work / f"ready-{m}").is_file() for m in range(self.combo.learners)):
            self._check_children()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the learners did not join within {STARTUP_S:g} s")
            time.sleep(0.05)

    def _check_low(self) -> None:
        if self.sampler is not None and self.sampler.low:
            raise MemoryError(self.sampler.low)

    def _check_children(self) -> None:
        self._check_low()
        for i, proc in enumerate(self.shard_procs):
            if proc.poll() is not None:
                raise RuntimeError(f"shard {i} exited with code {proc.returncode}; its log ends:\n"
                                   f"{tail(self.work / f'shard-{i}.log')}")
        for m, proc in enumerate(self.learner_procs):
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"learner {m} exited with code {proc.returncode}; its log ends:\n"
                                   f"{tail(self.work / f'learner-{m}.log')}")

    def _sleep_until(self, t: float) -> None:
        while (left := t - time.time()) > 0:
            self._check_children()
            time.sleep(min(left, 0.1))

    def measure(self) -> dict[str, Any]:
        """Go; warm up; a window of at least --seconds that also holds --min-pushes pushes taken per
        shard (at most --max-seconds); then the learners' reports and each shard's Status."""
        args = self.args
        t0 = time.time() + 0.5
        (self.work / "go.tmp").write_text(repr(t0))
        (self.work / "go.tmp").rename(self.work / "go")
        self._sleep_until(t0)
        self.sampler.loaded = True
        w0 = t0 + args.warmup
        self._sleep_until(w0 + args.seconds)
        wanted = args.min_pushes * self.combo.shards
        while time.time() < w0 + args.max_seconds and self._progress() < wanted:
            self._sleep_until(time.time() + 0.2)
        w1 = time.time()
        self.sampler.sample()
        self.sampler.loaded = False  # the window is over: what the shards do next is not load
        (self.work / "stop.tmp").write_text(repr(w1))
        (self.work / "stop.tmp").rename(self.work / "stop")
        deadline = time.monotonic() + PUSH_BOUND_S + DRAIN_S + 60
        while not all((self.work / f"report-{m}.json").is_file() for m in range(self.combo.learners)):
            self._check_children()
            if time.monotonic() > deadline:
                raise RuntimeError("the learners did not report after the window")
            time.sleep(0.05)
        reports = [json.loads((self.work / f"report-{m}.json").read_text()) for m in range(self.combo.learners)]
        statuses = []
        with self.sampler.probing():  # the learners are done: the shards answer at once
            for c in self.clients:
                try:
                    status = c.status(timeout_s=120)
                    statuses.append({"rounds": status.rounds, "alive": list(status.alive),
                                     "report": json.loads(status.report_json)})
                except Exception as exc:  # noqa: BLE001 — the figures stand without it
                    statuses.append({"error": str(exc)})
        return {"window": (w0, w1), "reports": reports, "statuses": statuses}

    def _progress(self) -> int:
        """Pushes taken since the window opened, summed over the learners' progress files."""
        total = 0
        for m in range(self.combo.learners):
            with contextlib.suppress(OSError, ValueError):
                total += int((self.work / f"progress-{m}").read_text())
        return total

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()
        self.procs.stop(self.learner_procs, grace_s=5.0, sig=signal.SIGKILL)
        self.procs.stop(self.shard_procs, grace_s=10.0)
        if self.sampler is not None:
            self.sampler.close()


TCP_SINK = str(Path(__file__).with_name("tcp_sink.py"))
"""The plain TCP sink `benchmarks/runtime.py` measures against too."""


def socket_baseline(procs: Processes, work: Path, payload_file: str, seconds: float) -> dict[str, float]:
    """One fragment's encoded push as messages over a plain TCP socket, request/response, for `seconds`."""
    proc = procs.start([sys.executable, TCP_SINK], work / "tcp-sink.log", stdout_pipe=True)
    try:
        line = proc.stdout.readline()
        if not line.strip():
            raise RuntimeError(f"the TCP sink did not start: {tail(work / 'tcp-sink.log')}")
        with open(payload_file, "rb") as f, socket.create_connection(("127.0.0.1", int(line))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                head, body = struct.pack("!Q", len(data)), memoryview(data)

                def send() -> None:
                    sock.sendall(head)
                    sock.sendall(body)
                    if sock.recv(1) != b"\x01":
                        raise RuntimeError("the TCP sink closed the connection")

                send()  # warm-up
                messages, started = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - started) < seconds or messages == 0:
                    send()
                    messages += 1
                elapsed = time.perf_counter() - started
                body.release()
            finally:
                data.close()
        size = struct.unpack("!Q", head)[0]
        return {"message_bytes": size, "messages": messages, "seconds": elapsed,
                "mb_s": messages * size / elapsed / MB}
    finally:
        procs.stop([proc], grace_s=2.0, sig=signal.SIGKILL)


def summarize(combo: Combo, m: dict[str, Any], sampler: Sampler) -> dict[str, Any]:
    """Per shard and in all: MB/s, latencies, rounds/s, memory."""
    w0, w1 = m["window"]
    seconds = w1 - w0
    per_shard = []
    all_latencies: list[float] = []
    problems = []
    for i in range(combo.shards):
        rows = [r["shards"][i] for r in m["reports"]]
        latencies = sorted(x for r in rows for x in r["latencies"])
        all_latencies += latencies
        status = m["statuses"][i]
        report = status.get("report", {})
        memory = report.get("memory")
        refused, busy, unanswered = (sum(r[k] for r in rows) for k in ("refused", "busy", "unanswered"))
        errors = [r["first_error"] for r in rows if r["first_error"]]
        if refused or errors:
            problems.append(f"shard {i}: {refused} pushes refused, {busy} busy; {errors[0] if errors else ''}")
        if unanswered:
            problems.append(f"shard {i}: {unanswered} pushes of the window unanswered")
        if "error" in status:
            problems.append(f"shard {i}: no Status after the window ({status['error']})")
        elif len(status["alive"]) < combo.learners:
            problems.append(f"shard {i}: only {len(status['alive'])} of {combo.learners} learners alive at the end")
        rounds = {tuple(x) for r in rows for x in r["rounds"]}
        per_shard.append({
            "shard": i, "fragments": report.get("fragments"),
            "rss_bytes": sampler.rss_load[i], "hwm_bytes": sampler.hwm[i],
            "theta_bytes": memory.get("theta_bytes") if isinstance(memory, dict) else None, "memory": memory,
            "push_mb_s": sum(r["push_bytes"] for r in rows) / seconds / MB,
            "pull_mb_s": sum(r["pull_bytes"] for r in rows) / seconds / MB,
            "pushes": sum(r["pushes"] for r in rows), "answers": sum(r["answers"] for r in rows),
            "unanswered": unanswered, "refused": refused, "busy": busy,
            "push_errors": report.get("push_errors"),
            "latency_median_s": statistics.median(latencies) if latencies else None,
            "latency_p95_s": percentile(latencies, 0.95),
            "rounds_per_s": len(rounds) / seconds,
        })
    all_latencies.sort()
    largest = max(range(combo.shards), key=lambda i: per_shard[i]["rss_bytes"])
    return {
        "seconds": seconds,
        "push_mb_s": sum(s["push_mb_s"] for s in per_shard), "pull_mb_s": sum(s["pull_mb_s"] for s in per_shard),
        "rss_bytes": per_shard[largest]["rss_bytes"], "hwm_bytes": max(s["hwm_bytes"] for s in per_shard),
        "theta_bytes": per_shard[largest]["theta_bytes"], "memory": per_shard[largest]["memory"],
        "latency_median_s": statistics.median(all_latencies) if all_latencies else None,
        "latency_p95_s": percentile(all_latencies, 0.95),
        "rounds_per_s": sum(s["rounds_per_s"] for s in per_shard),
        "learners_rss_bytes": sampler.learners_rss, "min_available_bytes": sampler.min_available,
        "problems": problems, "per_shard": per_shard,
    }


def percentile(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def run_combo(procs: Processes, root: Path, combo: Combo, args: argparse.Namespace, model: MemoryModel,
              console) -> dict[str, Any]:
    layout = model_layout(combo.params, combo.fragments, args.max_tensor)
    owned = shard_fragments(combo.fragments, combo.shards)
    per_shard_params = max(sum(t.numel for p in o for t in layout[p]) for o in owned)
    record: dict[str, Any] = {
        "params": combo.params, "learners": combo.learners, "shards": combo.shards, "codec": combo.codec,
        "down_codec": combo.down, "fragments": combo.fragments, "params_per_shard": per_shard_params,
        "seconds": args.seconds, "warmup_s": args.warmup, "journal": args.journal, "secret": not args.plaintext,
        "quorum": min(args.quorum, combo.learners), "key": combo.key, "status": "ok", "reason": "",
        "rss_bytes": None, "push_mb_s": None, "pull_mb_s": None, "socket_mb_s": None, "push_vs_socket": None,
    }
    predicted, how = model.predict(combo.key, per_shard_params, combo.learners)
    need = predicted * combo.shards + combo.learners * LEARNER_RSS_BYTES
    available = mem_available()
    record["predicted_peak_bytes"] = predicted
    margin = int(args.min_free_gib * GIB)
    if need > available - margin:
        why = (f"needs ~{need / GIB:.1f} GiB ({combo.shards} shard(s) of ~{predicted / GIB:.1f} GiB, {how}; "
               f"{combo.learners} learners), {available / GIB:.1f} GiB available, "
               f"{args.min_free_gib:g} GiB to keep free")
        if not args.force:
            record.update(status="skipped", reason=why + " (--force runs it anyway)")
            return record
        console.print(f"[yellow]running anyway (--force): {why}[/]")
    name = f"payload-{combo.codec}-{args.block}-{combo.params}-{combo.fragments}-{args.max_tensor}"
    payload = write_payloads(root / name, layout, combo.codec, args.block)
    work = root / (f"run-{combo.params}-{combo.learners}l-{combo.shards}s-{combo.codec}-{combo.down}")
    work.mkdir(parents=True, exist_ok=True)
    run = Run(procs, work, combo, args, payload, layout, console)
    try:
        run.start_shards()
        record["seed_s"] = run.seed()
        run.start_learners()
        measured = run.measure()
    except MemoryError as exc:
        record.update(status="aborted", reason=str(exc))
        measured = None
    except Exception as exc:  # noqa: BLE001 — this combination failed: say why, go on with the next
        if run.sampler is not None and run.sampler.low:
            record.update(status="aborted", reason=run.sampler.low)
        else:
            record.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
        measured = None
    finally:
        run.close()
    sampler = run.sampler
    record["hwm_bytes"] = max(sampler.hwm) if sampler else None
    if measured is None:
        record["rss_bytes"] = max(sampler.rss_max) if sampler else None
        if record["status"] == "aborted":  # it needed more than it had reached
            model.runs.append({**record, "hwm_bytes": max(record["hwm_bytes"] or 0, predicted)})
        return record
    record.update(summarize(combo, measured, sampler))
    model.runs.append(record)
    largest_fragment = max(payload["fragments"].values(), key=lambda f: f["bytes"])
    try:
        sock = socket_baseline(procs, work, largest_fragment["file"], args.socket_seconds)
    except (OSError, RuntimeError) as exc:
        record["problems"].append(f"no socket baseline: {exc}")
        return record
    record["socket_mb_s"] = sock["mb_s"]
    record["message_bytes"] = sock["message_bytes"]
    record["push_vs_socket"] = max(s["push_mb_s"] for s in record["per_shard"]) / sock["mb_s"]
    return record


# ---------------------------------------------------------------- report


def gib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / GIB:.2f}"


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f}"


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "n/a" if x is None else format(x, spec)


def human(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size and n % (size // 1000 or 1) == 0:
            return f"{n / size:g}{unit}"
    return str(n)


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets, per group of runs that differ only in the learner count."""
    rows = []
    ok = [r for r in runs if r["status"] == "ok"]
    groups: dict[tuple, dict[int, dict]] = {}
    for r in ok:
        group = (r["params"], r["shards"], r["codec"], r["down_codec"], r["fragments"])
        groups.setdefault(group, {})[r["learners"]] = r
    for (params, shards, codec, down, fragments), by in sorted(groups.items()):
        where = f"{human(params)} params, {shards} shard(s), {codec}"
        one = by.get(1)
        if one is not None:
            bigger = [n for n in by if n > 1]
            if bigger:
                n = 16 if 16 in by else max(bigger)
                value = by[n]["rss_bytes"] / one["rss_bytes"]
                rows.append({"where": where, "measure": f"syncer RSS, {n} learners / 1 learner", "value": value,
                             "target": f"≤ {RSS_RATIO_TARGET}" + ("" if n == 16 else " (stated for 16)"),
                             "met": value <= RSS_RATIO_TARGET if n == 16 else None})
            if one.get("push_vs_socket") is not None:
                rows.append({"where": where, "measure": "push MB/s of one shard (1 learner) / plain socket",
                             "value": one["push_vs_socket"], "target": f"≥ {SOCKET_RATIO_TARGET}",
                             "met": one["push_vs_socket"] >= SOCKET_RATIO_TARGET})
            if 8 in by:
                for what in ("push", "pull"):
                    base = one[f"{what}_mb_s"]
                    value = by[8][f"{what}_mb_s"] / base if base else None
                    rows.append({"where": where, "measure": f"a shard's {what} MB/s, 8 learners / 1 learner",
                                 "value": value, "target": f"≥ {SCALING_TARGET}",
                                 "met": value is not None and value >= SCALING_TARGET})
        # the best a shard did against the socket, at any learner count
        best = max(by.values(), key=lambda r: r.get("push_vs_socket") or 0)
        if best.get("push_vs_socket") is not None and (one is None or best is not one):
            rows.append({"where": where, "measure": f"push MB/s of one shard ({best['learners']} learners, the best) "
                                                    "/ plain socket", "value": best["push_vs_socket"],
                         "target": "", "met": None})
    return rows


def print_report(console, runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="runs (MB = 10^6 bytes of tensor payload; RSS of the largest shard, under load)")
    for col in ("params", "learners", "shards", "codec", "push MB/s", "pull MB/s", "socket MB/s", "push/socket",
                "RSS GiB", "HWM GiB", "Θ held GiB", "lat p50 ms", "lat p95 ms", "rounds/s", "status"):
        table.add_column(col, justify="right")
    for r in runs:
        status = r["status"] if r["status"] != "ok" else ("[yellow]problems[/]" if r.get("problems") else "ok")
        table.add_row(human(r["params"]), str(r["learners"]), str(r["shards"]),
                      r["codec"] + ("" if r["down_codec"] == r["codec"] else f"/{r['down_codec']}"),
                      fmt(r["push_mb_s"]), fmt(r["pull_mb_s"]), fmt(r["socket_mb_s"]), fmt(r["push_vs_socket"], ".3g"),
                      gib(r["rss_bytes"]), gib(r.get("hwm_bytes")), gib(r.get("theta_bytes")),
                      ms(r.get("latency_median_s")), ms(r.get("latency_p95_s")), fmt(r.get("rounds_per_s"), ".1f"),
                      status)
    console.print(table)
    for r in runs:
        if r["status"] != "ok":
            console.print(f"[yellow]{human(r['params'])} params, {r['learners']} learners, {r['shards']} shard(s), "
                          f"{r['codec']}: {r['status']}: {r['reason']}[/]")
        for p in r.get("problems") or []:
            console.print(f"[yellow]{human(r['params'])} params, {r['learners']} learners: {p}[/]")

    shards = Table(title="per shard")
    for col in ("params", "learners", "shard", "fragments", "push MB/s", "pull MB/s", "RSS GiB", "HWM GiB",
                "Θ GiB", "optimizer GiB", "accumulating GiB", "downlink GiB", "total GiB", "lat p50 ms",
                "lat p95 ms", "rounds/s", "pushes", "busy"):
        shards.add_column(col, justify="right")
    for r in runs:
        for s in r.get("per_shard") or []:
            mem = s["memory"] if isinstance(s["memory"], dict) else {}
            shards.add_row(human(r["params"]), str(r["learners"]), str(s["shard"]),
                           ",".join(map(str, s["fragments"] or [])), fmt(s["push_mb_s"]), fmt(s["pull_mb_s"]),
                           gib(s["rss_bytes"]), gib(s["hwm_bytes"]),
                           *(gib(mem.get(k)) for k in ("theta_bytes", "optimizer_bytes", "accumulating_bytes",
                                                       "downlink_bytes", "total_bytes")),
                           ms(s["latency_median_s"]), ms(s["latency_p95_s"]), fmt(s["rounds_per_s"], ".1f"),
                           str(s["pushes"]), str(s["busy"]))
    console.print(shards)

    rows = targets(runs)
    table = Table(title="targets")
    for col in ("runs", "measure", "value", "target", ""):
        table.add_column(col, justify="right" if col in ("value", "target") else "left")
    for row in rows:
        met = "" if row["met"] is None else ("[green]met[/]" if row["met"] else "[red]not met[/]")
        table.add_row(row["where"], row["measure"], fmt(row["value"], ".3g"), row["target"], met)
    if not rows:
        table.add_row("", "(no targets: runs with 1 learner and with 8 or 16 are needed)", "", "", "")
    console.print(table)


# ---------------------------------------------------------------- main


def count(text: str) -> int:
    """20000000, 20M, 1B, 1e9, 1_000_000."""
    t = text.strip().replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}.get(t[-1:].lower())
    value = float(t[:-1]) * scale if scale else float(t)
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole count: {text!r}")
    return int(value)


def counts(text: str) -> list[int]:
    try:
        return [count(x) for x in text.split(",") if x.strip()]
    except (argparse.ArgumentTypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of counts, got {text!r}") from None


def interrupted(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=counts, default=[20_000_000], help="parameter counts (20M, 1B, ...)")
    parser.add_argument("--learners", type=counts, default=[1, 4, 8, 16], help="learner counts")
    parser.add_argument("--shards", type=counts, default=[1], help="shard counts")
    parser.add_argument("--codec", default="int4", help="codecs of the pushes (fp32, bf16, int8, int4, fp4)")
    parser.add_argument("--down-codec", help="codec of the answers (default: the push codec)")
    parser.add_argument("--block", type=int, default=64, help="elements per scale of int8, int4, fp4")
    parser.add_argument("--fragments", type=int, help="fragments of the model (default max(4, 2 x shards))")
    parser.add_argument("--max-tensor", type=count, default=16 * 2**20, help="most elements per tensor")
    parser.add_argument("--seconds", type=float, default=10.0, help="shortest measurement window")
    parser.add_argument("--min-pushes", type=int, default=8, help="the window also lasts until this many pushes "
                        "per shard were taken in it ...")
    parser.add_argument("--max-seconds", type=float, default=180.0, help="... or this long")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of pushing before the window")
    parser.add_argument("--socket-seconds", type=float, default=3.0, help="plain-socket baseline per run")
    parser.add_argument("--quorum", type=int, default=1, help="outer.quorum (1: each push closes its round)")
    parser.add_argument("--tokens-per-step", type=int, default=4096, help="declared at join")
    parser.add_argument("--journal", action="store_true", help="give the shards a state folder (--out): they "
                        "journal every push and save their state every 10 s, as under `diloco run`")
    parser.add_argument("--plaintext", action="store_true", help="no shared secret (identity not enforced)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more syncer config")
    parser.add_argument("--min-free-gib", type=float, default=2.0,
                        help="skip a run predicted to leave less MemAvailable; stop one that does")
    parser.add_argument("--force", action="store_true", help="run combinations predicted not to fit (the "
                        "watchdog still stops them)")
    parser.add_argument("--json", type=Path, help="write the list of runs here")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep logs and payload files in DIR")
    args = parser.parse_args(argv)
    from diloco.codecs import CODEC_NAMES

    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    for c in codecs + ([args.down_codec] if args.down_codec else []):
        if c not in CODEC_NAMES:
            parser.error(f"unknown codec {c!r}: one of {', '.join(CODEC_NAMES)}")
    if args.seconds <= 0 or args.warmup < 0 or args.max_seconds < args.seconds:
        parser.error("--seconds must be positive, --warmup not negative, --max-seconds at least --seconds")
    combos = []
    for params, shards, codec in itertools.product(sorted(args.params), sorted(args.shards), codecs):
        fragments = args.fragments or max(4, 2 * shards)
        if shards > fragments:
            parser.error(f"{shards} shards but {fragments} fragments: every shard needs one")
        if params < fragments:
            parser.error(f"{params} parameters cannot make {fragments} fragments")
        for learners in sorted(args.learners):
            combos.append(Combo(params, learners, shards, codec, args.down_codec or codec, fragments))

    from rich.console import Console

    console = Console(width=max(Console().width, 160))
    procs = Processes()
    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    # (SIGINT too: a script started in the background finds it ignored)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        root_dir = argparse.Namespace(name=tempfile.mkdtemp(prefix="diloco-scale-", dir=args.keep), cleanup=lambda: 0)
    else:
        root_dir = tempfile.TemporaryDirectory(prefix="diloco-scale-", ignore_cleanup_errors=True)
    root = Path(root_dir.name)
    model = MemoryModel()
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    interrupted_by = None
    try:
        for k, combo in enumerate(combos):
            console.print(f"[{k + 1}/{len(combos)}] {human(combo.params)} params, {combo.learners} learners, "
                          f"{combo.shards} shard(s), {combo.codec}/{combo.down}, {combo.fragments} fragments ...")
            record = run_combo(procs, root, combo, args, model, console)
            runs.append(record)
            if record["status"] == "ok":
                console.print(f"    push {record['push_mb_s']:.0f} MB/s, pull {record['pull_mb_s']:.0f} MB/s, "
                              f"socket {fmt(record['socket_mb_s'])} MB/s, RSS {gib(record['rss_bytes'])} GiB, "
                              f"p50 {ms(record['latency_median_s'])} ms"
                              + (f" [yellow]({'; '.join(record['problems'])})[/]" if record["problems"] else ""))
            else:
                console.print(f"    [yellow]{record['status']}: {record['reason']}[/]")
    except KeyboardInterrupt:
        console.print("interrupted: stopping every child")
        interrupted_by = 130
    finally:
        procs.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if args.keep:
            console.print(f"logs and payloads kept in {root}")
        else:
            root_dir.cleanup()
    for r in runs:
        r["key"] = list(r["key"])
    if runs:
        print_report(console, runs)
    if args.json and runs:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
        console.print(f"wrote {args.json}" + (" (the runs done before the interruption)" if interrupted_by else ""))
    console.print(f"{time.monotonic() - started:.0f} s on {os.cpu_count()} CPUs")
    return interrupted_by or 0


if __name__ == "__main__":
    sys.exit(main())
