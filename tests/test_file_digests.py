"""Digests moved from BLAKE2b to SHA-256, then to BLAKE3 (each faster on the CPU a checkpoint's write shares with
training), and what was written before still checks: a sharded learner's sidecar names each DCP file's
digest, tagged; a state file (a shard's state, a learner's checkpoint) carries BLAKE3 under new trailer marks."""

from __future__ import annotations

import hashlib
import hmac
import io
from pathlib import Path

import pytest
import blake3
import torch

from diloco.client.sharded_checkpoints import _digest
from diloco.errors import DilocoError
from diloco.state_files import TRAILER, file_key, load_checked, save_checked


def test_new_digests_are_tagged_blake3_and_older_sha256_and_blake2b_ones_still_check(tmp_path: Path) -> None:
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(bytes(range(256)) * 5000)
    new = _digest(path)
    assert new == "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()
    sha256 = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert _digest(path, sha256) == sha256  # tagged as it was written before BLAKE3
    old = hashlib.blake2b(path.read_bytes(), digest_size=32).hexdigest()
    assert _digest(path, old) == old  # an untagged digest is taken as BLAKE2b, as it was written
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")  # one byte changed: no digest holds
    assert all(_digest(path, d) != d for d in (new, sha256, old))


def written_before(path: Path, state: dict, key: bytes | None, digest_kind: str) -> None:
    """`state` as a state file was written before BLAKE3: a SHA-256 trailer (HMAC with `key`, if any) or,
    earlier still, a BLAKE2b-256 one (keyed)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    body = buffer.getvalue()
    if digest_kind == "sha256":
        digest = hmac.new(key, body, "sha256").digest() if key else hashlib.sha256(body).digest()
        mark = b"DLCMAC02" if key else b"DLCSUM02"
    else:
        digest = hashlib.blake2b(body, digest_size=32, key=key or b"").digest()
        mark = b"DLCMAC01" if key else b"DLCSUM01"
    path.write_bytes(body + TRAILER.pack(mark, len(body), digest))


@pytest.mark.parametrize("key", [None, file_key(b"the run's secret")], ids=["checksum", "sealed"])
def test_a_state_file_takes_blake3_and_ones_written_with_sha256_or_blake2b_still_read(tmp_path: Path, key) -> None:
    state = {"theta": torch.arange(1000, dtype=torch.float32), "seq": 7}
    new = tmp_path / "new.pt"
    save_checked(state, new, key)
    data = new.read_bytes()
    mark, length, digest = TRAILER.unpack(data[-TRAILER.size:])
    body = data[:length]
    assert mark == (b"DLCMAC03" if key else b"DLCSUM03")
    assert digest == (blake3.blake3(body, key=key).digest() if key else blake3.blake3(body).digest())
    olds = {kind: tmp_path / f"{kind}.pt" for kind in ("sha256", "blake2b")}
    for kind, path in olds.items():
        written_before(path, state, key, kind)
    for path in (new, *olds.values()):
        loaded = load_checked(path, "state", "advice", key)
        assert torch.equal(loaded["theta"], state["theta"]) and loaded["seq"] == 7
    # An older digest under the new mark does not check: the mark says how the digest was made.
    for old in olds.values():
        _, old_length, old_digest = TRAILER.unpack(old.read_bytes()[-TRAILER.size:])
        old.write_bytes(old.read_bytes()[:-TRAILER.size] + TRAILER.pack(mark, old_length, old_digest))
        with pytest.raises(DilocoError, match="damaged|does not match its seal"):
            load_checked(old, "state", "advice", key)


def test_a_state_file_is_digested_as_written_without_torchs_crc32_and_the_option_is_put_back(tmp_path: Path) -> None:
    """The digest comes from the bytes as torch.save writes them (no read back), so it must be the digest of
    exactly what precedes the trailer; torch's per-record CRC-32 is skipped (the digest covers every byte)
    and its process-wide option is left as it was, also when the save fails."""
    import zipfile

    state = {"theta": torch.randn(300_000), "seq": 3}
    path = tmp_path / "state.pt"
    assert torch.serialization.get_crc32_options()
    save_checked(state, path)
    data = path.read_bytes()
    mark, length, digest = TRAILER.unpack(data[-TRAILER.size:])
    assert length == len(data) - TRAILER.size and digest == blake3.blake3(data[:length]).digest()
    records = zipfile.ZipFile(io.BytesIO(data[:length])).infolist()
    assert records and all(r.CRC == 0 for r in records)
    assert torch.serialization.get_crc32_options()  # put back for everyone else's torch.save
    assert torch.equal(load_checked(path, "state", "advice")["theta"], state["theta"])
    flipped = bytearray(data)
    flipped[length // 2] ^= 0x01  # a flipped bit in a tensor's bytes: no CRC-32 there, the digest finds it
    path.write_bytes(bytes(flipped))
    with pytest.raises(DilocoError, match="damaged"):
        load_checked(path, "state", "advice")
    with pytest.raises(Exception):
        save_checked({"unpicklable": lambda: 0}, tmp_path / "other.pt")
    assert torch.serialization.get_crc32_options() and not (tmp_path / "other.pt").exists()
