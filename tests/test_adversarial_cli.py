"""The command line against hostile or careless input: every bad input refused in one line (no
traceback, exit 2); HTTP endpoints bound where they are told, closed to requests without the secret when
asked, and still answering under a flood of half-open connections; SIGTERM stopping `diloco run` as
Ctrl-C does."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import TINY, child_env, wait_for
from diloco.config import load_config
from diloco.errors import ConfigError
from diloco.metrics import MetricsLog
from diloco.metrics.sinks import PrometheusSink
from diloco.transport.ports import wait_for_port
from diloco.status.endpoint import MAX_CONNECTIONS, credentials_for
from diloco.status.status_server import StatusServer
from diloco.transport.security_settings import secret_token

SECRET = b"correct horse battery staple"


def sets(*overrides: str) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def diloco(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env(**env))


def assert_one_line_refusal(done: subprocess.CompletedProcess, message: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert message in done.stderr


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 10) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def listening_hosts(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at `port` (from /proc/net/tcp and tcp6)."""
    hosts = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if width == 8:
                    hosts.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    hosts.add(socket.inet_ntop(socket.AF_INET6, words))
    return hosts


# ---------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.integration  # runs `diloco` as a process
@pytest.mark.parametrize("args, message", [
    (["sim", *sets("train.tokens=1e30")], "'train.tokens' must be an integer"),
    (["sim", *sets("train.tokens=1152921504606846976")], "'train.tokens' must be in [1, 9,007,199,254,740,992]"),
    (["sim", *sets("codec.block=1099511627776", "codec.up=int8")], "'codec.block' must be in [1, 1,048,576]"),
    (["sim", *sets("outer.lr=inf")], "'outer.lr' must be a finite number"),
    (["sim", *sets("outer.outlier_factor=inf")], "'outer.outlier_factor' must be a finite number"),
    (["sim", *sets("learners.count=1000000", "train.tokens=9000000000000")],
     "'learners.count' must be in [1, 4,096]: the syncer keeps a copy of Θ"),
    (["syncer", "--metrics-port", "70000"], "argument --metrics-port: 70000 is not a port number (0..65535)"),
    (["syncer", "--status-port", "-1"], "argument --status-port: -1 is not a port number"),
    (["syncer", "--threads", "0"], "argument --threads: 0 is not a thread count (1..1024)"),
    (["syncer", "--threads", "many"], "argument --threads: 'many' is not a thread count"),
    (["learner", "--metrics-port", "http"], "'http' is not a port number"),
    (["sim", "--out", "/sys/kernel"], "cannot write into --out /sys/kernel"),
])
def test_bad_values_and_ports_are_refused_in_one_line(args, message):
    assert_one_line_refusal(diloco(*args), message)


@pytest.mark.integration  # runs `diloco` as a process
def test_a_config_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    config = tmp_path / "run.toml"
    config.write_bytes(b"seed = 1\n\xff\xfe = 2\n")
    assert_one_line_refusal(diloco("sim", str(config), "--out", str(tmp_path / "out")),
                            f"config file {config} is not UTF-8 text (byte 0xff at offset 9)")


@pytest.mark.integration  # runs `diloco` as a process
def test_out_that_is_a_file_or_not_writable_is_refused_in_one_line(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    assert_one_line_refusal(diloco("sim", "--out", str(a_file)), f"--out {a_file} is a file, not a folder")
    assert_one_line_refusal(diloco("run", "--out", str(a_file / "sub")), f"cannot create --out {a_file / 'sub'}")
    assert a_file.read_text() == "mine\n"  # nothing changed
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o555)
        assert_one_line_refusal(diloco("sim", "--out", str(read_only)), "Permission denied")


@pytest.mark.integration  # runs `diloco` as a process
def test_a_full_disk_is_one_line_naming_the_file(tmp_path):
    """Writes to /dev/full fail as on a full disk: the syncer's metrics file is made one."""
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "syncer-0.jsonl").symlink_to("/dev/full")
    done = diloco("syncer", "--bind", "127.0.0.1:0", "--out", str(tmp_path))
    assert_one_line_refusal(done, f"cannot write {tmp_path / 'metrics' / 'syncer-0.jsonl'}: No space left on device")


