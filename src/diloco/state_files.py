"""Files of saved state that vouch for themselves: a shard's state, a learner's checkpoint.

Such a file is what torch.save wrote, then a trailer of 48 bytes: a marker (8 bytes), the length of
what precedes it (8, little-endian) and its BLAKE3 digest (32; files written before carry SHA-256 or
BLAKE2b-256 digests under their own marks, and still read: `digests.py`). It is written to a temporary
file, synced, then renamed over the old one, so a crash leaves the old file or the new one.

With the run's secret (`file_key`), the digest is keyed (marker `DLCMAC03`): whoever can write the file
but does not hold the secret cannot make a rewritten one pass, and a file sealed by another run (another
secret) is refused. Without a secret it is a plain checksum (marker `DLCSUM03`) that only finds damage;
a process with a secret refuses such a file, and one without a secret refuses a sealed one.

Reading checks the trailer and the digest before torch.load sees a byte, then loads with
weights_only=True (no code is ever unpickled). Every way a file can be unusable — missing, cut short,
damaged, written by something else, holding pickled objects — is a one-line DilocoError naming the
file, never a traceback. torch.load reads the zip archive from its end directory and ignores the
trailer, so `torch.load(path, weights_only=True)` still opens these files by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from diloco.digests import NEWEST, Digest, digest_of_file, new_digest
from diloco.errors import DilocoError
from diloco.outputs import replacing

TRAILER = struct.Struct("<8sQ32s")
TRAILER_MARK = b"DLCSUM03"
"""An unkeyed checksum (BLAKE3): it finds damage, not tampering."""
SEALED_MARK = b"DLCMAC03"
"""A digest keyed with the run's secret (keyed BLAKE3)."""
MARKS: dict[bytes, tuple[bytes, Digest]] = {
    TRAILER_MARK: (TRAILER_MARK, "blake3"), SEALED_MARK: (SEALED_MARK, "blake3"),
    b"DLCSUM02": (TRAILER_MARK, "sha256"), b"DLCMAC02": (SEALED_MARK, "sha256"),
    b"DLCSUM01": (TRAILER_MARK, "blake2b"), b"DLCMAC01": (SEALED_MARK, "blake2b")}
"""Every mark a state file may carry: whether it is sealed (the newest mark of its kind) and how its digest
was made. Files written before BLAKE3 (SHA-256, and BLAKE2b before that) still read."""
_KEY_CONTEXT = b"diloco state file key"


class StateFileError(DilocoError):
    """A saved state or checkpoint that cannot be trusted; the message names the file and why."""


def file_key(secret: bytes | None) -> bytes | None:
    """The key that seals state files of the run whose secret is `secret` (None: no secret, no seal)."""
    return None if secret is None else hmac.new(secret, _KEY_CONTEXT, hashlib.sha256).digest()


def save_checked(state: dict, path: Path, key: bytes | None = None) -> None:
    """`state` at `path`, with its digest (sealed with `key`, if any), atomically and synced: the old file
    stays until the new one is whole. A failure (a full disk) leaves no temporary file behind and raises
    OSError. The digest is taken from the bytes as torch.save writes them (no second read of the file),
    and torch.save's own CRC-32 of each record is skipped: the digest covers every byte already."""
    with replacing(path, binary=True, durable=True) as file:
        hashing = _HashingWriter(file, new_digest(NEWEST, key))
        with _without_crc32():
            torch.save(state, hashing)
        file.write(TRAILER.pack(TRAILER_MARK if key is None else SEALED_MARK, hashing.length, hashing.digest.digest()))
    sync_folder(path.parent)


class _HashingWriter:
    """What torch.save writes to (it only calls `write` and `flush`): each write goes to the file and
    into the digest, so the digest costs no read of the file back."""

    def __init__(self, file: IO[bytes], digest: Any) -> None:
        self.file, self.digest, self.length = file, digest, 0

    def write(self, data: Any) -> int:
        written = self.file.write(data)
        self.digest.update(data)
        self.length += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.file.flush()


_CRC32_SWITCH = threading.Lock()


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save without its per-record CRC-32 (about a fifth of a checkpoint's write CPU here). torch
    reads the option once, as a save begins, from a process-wide setting: it is switched off only around
    our own saves, under a lock, and put back. Another thread's torch.save beginning in that instant
    writes its file without CRC-32 records as well, which torch.load reads all the same."""
    with _CRC32_SWITCH:
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(before)


def sync_folder(folder: Path) -> None:
    """The rename itself on disk (where the platform allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checked(path: Path, what: str, advice: str, key: bytes | None = None) -> dict:
    """The dict saved at `path` by `save_checked` (with the same `key`), once its digest matches; `what`
    names the file in errors ("saved state of shard 0"), `advice` says what to do about one."""
    def refuse(why: str) -> StateFileError:
        return StateFileError(f"{what} {path} {why}: {advice}")

    try:
        file = open(path, "rb")
    except OSError as exc:
        raise refuse(f"cannot be read ({exc.strerror or exc})") from None
    with file:
        size = os.fstat(file.fileno()).st_size
        if size < TRAILER.size:
            raise refuse(f"is cut short ({size} bytes)")
        file.seek(size - TRAILER.size)
        mark, length, digest = TRAILER.unpack(file.read(TRAILER.size))
        if mark not in MARKS:
            raise refuse("has no checksum (cut short, damaged, or not written by this version of diloco)")
        mark, kind = MARKS[mark]
        if mark == TRAILER_MARK and key is not None:
            raise refuse("is not sealed with this run's secret (its checksum is one anyone can recompute)")
        if mark == SEALED_MARK and key is None:
            raise refuse("is sealed with a run secret, and none is given (--secret-file or DILOCO_SECRET)")
        if length != size - TRAILER.size:
            raise refuse(f"is {size} bytes but its checksum covers {length} (cut short or padded)")
        if not hmac.compare_digest(digest_of_file(file, length, kind, key), digest):
            raise refuse("is damaged (its contents do not match its checksum)" if key is None else
                         "does not match its seal (damaged, rewritten, or sealed by a run with another secret)")
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise refuse(f"holds objects a state file never holds (refused to unpickle them: {first})") from None
    except Exception as exc:  # torch reports a bad archive as RuntimeError, EOFError, ValueError...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise refuse(f"cannot be loaded ({first})") from None
    if not isinstance(state, dict):
        raise refuse(f"holds a {type(state).__name__}, not the dict it was saved as")
    return state
