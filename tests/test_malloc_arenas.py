"""A shard's threads share two malloc arenas: memory one thread frees is there for the others, so the
shard's memory does not grow with the threads serving its learners (`serving.limit_malloc_arenas`)."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")

THREADS_ALLOCATING = """
import ctypes, sys, threading
if sys.argv[1] == "limit":  # only then diloco (torch, grpc: ~2.7 s to import), as a shard's process does
    from diloco.shard.serving import limit_malloc_arenas
    print(limit_malloc_arenas(), flush=True)
else:
    print("unlimited", flush=True)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
started = threading.Barrier(8)
def allocate():
    started.wait()  # all at once, as a shard's calls are
    blocks = [libc.malloc(64 << 10) for _ in range(16)]
    started.wait()
    for block in blocks:
        libc.free(block)
threads = [threading.Thread(target=allocate) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.malloc_stats()  # one "Arena N:" section per arena, on stderr
"""


def arenas_used(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", THREADS_ALLOCATING, mode], capture_output=True, text=True,
                          env=env, timeout=60, check=True)
    return done.stdout.strip(), sum(line.startswith("Arena ") for line in done.stderr.splitlines())


def test_threads_of_a_shard_allocate_from_two_arenas_where_they_would_take_one_each():
    _, unlimited = arenas_used("unlimited")
    said, limited = arenas_used("limit")
    assert said == "True"
    assert unlimited > 2, "glibc gave the threads no arenas of their own: nothing here to limit"
    assert limited <= 2


def test_the_cap_is_left_to_the_operator_who_set_one(monkeypatch):
    from diloco.shard.serving import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False
