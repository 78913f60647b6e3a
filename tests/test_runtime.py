"""The real runtime as users run it: `diloco run`, `diloco syncer`, `diloco learner` and torchrun, as
processes; its agreement with the simulator; bad input; Ctrl-C and dying children, never an orphan."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, free_port_for_torchrun, tiny_config, wait_for
from diloco.transport.ports import wait_for_port
from diloco.sim.driver import Simulation

pytestmark = pytest.mark.integration  # every test runs diloco as processes

RUN_TIMEOUT_S = 240


def sets(*overrides: str) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def diloco(*args: str, timeout: float = RUN_TIMEOUT_S, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def descendants_of(pid: int) -> list[int]:
    """Processes started by `diloco run` with launcher `pid` (they carry its pid in their environment)."""
    found = []
    marker = f"DILOCO_PARENT_PID={pid}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    wait_for(lambda: not descendants_of(pid), timeout, f"the children of {pid} to exit")


# ---------------------------------------------------------------- diloco run


def test_run_trains_and_writes_the_summary_the_simulator_writes(tmp_path):
    overrides = [*TINY, "learners.speeds=[1, 0.5]", "train.tokens=20480"]
    done = diloco("run", *sets(*overrides), "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    simulated = Simulation(tiny_config()).run().summary()
    assert set(simulated) == set(summary)  # one summary, whichever driver ran
    assert (simulated["clock"], summary["clock"]) == ("virtual", "real")
    assert 0 < summary["training_time_s"] < summary["wall_clock_s"]
    assert summary["learners"] == 2 and summary["rounds"] > 0 and summary["duplicates"] == 0
    # Conservation: every token a learner trained is merged (on time or stale) exactly once.
    assert summary["tokens_lost"] == pytest.approx(0, abs=1e-6)
    assert summary["tokens_merged"] + summary["tokens_stale"] == pytest.approx(summary["tokens"])
    fast, slow = summary["per_learner"]
    # Half of each of the slow learner's steps is emulated slowness, and it counts as compute: its busy
    # time per step is about twice the fast one's.
    assert slow["speed"] == 0.5 and slow["busy_s"] / slow["steps"] > 1.5 * fast["busy_s"] / fast["steps"]
    assert (tmp_path / "model.pt").is_file() and (tmp_path / "syncer" / "shard-0.state.pt").is_file()
    assert all((tmp_path / "checkpoints" / f"learner-{m}.pt").is_file() for m in range(2))
    # The metrics of every process, in one file: the same totals as the summary and the transport.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # start: each learner life's record, from process start to its first step; serving: each shard's, when
    # it first serves (a shard kill's timeline starts there); no restart, so no resume or reconnect
    assert {r["kind"] for r in records} == {"learner", "round", "eval", "syncer", "start", "serving"}
    assert sum(r["kind"] == "serving" for r in records) == 1 and not any(
        r["kind"] == "serving" and r["resumed"] for r in records)
    last = {r["learner"]: r for r in records if r["kind"] == "learner"}
    for report in summary["per_learner"]:
        final = last[report["learner"]]
        assert (final["tokens"], final["bytes_up"], final["bytes_down"]) == \
            (report["tokens"], report["bytes_up"], report["bytes_down"])
    rounds = [r for r in records if r["kind"] == "round"]
    assert len(rounds) == summary["rounds"]
    assert sum(r["tokens"] for r in rounds) == 4 * summary["tokens"]  # once per fragment


def test_run_and_sim_end_with_the_same_parameters_when_every_learner_is_in_every_round(tmp_path):
    """K = M, one fragment, the same data order: the real runtime computes what the simulator does."""
    overrides = [*TINY, "learners.count=2", "strategy=diloco", "outer.H=4", "train.tokens=10240"]
    done = diloco("run", *sets(*overrides), "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stderr
    real = torch.load(tmp_path / "model.pt", weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each learner process runs: another thread count sums in another order
    try:
        sim = Simulation(tiny_config(*overrides[len(TINY):]))
        sim.run()
    finally:
        torch.set_num_threads(threads)
    assert sim.syncer.rounds_closed == json.loads((tmp_path / "summary.json").read_text())["rounds"] == 20
    for name, value in sim.syncer.theta.items():
        torch.testing.assert_close(real[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_a_reproducible_decoupled_run_computes_what_the_simulator_does_whatever_the_speeds(tmp_path):
    """`outer.reproducible`: learners of different real speeds, several fragments and τ = 2 end where the
    simulator's virtual clock ends: nothing the run computes follows timing (which round a push joins,
    the step an answer lands at, who trains how much)."""
    overrides = [*TINY, "strategy=decoupled", "outer.reproducible=true", "learners.speeds=[1, 0.5]",
                 "outer.H=6", "outer.fragments=2", "outer.tau=2", "outer.alpha=0.5", "train.tokens=15360"]
    done = diloco("run", *sets(*overrides), "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stderr
    real = torch.load(tmp_path / "model.pt", weights_only=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each learner process runs
    try:
        sim = Simulation(tiny_config(*overrides[len(TINY):]))
        result = sim.run()
    finally:
        torch.set_num_threads(threads)
    assert summary["tokens_stale"] == result.tokens_stale == 0
    assert sim.syncer.rounds_closed == summary["rounds"]
    # Equal to the last bit: a round's sums take its pushes in learner order, not as they came (with
    # arrival order they differed in their last bits, which AdamW grew to 3e-4 in the key bias).
    assert summary["final_eval_loss"] == result.final_eval_loss
    for name, value in sim.syncer.theta.items():
        assert torch.equal(real[name], value), name


def test_equal_learners_meet_in_rounds_for_real_and_the_simulator_predicts_the_run(tmp_path):
    """Four equal learners with noisy real step times: pacing gathers them (≥ 2.5 per round on average),
    nobody waits, and the simulator, told the step time the run measured, predicts its final loss."""
    overrides = ["train.eval_batches=4", "train.eval_points=2", "outer.H=20", "outer.fragments=2",
                 "learners.speeds=[1, 1, 1, 1]", "train.tokens=163840"]
    done = diloco("run", *sets(*overrides), "--out", str(tmp_path / "run"), "-q")
    assert done.returncode == 0, done.stderr
    real = json.loads((tmp_path / "run" / "summary.json").read_text())
    # Ten rounds in all, the first ones before pacing has measured anyone: 2.5 of 4 on average (before
    # pacing, almost every real round had one participant; measured here 2.9 to 3.6).
    assert real["round_stats"]["participants_mean"] >= 2.5, real["round_stats"]
    assert max(p["waiting_s"] for p in real["per_learner"]) < 1.0
    step_s = sum(p["busy_s"] for p in real["per_learner"]) / sum(p["steps"] for p in real["per_learner"])
    done = diloco("sim", *sets(*overrides, f"learners.step_time_s={step_s}"), "--out", str(tmp_path / "sim"), "-q")
    assert done.returncode == 0, done.stderr
    sim = json.loads((tmp_path / "sim" / "summary.json").read_text())
    # At 160k tokens the loss still falls steeply, so a few steps of real timing move it by a few
    # percent; before pacing the real run ended ~10% above the simulator's prediction.
    assert sim["final_eval_loss"] == pytest.approx(real["final_eval_loss"], rel=0.06)
    assert real["final_eval_loss"] <= real["learners_eval_loss_mean"] * 1.01  # Θ no worse than its learners


def test_several_shards_split_the_fragments(tmp_path):
    done = diloco("run", *sets(*TINY, "learners.count=2", "outer.fragments=3", "train.tokens=10240"),
                  "--shards", "2", "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stderr
    shards = json.loads((tmp_path / "syncer" / "shards.json").read_text())
    assert [s["fragments"] for s in shards] == [[0, 2], [1]]
    assert all(s["rounds"] for s in shards)
    # Each learner's join (and the launcher's evaluations) pulled Θ over each shard's bulk port, and every
    # push merged there sent its data over it.
    assert all(s["bulk"]["sent"] >= 2 and s["bulk"]["refused"] == 0 for s in shards), shards
    assert all(s["bulk"]["received"] >= sum(len(r["participants"]) for r in s["rounds"]) > 0 for s in shards), shards


# ---------------------------------------------------------------- separate commands, as on separate hosts


def started_syncer(command: list[str], port_file: Path, **popen) -> tuple[subprocess.Popen, int]:
    """A `diloco syncer` process, and the port it reported in `port_file` once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", *command, "--port-file", str(port_file)],
                            **popen)

    def gone() -> str | None:
        return None if proc.poll() is None else f"exited with code {proc.returncode}"

    try:
        return proc, wait_for_port(port_file, "the syncer", gone=gone)
    except BaseException:
        proc.kill()
        raise


