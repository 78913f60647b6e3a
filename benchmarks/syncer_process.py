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
def syncer_process(settings: list[str], start_timeout_s: float = 120.0) -> Iterator[int]:
    """The port of a one-shard syncer started with `settings` (KEY=VALUE overrides); stopped on exit."""
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
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
