"""runtime.py's (c): the transport on loopback, gRPC against a plain TCP socket, for the same messages."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from children import Processes, diloco, tail  # benchmarks/children.py


TCP_SINK = str(Path(__file__).with_name("tcp_sink.py"))
"""The plain TCP sink, a script of its own (`benchmarks/scale.py` runs it too)."""


# ---------------------------------------------------------------- (c): transport on loopback


class GrpcPath:
    """A `diloco syncer` subprocess owning one fragment, seeded with one tensor of the fragment's size."""

    def __init__(self, procs: Processes, work: Path, numel: int) -> None:
        import torch

        from diloco.codecs import get_codec
        from diloco.errors import DilocoError
        from diloco.transport.ports import wait_for_port
        from diloco.transport.calls import ShardClient
        from diloco.transport.frames import tensor_header
        from diloco.v1 import diloco_pb2 as pb

        self.pb = pb
        log, port_file = work / "syncer.log", work / "syncer.port"
        self.proc = procs.start(diloco("syncer", "--bind", "127.0.0.1:0", "--port-file", str(port_file),
                                       "--set", "strategy=decoupled", "--set", "outer.fragments=1",
                                       "--set", "outer.quorum=0"), log)
        try:  # it binds port 0 and reports the port it got
            port = wait_for_port(port_file, "diloco syncer", gone=lambda: None if self.proc.poll() is None else
                                 f"exited with code {self.proc.returncode}")
        except DilocoError as exc:
            raise RuntimeError(f"{exc}; {log} ends:\n{tail(log)}") from None
        self.client = ShardClient(f"127.0.0.1:{port}")
        reply = self.client.join(0)
        self.learner = reply.learner
        layout = [pb.FragmentLayout(index=0, tensors=[pb.TensorSpec(name="w", shape=[numel])])]
        if not self.client.init(layout, {"w": torch.zeros(numel)}):
            raise RuntimeError("the syncer was seeded already")
        versions = self.client.pull(self.learner, after_seq=reply.last_seq).versions
        self.version, self.seq = versions[0], reply.last_seq
        gen = torch.Generator().manual_seed(0)
        self.tensors = {"w": get_codec("fp32").encode(torch.randn(numel, generator=gen) * 1e-3)}
        self.header_tensors = [tensor_header(name, e) for name, e in self.tensors.items()]
        self.message_bytes = len(self.tensors["w"].payload)

    def send(self) -> None:
        self.seq += 1
        header = self.pb.PushHeader(learner=self.learner, fragment=0, base_version=self.version, seq=self.seq,
                                    tokens=0, steps=0, sent_at=time.time(), tensors=self.header_tensors)
        self.client.push(header, self.tensors)

    def close(self) -> None:
        self.client.close()


class TcpPath:
    """A plain socket to a Python subprocess that reads each message, discards it and acks it."""

    def __init__(self, procs: Processes, work: Path, message_bytes: int) -> None:
        import socket
        import struct

        log = work / "tcp-sink.log"
        self.proc = procs.start([sys.executable, TCP_SINK], log, stdout_pipe=True)
        line = self.proc.stdout.readline()
        if not line.strip():
            self.proc.wait(timeout=10)
            raise RuntimeError(f"the TCP sink did not start; {log} ends:\n{tail(log)}")
        self.sock = socket.create_connection(("127.0.0.1", int(line)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload = struct.pack("!Q", message_bytes) + os.urandom(message_bytes)
        self.message_bytes = message_bytes

    def send(self) -> None:
        self.sock.sendall(self.payload)
        if self.sock.recv(1) != b"\x01":
            raise RuntimeError("the TCP sink closed the connection")

    def close(self) -> None:
        self.sock.close()


def throughput(path, messages: int, warmup: int = 2) -> dict[str, float]:
    for _ in range(warmup):
        path.send()
    started = time.perf_counter()
    for _ in range(messages):
        path.send()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "bytes": messages * path.message_bytes,
            "mb_per_s": messages * path.message_bytes / seconds / 1e6}


def transport(procs: Processes, work: Path, total_mib: int, fragment_mib: int, repeats: int,
              console: Console) -> dict[str, Any]:
    numel = fragment_mib * (1 << 20) // 4
    messages = max(1, total_mib // fragment_mib)
    grpc_path = GrpcPath(procs, work, numel)
    tcp_path = TcpPath(procs, work, grpc_path.message_bytes)
    runs = []
    try:
        for r in range(repeats):
            g = throughput(grpc_path, messages)
            t = throughput(tcp_path, messages)
            runs.append({"repeat": r + 1, "grpc": g, "tcp": t, "ratio": g["mb_per_s"] / t["mb_per_s"]})
            console.print(f"transport {r + 1}/{repeats}: gRPC Push {g['mb_per_s']:.0f} MB/s, "
                          f"plain TCP {t['mb_per_s']:.0f} MB/s ({g['mb_per_s'] / t['mb_per_s']:.2f}x)")
    finally:
        grpc_path.close()
        tcp_path.close()
        procs.stop([grpc_path.proc, tcp_path.proc], grace_s=30.0)
    return {"message_bytes": grpc_path.message_bytes, "messages": messages, "runs": runs,
            "grpc_mb_per_s": statistics.median(x["grpc"]["mb_per_s"] for x in runs),
            "tcp_mb_per_s": statistics.median(x["tcp"]["mb_per_s"] for x in runs),
            "ratio": statistics.median(x["ratio"] for x in runs)}
