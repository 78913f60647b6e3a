"""A sharded learner's sidecar names each DCP file's digest: new checkpoints take SHA-256 (tagged), and a
checkpoint written before, whose digests are untagged BLAKE2b, is still checked as it was written."""

from __future__ import annotations

import hashlib
from pathlib import Path

from diloco.client.sharded_checkpoints import _digest


def test_new_digests_are_tagged_sha256_and_old_blake2b_ones_still_check(tmp_path: Path) -> None:
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(bytes(range(256)) * 5000)
    new = _digest(path)
    assert new == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    old = hashlib.blake2b(path.read_bytes(), digest_size=32).hexdigest()
    assert _digest(path, old) == old  # an untagged digest is taken as BLAKE2b, as it was written
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")  # one byte changed: neither digest holds
    assert _digest(path, new) != new and _digest(path, old) != old
