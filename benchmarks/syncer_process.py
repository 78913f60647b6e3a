"""A `diloco syncer` process of its own for a benchmark's learner, as in a deployment: the shard's merges
and answers share no interpreter (and no GIL) with the training loop being timed. In a deployment the
syncer runs on other hosts; here it shares the learner's cores, so it gets one thread for its arithmetic
(`OMP_NUM_THREADS=1`) rather than a pool as large as the learner's."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


@contextlib.contextmanager
def syncer_process(settings: list[str], start_timeout_s: float = 120.0,
                   usage: dict[str, float] | None = None) -> Iterator[int]:
    """The port of a one-shard syncer started with `settings` (KEY=VALUE overrides); stopped on exit. With
    `usage`, its `cpu_s` is set on exit to the CPU seconds the process spent (user + system, all threads)."""
    with tempfile.TemporaryDirectory(prefix="bench-syncer-") as folder:
        port_file = Path(folder) / "port"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
        overrides = [x for setting in settings for x in ("--set", setting)]
        process = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", "--bind", "127.0.0.1:0", "--port-file",
                                    str(port_file), "--out", str(Path(folder) / "out"), *overrides], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not port_file.exists() or not port_file.read_text().strip():
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    raise SystemExit(f"the syncer process did not start (exit code {process.poll()}): "
                                     f"{process.stderr.read()[-2000:] if process.stderr else ''}")
                time.sleep(0.05)
            yield int(port_file.read_text())
        finally:
            if usage is not None:
                usage["cpu_s"] = process_cpu_s(process.pid)  # before it is stopped: its work is done
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a live process has spent so far, from /proc (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
