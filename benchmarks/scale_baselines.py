"""scale.py's baselines, measured in the same invocation as the runs they are compared with: the shards'
CPU time, the roofline of a merge (one fused in-place pass over a fragment), and the plain TCP socket; and
what a shard says it did (`rounds_closed`)."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from children import Processes, tail  # benchmarks/children.py
from scale_model import MB

TCP_SINK = str(Path(__file__).with_name("tcp_sink.py"))
"""The plain TCP sink `benchmarks/runtime.py` measures against too."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads, so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def roofline_ns_per_param(numel: int, repeats: int = 5) -> float:
    """One fused read-modify-write pass over fp32 tensors of `numel` elements (Θ += w·Δ, in place, one
    thread): the least CPU a merge of one pushed parameter can cost on this host. The best of `repeats`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        theta, delta = torch.rand(numel), torch.rand(numel)
        theta.add_(delta, alpha=0.5)  # pages touched once before timing
        best = float("inf")
        for _ in range(repeats):
            started = time.process_time_ns()
            theta.add_(delta, alpha=0.5)
            best = min(best, (time.process_time_ns() - started) / numel)
        return best
    finally:
        torch.set_num_threads(threads)


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


def percentile(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def rounds_closed(client: Any) -> int | None:
    """A shard's rounds closed so far (its Status), None where it did not answer: pushes per round is then
    left out, the rest of the run stands."""
    try:
        return client.status(timeout_s=30).rounds
    except Exception:  # noqa: BLE001
        return None