def test_non_finite_and_oversized_values_are_refused_with_the_key_and_range():
    for override, fragment in [("outer.lr=inf", "'outer.lr' must be a finite number; got inf"),
                               ("outer.outlier_factor=inf", "'outer.outlier_factor' must be a finite number"),
                               ("outer.momentum=nan", "'outer.momentum' must be a finite number; got nan"),
                               ("learners.speeds=[1, inf]", "'learners.speeds[1]' must be a finite number"),
                               ("link.latency_ms=-inf", "'link.latency_ms' must be a finite number"),
                               ("failures.crashes=[{learner = 0, at_s = inf}]", "'failures.crashes[0].at_s'"),
                               ("codec.block=0", "'codec.block' must be positive"),
                               ("model.width=1099511627776", "'model.width' must be in [1, 1,048,576]"),
                               ("seed=18446744073709551616", "'seed' must be in [0, "),
                               ("learners.count=4097", "'learners.count' must be in [1, 4,096]")]:
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert fragment in str(err.value) and "\n" not in str(err.value)
    assert load_config(None, ["learners.count=4096", "train.tokens=9007199254740992"]).learners.count == 4096


# ---------------------------------------------------------------- HTTP endpoints: where, and for whom


@pytest.mark.integration  # a live HTTP server
def test_with_credentials_a_request_needs_the_secret_or_its_token():
    with StatusServer(lambda: {"shard": 0}, credentials=credentials_for(SECRET)) as server:
        url = f"http://{server.address}/status.json"
        assert get(url)[0] == 401
        assert get(url, {"Authorization": "Bearer wrong"})[0] == 401
        assert get(url, {"x-diloco-secret": SECRET.decode() + "x"})[0] == 401
        assert get(url, {"Authorization": f"Bearer {SECRET.decode()}"}) == (200, '{"shard": 0}')
        assert get(url, {"x-diloco-secret": secret_token(SECRET)}) == (200, '{"shard": 0}')
        assert get(f"http://{server.address}/nope")[0] == 401  # which paths exist is not told either
    sink = PrometheusSink(0, credentials=credentials_for(SECRET))
    MetricsLog([sink]).record("learner", 1.0, learner=0, tokens=64)
    try:
        url = f"http://127.0.0.1:{sink.port}/metrics"
        assert get(url)[0] == 401
        code, text = get(url, {"Authorization": f"Bearer {secret_token(SECRET)}"})
        assert code == 200 and 'diloco_learner_tokens{learner="0"} 64.0' in text
    finally:
        sink.close()


