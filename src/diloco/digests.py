"""The digests that vouch for saved files (state files' trailers, a sharded checkpoint's sidecar), in one place.

New files get BLAKE3 (keyed BLAKE3 where a run secret seals them). Every byte of every learner checkpoint
goes through the digest on a thread beside training, and a checkpoint's cost sets how often a learner can
save the progress a kill would lose (`client/checkpoints.py`): on the benchmark host BLAKE3 takes 0.31 ms
of CPU for the default model's 2.4 MB progress file against SHA-256's 1.25 ms (OpenSSL with SHA
instructions) and BLAKE2b's ~2.5 ms (`benchmarks/checkpoint_write_cpu.py`). Files written before carry
SHA-256 or BLAKE2b and still check: the name a file gives for its digest says how to recompute it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import IO, Any, Literal

import blake3

Digest = Literal["blake3", "sha256", "blake2b"]
NEWEST: Digest = "blake3"
KEY_BYTES = 32
"""A keyed digest's key: what `state_files.file_key` derives from the run's secret (BLAKE3 takes exactly 32)."""


def new_digest(kind: Digest = NEWEST, key: bytes | None = None) -> Any:
    """An empty digest of `kind`, keyed with `key` if given (a MAC: HMAC for SHA-256, the keyed modes of
    BLAKE2b and BLAKE3), with `update` and `digest` (32 bytes)."""
    if key is not None and len(key) != KEY_BYTES:
        raise ValueError(f"a digest key is {KEY_BYTES} bytes, not {len(key)}")
    if kind == "blake3":
        return blake3.blake3(key=key) if key is not None else blake3.blake3()
    if kind == "sha256":
        return hmac.new(key, digestmod="sha256") if key is not None else hashlib.sha256()
    if kind == "blake2b":
        return hashlib.blake2b(digest_size=32, key=key or b"")
    raise ValueError(f"unknown digest {kind!r}")


def digest_of_file(file: IO[bytes], length: int | None = None, kind: Digest = NEWEST, key: bytes | None = None,
                   chunk_bytes: int = 1 << 22) -> bytes:
    """The digest of an open file's first `length` bytes (None: all of it), read in chunks: files may be large."""
    digest = new_digest(kind, key)
    file.seek(0)
    left = length
    while left is None or left > 0:
        chunk = file.read(chunk_bytes if left is None else min(chunk_bytes, left))
        if not chunk:
            break
        digest.update(chunk)
        if left is not None:
            left -= len(chunk)
    return digest.digest()