def test_separate_syncer_shards_and_torchrun_learners_on_loopback(tmp_path):
    """Each shard binds port 0 and reports the port it got; each finds the other's in its port file."""
    port_files = [tmp_path / f"syncer-{i}.port" for i in range(2)]
    shard_map = ",".join(f"127.0.0.1:@{path}" for path in port_files)
    config = sets(*TINY, "learners.count=2", "outer.fragments=2", "train.tokens=10240")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        addresses = []
        for i, port_file in enumerate(port_files):
            proc, port = started_syncer([*config, "--bind", "127.0.0.1:0", "--shard", f"{i}/2", "--shards",
                                         shard_map, "--out", str(tmp_path), "--exit-when-finished"], port_file,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            procs.append(proc)
            addresses.append(f"127.0.0.1:{port}")
        learners = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
             str(free_port_for_torchrun()), "-m", "diloco.learner", *config, "--syncer", addresses[m % 2],
             "--id", str(m), "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env) for m in range(2)]
        procs += learners
        for proc in procs:
            output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            assert proc.returncode == 0, output
    finally:
        for proc in procs:
            proc.kill()
    merged = {"0": 0, "1": 0}
    for i in range(2):
        report = json.loads((tmp_path / "syncer" / f"shard-{i}.json").read_text())
        assert report["finished"] and report["rounds"]
        assert set(report["ledger"]) == {"0", "1"}
        for m, entry in report["ledger"].items():
            merged[m] += sum(entry["merged"].values()) + sum(entry["stale"].values())
    # Every learner pushed, and each shard merged what both pushed of its fragments. Whether a learner
    # merged an answer before it finished is timing, not correctness: this tiny model trains its share in
    # well under a second, and under load one torchrun may start so late that the other has trained most
    # of the budget (and left) by then (seen in CI: both learners ended with 0 merges, every push merged).
    learners = [json.loads((tmp_path / "learners" / f"learner-{m}.json").read_text()) for m in range(2)]
    assert all(report["pushes"] > 0 for report in learners)
    assert all(merged[str(m)] > 0 for m in range(2)), merged


# ---------------------------------------------------------------- bad input


def test_a_learner_pointed_at_nothing_fails_in_one_line():
    with socket.socket() as nothing:
        nothing.bind(("127.0.0.1", 0))  # bound and never listening: connections are refused, and it stays ours
        address = f"127.0.0.1:{nothing.getsockname()[1]}"
        done = diloco("learner", "--syncer", address, "--connect-timeout", "2", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "cannot reach the syncer at 127.0.0.1" in done.stderr


@pytest.mark.parametrize("framework", ["torch", pytest.param("jax", marks=pytest.mark.skipif(
    importlib.util.find_spec("jax") is None, reason="the jax extra is not installed"))])
def test_a_learner_told_to_stop_while_it_waits_for_the_syncer_ends_at_once_in_one_line(framework):
    """SIGTERM (torchrun's, a service manager's) while a learner waits for a syncer that does not answer
    (a listener that never speaks gRPC) ends it in one line within a second or two, not at its connect
    timeout (a launcher gives up on it after its own grace and kills it)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(120)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen([sys.executable, "-m", "diloco", "learner", "--syncer", address, "--connect-timeout",
                                 "120", "--framework", framework, "-q"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = silent.accept()  # its channel is connected, and waits for an answer that never comes
            asked = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            took = time.monotonic() - asked
            conn.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 2 and took < 5, (proc.returncode, took, err[-2000:])
    assert err.strip().count("\n") == 0 and "stopped while waiting for the syncer at 127.0.0.1" in err, err[-2000:]


def test_a_syncer_on_a_port_in_use_fails_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = diloco("syncer", "--bind", f"127.0.0.1:{port}", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["run", "--shards", "5"], "5 syncer shards but only 4 fragments"),
    (["run", "--set", "strategy=ddp"], "Use `diloco sim` for ddp"),
    (["syncer", "--shard", "2/2"], "need 0 <= i < N"),
    (["syncer", "--shard", "0/2"], "--shards lists 1 address(es)"),
    (["learner"], "give --syncer"),
    (["run", "--out", "{tmp}/a,b"], "a path with a comma cannot be used"),
])
def test_impossible_requests_fail_in_one_line(args, message, tmp_path):
    done = diloco(*[a.replace("{tmp}", str(tmp_path)) for a in args], timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and done.stderr.strip().count("\n") == 0


# ---------------------------------------------------------------- stopping, and children that die


def start_run(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    config = sets(*TINY, "learners.count=2", "train.tokens=10000000", *overrides)
    return subprocess.Popen([sys.executable, "-m", "diloco", "run", *config, "--out", str(tmp_path), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_training(tmp_path: Path, launcher: subprocess.Popen) -> None:
    def training() -> bool:
        assert launcher.poll() is None, launcher.communicate()
        logs = [tmp_path / "logs" / f"learner-{m}.log" for m in range(2)]
        return all(log.is_file() and "trains" in log.read_text() for log in logs)
    wait_for(training, 90, "both learners to train")


def test_ctrl_c_stops_every_process_cleanly_with_state_saved(tmp_path):
    launcher = start_run(tmp_path)
    try:
        wait_training(tmp_path, launcher)
        assert len(descendants_of(launcher.pid)) == 3
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 130, stderr
    finally:
        launcher.kill()
    assert not descendants_of(launcher.pid)
    for m in range(2):  # each learner pushed what it had, left, and saved its own state
        report = json.loads((tmp_path / "learners" / f"learner-{m}.json").read_text())
        assert report["interrupted"] and (tmp_path / "checkpoints" / f"learner-{m}.pt").is_file()
    state = torch.load(tmp_path / "syncer" / "shard-0.state.pt", weights_only=True)
    assert state["core"]["theta"] and state["report"]["finished"]


def test_a_learner_that_dies_ends_the_run_with_its_name_and_no_orphans(tmp_path):
    launcher = start_run(tmp_path)
    try:
        wait_training(tmp_path, launcher)
        learner = next(pid for pid in descendants_of(launcher.pid)
                       if b"\0learner\0" in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(learner, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 2 and "learner-" in stderr and "exited with code -9" in stderr
    wait_gone(launcher.pid)


def test_killing_the_launcher_takes_its_children_with_it(tmp_path):
    launcher = start_run(tmp_path)
    try:
        wait_training(tmp_path, launcher)
        launcher.kill()
        launcher.wait()
    finally:
        launcher.kill()
    wait_gone(launcher.pid, timeout=10)


def test_a_learner_without_the_run_secret_is_refused_in_one_line(tmp_path):
    env = {**os.environ, "DILOCO_SECRET": "the-right-one"}
    syncer, port = started_syncer(["--bind", "127.0.0.1:0"], tmp_path / "syncer.port", stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env)
    try:  # it says where it listens (the port it got) and how it is secured
        assert f"listening on 127.0.0.1:{port} (plaintext, shared secret)" in syncer.stdout.readline()
        done = diloco("learner", "--syncer", f"127.0.0.1:{port}", "--connect-timeout", "20", timeout=60,
                      env={**os.environ, "DILOCO_SECRET": "a-wrong-one"})
    finally:
        syncer.kill()
        syncer.wait()
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "missing or wrong shared secret" in done.stderr
