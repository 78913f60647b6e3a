"""Where a process's CPU goes, by Python frame: each thread's own CPU time charged to where it stands.

Why: a profile by wall time counts a thread blocked on a lock or a socket as if it worked, `perf` does not
see Python 3.11's frames, and py-spy is not on every host. This sampler reads, every `period_s`, each
thread's CPU clock (`time.pthread_getcpuclockid`) and its Python stack, and charges the CPU the thread spent
since the last sample to the frame it stands in (`leaf`, with its caller) and to every frame on its stack
(`inclusive`). Over many samples each frame gets its share of the process's CPU, within the sampling's
statistics; a thread that spent its CPU in one frame and moved on just before a sample charges the next one.
Threads that never ran Python (a C library's own, such as gRPC's pollers) are not seen: the profile's
`cpu_s` against the process's CPU says how much that is.

A shard runs one when `DILOCO_CPU_PROFILE` names a file (`benchmarks/scale.py --profile` sets it): the
counters, cumulative, are written there as JSON every `WRITE_EVERY_S` and at exit, so that a reader can take
the difference of two snapshots for the window it measures (`difference`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

PROFILE_ENV = "DILOCO_CPU_PROFILE"
PERIOD_S = 0.002
WRITE_EVERY_S = 0.25
TOP = 40
"""Frames a window's shares list, per kind; the rest are summed as `(other)`."""

log = logging.getLogger("diloco.cpu_profile")


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


class CpuProfile:
    """Samples every thread of this process but its own (see the module's docstring)."""

    def __init__(self, period_s: float = PERIOD_S) -> None:
        self.period_s = period_s
        self.leaf: Counter[str] = Counter()
        self.inclusive: Counter[str] = Counter()
        self.cpu_ns = 0
        self._last: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def available() -> bool:
        return hasattr(time, "pthread_getcpuclockid")

    def sample(self) -> None:
        """One sample: each other thread's CPU since the last one, charged to its stack now."""
        me = threading.get_ident()
        seen = {}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            try:
                now = time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
            except (OSError, OverflowError):  # the thread ended since its frame was taken
                continue
            seen[ident] = now
            spent = now - self._last.get(ident, now)
            if spent <= 0:
                continue
            self.cpu_ns += spent
            names = []
            while frame is not None:
                names.append(_where(frame))
                frame = frame.f_back
            self.leaf[f"{names[0]} <- {names[1]}" if len(names) > 1 else names[0]] += spent
            for name in set(names):
                self.inclusive[name] += spent
        self._last = seen

    def snapshot(self) -> dict:
        """The cumulative counters, in ns, every frame's (a window is the difference of two of them)."""
        return {"unix": time.time(), "cpu_ns": self.cpu_ns, "leaf": dict(self.leaf), "inclusive": dict(self.inclusive)}

    def start(self, path: Path | None = None) -> bool:
        """Sample on a daemon thread from now; with `path`, write snapshots there. False where this host's
        threads have no CPU clocks to read."""
        if not self.available():
            log.warning("no per-thread CPU clocks on this platform: no CPU profile")
            return False

        def run() -> None:
            written = time.monotonic()
            while not self._stop.wait(self.period_s):
                self.sample()
                if path is not None and time.monotonic() - written >= WRITE_EVERY_S:
                    self.write(path)
                    written = time.monotonic()

        self._thread = threading.Thread(target=run, name="cpu-profile", daemon=True)
        self._thread.start()
        if path is not None:
            atexit.register(self._write_at_exit, path)
        return True

    def _write_at_exit(self, path: Path) -> None:
        self.stop()  # no sample may change the counters while they are written
        try:
            self.write(path)
        except OSError:  # its folder went first: nobody is left to read it
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def write(self, path: Path) -> None:
        """The snapshot, replacing the file whole: a reader never sees half of one."""
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps(self.snapshot()))
        os.replace(part, path)


def start_from_env() -> CpuProfile | None:
    """Start a profile of this process if `DILOCO_CPU_PROFILE` names a file to write it to."""
    target = os.environ.get(PROFILE_ENV)
    if not target:
        return None
    profile = CpuProfile()
    return profile if profile.start(Path(target)) else None


def difference(later: dict, earlier: dict | None) -> dict:
    """What two snapshots of one profile say of the time between them: CPU-seconds and each frame's share of
    them, the TOP largest first and the rest as `(other)`."""
    cpu = later["cpu_ns"] - (earlier["cpu_ns"] if earlier else 0)

    def shares(kind: str) -> list[list]:
        before = earlier[kind] if earlier else {}
        spent = sorted(((name, ns - before.get(name, 0)) for name, ns in later[kind].items()), key=lambda x: -x[1])
        kept = [[name, round(ns / cpu, 4)] for name, ns in spent[:TOP] if ns > 0]
        rest = sum(ns for _, ns in spent[TOP:])
        return kept + [["(other)", round(rest / cpu, 4)]] if rest > 0 else kept

    if cpu <= 0:
        return {"cpu_s": 0.0, "leaf": [], "inclusive": []}
    return {"cpu_s": cpu / 1e9, "leaf": shares("leaf"), "inclusive": shares("inclusive")}
