"""How fast gRPC alone streams bytes here, against a plain socket: the ceiling any gRPC transport of Θ has.

A server process streams `--megabytes` of prebuilt 1 MiB `bytes` messages (no framing of ours, no tensors,
no serialization) to a client in this process that only counts them; then a plain TCP socket sends the
same bytes as 1 MiB `sendall`s to `recv_into` one buffer. Each is timed `--repeats` times, taking turns,
best kept. `grpc_vs_socket` is the gRPC time over the socket's: where it exceeds 2, no transport of Θ over
gRPC meets `join_vs_socket` ≤ 2 on this host, whatever our framing does.

    python benchmarks/grpc_ceiling.py [--megabytes 80] [--repeats 7] [--json benchmarks/results/grpc_ceiling.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

MB = 1 << 20
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def serve(megabytes: int) -> None:
    """The other process: a gRPC server streaming `megabytes` MiB per call, and a socket sending as much
    per byte it reads; prints both ports."""
    payload = os.urandom(MB)

    def pull(request: bytes, context: grpc.ServicerContext):
        for _ in range(megabytes):
            yield payload

    server = grpc.server(futures.ThreadPoolExecutor(2), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "ceiling", {"Pull": grpc.unary_stream_rpc_method_handler(pull)}),))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    print(grpc_port, listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    while conn.recv(1):
        for _ in range(megabytes):
            conn.sendall(payload)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megabytes", type=int, default=80)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "grpc_ceiling.json")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.megabytes)
        return
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--megabytes", str(args.megabytes)],
                             stdout=subprocess.PIPE, text=True)
    try:
        grpc_port, socket_port = map(int, child.stdout.readline().split())
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=OPTIONS)
        call = channel.unary_stream("/ceiling/Pull")
        sock = socket.create_connection(("127.0.0.1", socket_port))
        buffer = memoryview(bytearray(MB))
        total = args.megabytes * MB

        def over_grpc() -> None:
            assert sum(len(m) for m in call(b"")) == total

        def over_socket() -> None:
            sock.sendall(b"x")
            got = 0
            while got < total:
                got += sock.recv_into(buffer)

        times: dict[str, list[float]] = {"grpc": [], "socket": []}
        for _ in range(args.repeats + 1):  # the first round warms both up and is not kept
            for name, run in (("grpc", over_grpc), ("socket", over_socket)):
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)
        best = {name: min(t[1:]) for name, t in times.items()}
        result = {"bytes": total, "repeats": args.repeats, "seconds": {n: t[1:] for n, t in times.items()},
                  "grpc_mb_s": total / best["grpc"] / 1e6, "socket_mb_s": total / best["socket"] / 1e6,
                  "grpc_vs_socket": best["grpc"] / best["socket"]}
        sock.close()
        channel.close()
    finally:
        child.kill()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.megabytes} MiB, best of {args.repeats}: gRPC {result['grpc_mb_s']:,.0f} MB/s, plain socket "
          f"{result['socket_mb_s']:,.0f} MB/s, gRPC time / socket time {result['grpc_vs_socket']:.2f}")


if __name__ == "__main__":
    main()
