"""Output files are replaced whole: a writer killed mid-write, or a failed write, leaves the old file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.errors import DilocoError
from diloco.outputs import write_output

WRITER = """
import json, sys
from pathlib import Path
from diloco.outputs import write_output
path = Path(sys.argv[1])
n = 0
while True:
    n += 1
    write_output(path, json.dumps({"n": n, "pad": "x" * 400_000}) + "\\n", durable=n % 2 == 0)
"""


def test_a_writer_killed_mid_write_leaves_a_whole_file(tmp_path):
    """SIGKILL at arbitrary points of a loop of rewrites: the file always parses (a plain write tore it)."""
    path = tmp_path / "ledger.json"
    for attempt in range(5):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05 + 0.037 * attempt)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        assert json.loads(path.read_text())["n"] >= 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ledger.json"]
    # At most the partial files of killed writers, named apart so that nothing reads them.
    assert all(name.startswith(".ledger.json.") and name.endswith(".tmp") for name in leftovers)


def test_a_failed_write_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "out" / "summary.json"
    write_output(path, "old\n")

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(DilocoError, match=r"cannot write .*summary\.json: No space left on device"):
        write_output(path, "new\n", durable=True)
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["summary.json"]


def test_outputs_create_their_folder(tmp_path):
    path = tmp_path / "a" / "b" / "c.json"
    write_output(path, "{}\n")
    assert Path(path).read_text() == "{}\n"
