"""Port files: how a server that bound port 0 tells others the port it got, and how they wait for it."""

from __future__ import annotations

import pytest

from diloco.errors import DilocoError
from diloco.transport.ports import read_port_file, resolve_address, wait_for_port, write_port_file


def test_a_port_file_is_written_whole_and_replaced_whole(tmp_path):
    path = tmp_path / "ports" / "syncer-0.port"
    assert read_port_file(path) is None
    write_port_file(path, 41234)
    assert read_port_file(path) == 41234
    write_port_file(path, 41235)  # a restarted server reports again
    assert read_port_file(path) == 41235
    assert [p.name for p in path.parent.iterdir()] == ["syncer-0.port"]  # no partial file left behind
    write_port_file(None, 1)  # no file asked for: nothing written


def test_a_port_file_that_holds_no_port_is_a_one_line_error(tmp_path):
    path = tmp_path / "syncer-0.port"
    path.write_text("not a port\n")
    with pytest.raises(DilocoError, match="holds 'not a port', not a port number"):
        read_port_file(path)


def test_waiting_for_a_port_ends_when_it_is_there_when_its_writer_is_gone_or_at_the_bound(tmp_path):
    path = tmp_path / "syncer-1.port"
    write_port_file(path, 7071)
    assert wait_for_port(path, "syncer-1") == 7071
    missing = tmp_path / "never.port"
    with pytest.raises(DilocoError, match=r"^syncer-2 exited with code 2 \(see it\) before reporting its port$"):
        wait_for_port(missing, "syncer-2", gone=lambda: "exited with code 2 (see it)")
    with pytest.raises(DilocoError, match="syncer-3 did not report its port in .* within 0.1 s"):
        wait_for_port(missing, "syncer-3", timeout_s=0.1)


def test_a_shard_address_may_name_the_port_file_of_that_shard(tmp_path):
    write_port_file(tmp_path / "syncer-1.port", 40001)
    assert resolve_address("10.0.0.2:7070", "syncer shard 1") == "10.0.0.2:7070"
    assert resolve_address(f"127.0.0.1:@{tmp_path / 'syncer-1.port'}", "syncer shard 1") == "127.0.0.1:40001"