@pytest.mark.integration  # a live HTTP server
def test_half_open_connections_do_not_keep_a_request_out():
    """Hundreds of clients that connect and send nothing, or half a request line: a real request is
    still answered at once (the oldest half-open one makes room for it)."""
    with StatusServer(lambda: {"shard": 0}) as server:
        host, port = "127.0.0.1", server.port
        idle = []
        try:
            for i in range(max(200, 2 * MAX_CONNECTIONS)):
                sock = socket.create_connection((host, port), timeout=5)
                if i % 2:
                    sock.sendall(b"GET /status.json HT")
                idle.append(sock)
            started = time.monotonic()
            assert get(f"http://{server.address}/status.json", timeout=5) == (200, '{"shard": 0}')
            assert time.monotonic() - started < 1.5
            idle[0].settimeout(5)
            assert idle[0].recv(100) == b""  # the oldest was dropped to make room, not left holding a slot
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.integration  # a live HTTP server
def test_an_oversized_or_malformed_request_is_refused_and_the_server_keeps_serving():
    with StatusServer(lambda: {"shard": 0}) as server:
        for request, status in ((b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", b" 431 "),
                                (b"NONSENSE\r\n\r\n", b" 400 "),
                                (b"POST / HTTP/1.1\r\nContent-Length: 1\r\n\r\nx", b" 405 ")):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(request)
                assert status in sock.recv(200).split(b"\r\n")[0]
        assert get(f"http://{server.address}/status.json")[0] == 200


@pytest.mark.integration  # runs `diloco syncer` as a process
def test_a_syncer_serves_metrics_and_status_on_its_bind_host_with_the_secret_and_stops_on_sigterm(tmp_path):
    """127.0.0.2 is loopback too, but not 127.0.0.1: an endpoint on 0.0.0.0 would answer on both."""
    ports = {name: tmp_path / f"{name}.port" for name in ("syncer", "metrics", "status")}
    syncer = subprocess.Popen(
        [sys.executable, "-m", "diloco", "syncer", "--bind", "127.0.0.2:0", "--port-file", str(ports["syncer"]),
         "--metrics-port", "0", "--metrics-port-file", str(ports["metrics"]), "--status-port", "0",
         "--status-port-file", str(ports["status"]), "--http-auth", "--out", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(DILOCO_SECRET=SECRET.decode()))
    try:
        gone = lambda: None if syncer.poll() is None else f"exited with code {syncer.returncode}"  # noqa: E731
        found = {name: wait_for_port(path, name, gone=gone) for name, path in ports.items()}
        bearer = {"Authorization": f"Bearer {SECRET.decode()}"}
        for name, path in (("metrics", "/metrics"), ("status", "/status.json")):
            assert listening_hosts(found[name]) == {"127.0.0.2"}, name
            assert get(f"http://127.0.0.2:{found[name]}{path}")[0] == 401
            assert get(f"http://127.0.0.2:{found[name]}{path}", bearer)[0] == 200
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", found[name]), timeout=2).close()
        syncer.send_signal(signal.SIGTERM)
        _, stderr = syncer.communicate(timeout=60)
    finally:
        syncer.kill()
    assert syncer.returncode == 0, stderr
    assert json.loads((tmp_path / "out" / "syncer" / "shard-0.json").read_text())["shard"] == 0


@pytest.mark.integration  # runs `diloco` as a process
def test_http_auth_without_a_secret_the_user_knows_is_refused():
    env = {k: v for k, v in child_env().items() if k != "DILOCO_SECRET"}
    for args in (["syncer", "--http-auth"], ["run", "--http-auth"]):
        done = subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=120,
                              env=env)
        assert_one_line_refusal(done, "--http-auth needs the shared secret")


# ---------------------------------------------------------------- SIGTERM to `diloco run`


def descendants_of(pid: int) -> list[int]:
    """Processes started by `diloco run` with launcher `pid` (they carry its pid in their environment)."""
    marker = f"DILOCO_PARENT_PID={pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.integration  # a real run, as processes
def test_sigterm_stops_diloco_run_as_ctrl_c_does_with_every_endpoint_on_loopback(tmp_path):
    config = sets(*TINY, "learners.count=2", "train.tokens=10000000")
    launcher = subprocess.Popen([sys.executable, "-m", "diloco", "run", *config, "--out", str(tmp_path), "-q"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        def training() -> bool:
            assert launcher.poll() is None, launcher.communicate()
            logs = [tmp_path / "logs" / f"learner-{m}.log" for m in range(2)]
            return all(log.is_file() and "trains" in log.read_text() for log in logs)

        wait_for(training, 120, "both learners to train")
        endpoints = ["syncer-0.metrics", "status", "learner-0.metrics", "learner-1.metrics"]
        wait_for(lambda: all((tmp_path / "ports" / f"{name}.port").is_file() for name in endpoints), 60,
                 "every endpoint's port")
        for name in endpoints:
            port = int((tmp_path / "ports" / f"{name}.port").read_text())
            assert listening_hosts(port) == {"127.0.0.1"}, name
        assert len(descendants_of(launcher.pid)) == 3
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert not descendants_of(launcher.pid)
    for m in range(2):  # each learner pushed what it had, left, and saved its own state
        report = json.loads((tmp_path / "learners" / f"learner-{m}.json").read_text())
        assert report["interrupted"] and (tmp_path / "checkpoints" / f"learner-{m}.pt").is_file()
    assert json.loads((tmp_path / "syncer" / "shard-0.json").read_text())["finished"]
    assert (tmp_path / "syncer" / "shard-0.state.pt").is_file()
    assert (tmp_path / "metrics.jsonl").stat().st_size > 0
