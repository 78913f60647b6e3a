"""A plain TCP sink on loopback: the baseline the transport benchmarks measure gRPC against.

It prints its port, takes one connection, and answers one byte per length-prefixed message.
"""

import ctypes, signal, socket, struct, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: go when the benchmark goes
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = memoryview(bytearray(1 << 20))

def exactly(n):
    head = bytearray()
    while len(head) < n:
        chunk = conn.recv(n - len(head))
        if not chunk:
            return None
        head += chunk
    return bytes(head)

while (head := exactly(8)) is not None:
    left = struct.unpack("!Q", head)[0]
    while left:
        got = conn.recv_into(buf[:min(left, len(buf))])
        if not got:
            sys.exit(1)
        left -= got
    conn.sendall(b"\x01")
