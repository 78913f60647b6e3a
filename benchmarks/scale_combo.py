"""scale.py's one combination: its shard and learner processes, its window, the socket baseline, and
its summary."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from children import Processes, diloco, tail  # benchmarks/children.py
from scale_baselines import cpu_seconds, percentile, rounds_closed, roofline_ns_per_param, socket_baseline
from scale_memory import MemoryModel, Sampler, mem_available
from scale_profile import profile_env, read_profiles, window_profiles
from scale_model import (DRAIN_S, GIB, LEARNER_RSS_BYTES, MB, PUSH_BOUND_S, STARTUP_S, TensorMeta, init_frames,
                         model_layout, shard_fragments, write_payloads)



@dataclass(frozen=True)
class Combo:
    params: int
    learners: int
    shards: int
    codec: str
    down: str
    fragments: int

    @property
    def key(self) -> tuple:
        return (self.codec, self.down, self.shards)


def syncer_sets(combo: Combo, args: argparse.Namespace) -> list[str]:
    sets = ["strategy=decoupled", f"learners.count={combo.learners}", "learners.speeds=[]",
            f"outer.fragments={combo.fragments}", f"outer.H={max(50, combo.fragments)}",
            f"outer.quorum={min(args.quorum, combo.learners)}",
            *([] if args.paced else ["outer.pacing=false", "outer.grace=0"]),
            f"codec.up={combo.codec}", f"codec.down={combo.down}", f"codec.block={args.block}",
            f"train.tokens={2**50}", "failures.detect_s=86400", *args.set]
    return [x for s in sets for x in ("--set", s)]


class Run:
    """Shards, learners and the measurement of one combination; `close` stops every child."""

    def __init__(self, procs: Processes, work: Path, combo: Combo, args: argparse.Namespace, payload: dict,
                 layout: list[list[TensorMeta]], console) -> None:
        self.procs, self.work, self.combo, self.args = procs, work, combo, args
        self.payload, self.layout, self.console = payload, layout, console
        self.shard_procs: list[subprocess.Popen] = []
        self.learner_procs: list[subprocess.Popen] = []
        self.clients: list = []
        self.sampler: Sampler | None = None

    def _kill_all(self) -> None:
        self.procs.kill(self.learner_procs + self.shard_procs)

    def start_shards(self) -> None:
        from diloco.transport.ports import wait_for_port
        from diloco.transport.calls import ShardClient
        from diloco.transport.security import PLAINTEXT, TransportSecurity

        n = self.combo.shards
        secret_file = None
        if not self.args.plaintext:
            secret_file = self.work / "secret"
            secret_file.write_bytes(os.urandom(24).hex().encode())
            secret_file.chmod(0o600)
        self.secret_file = secret_file
        port_files = [self.work / f"shard-{i}.port" for i in range(n)]
        shard_map = ",".join(f"127.0.0.1:@{p}" for p in port_files)
        for i, port_file in enumerate(port_files):
            argv = diloco("syncer", *syncer_sets(self.combo, self.args), "--bind", "127.0.0.1:0", "--port-file",
                          str(port_file), "--shards", shard_map, "--shard", f"{i}/{n}",
                          *(["--secret-file", str(secret_file)] if secret_file else []),
                          *(["--out", str(self.work / "state")] if self.args.journal else []),
                          *(["--bulk-port"] if self.args.bulk_port else []), "--threads", str(self.args.shard_threads))
            self.shard_procs.append(self.procs.start(argv, self.work / f"shard-{i}.log",
                                                     env={**({"DILOCO_SHARD_SINK": "1"} if self.args.sink else {}),
                                                          **profile_env(self.work, i, self.args.profile)} or None))
        self.sampler = Sampler(self.shard_procs, int(self.args.min_free_gib * GIB), self._kill_all)
        addresses = []
        for i, (proc, port_file) in enumerate(zip(self.shard_procs, port_files)):
            try:
                port = wait_for_port(port_file, f"shard {i}", timeout_s=STARTUP_S,
                                     gone=lambda proc=proc: None if proc.poll() is None else
                                     f"exited with code {proc.returncode}")
            except Exception as exc:  # noqa: BLE001 — a one-line reason with the shard's log
                raise RuntimeError(f"shard {i} did not start: {exc}; its log ends:\n"
                                   f"{tail(self.work / f'shard-{i}.log')}") from None
            addresses.append(f"127.0.0.1:{port}")
        self.addresses = addresses
        security = TransportSecurity(secret=secret_file.read_bytes()) if secret_file else PLAINTEXT
        self.clients = [ShardClient(a, security) for a in addresses]

    def seed(self) -> float:
        """Θ of every shard, as its first learner would seed it (over the run secret)."""
        import grpc

        started = time.monotonic()
        owned = shard_fragments(self.combo.fragments, self.combo.shards)
        for i, client in enumerate(self.clients):
            try:
                reply = client.stub.Init(init_frames(self.layout, owned[i]), timeout=3600)
            except grpc.RpcError as exc:
                self._check_low()
                raise RuntimeError(f"shard {i} refused the Init: {exc.code().name} {exc.details()}; its log ends:\n"
                                   f"{tail(self.work / f'shard-{i}.log')}") from None
            if not reply.accepted:
                raise RuntimeError(f"shard {i} was seeded already")
        return time.monotonic() - started

    def start_learners(self) -> None:
        owned = shard_fragments(self.combo.fragments, self.combo.shards)
        for m in range(self.combo.learners):
            spec = {"learner": m, "addresses": self.addresses,
                    "secret_file": str(self.secret_file) if self.secret_file else None,
                    "owned": owned, "payload": self.payload, "tokens_per_step": self.args.tokens_per_step,
                    "warmup_s": self.args.warmup, "push_rate": self.args.push_rate, "paced": self.args.paced,
                    "go_file": str(self.work / "go"), "ready_file": str(self.work / f"ready-{m}"),
                    "stop_file": str(self.work / "stop"), "progress_file": str(self.work / f"progress-{m}"),
                    "report_file": str(self.work / f"report-{m}.json"),
                    "release_file": str(self.work / "release")}
            path = self.work / f"learner-{m}.json"
            path.write_text(json.dumps(spec))
            self.learner_procs.append(self.procs.start(
                [sys.executable, SCALE_SCRIPT, "--worker", str(path)], self.work / f"learner-{m}.log",
                env={"OMP_NUM_THREADS": "1"}))
        self.sampler.learners = list(self.learner_procs)
        deadline = time.monotonic() + STARTUP_S
        while not all((self.work / f"ready-{m}").is_file() for m in range(self.combo.learners)):
            self._check_children()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the learners did not join within {STARTUP_S:g} s")
            time.sleep(0.05)

    def _check_low(self) -> None:
        if self.sampler is not None and self.sampler.low:
            raise MemoryError(self.sampler.low)

    def _check_children(self) -> None:
        self._check_low()
        for i, proc in enumerate(self.shard_procs):
            if proc.poll() is not None:
                raise RuntimeError(f"shard {i} exited with code {proc.returncode}; its log ends:\n"
                                   f"{tail(self.work / f'shard-{i}.log')}")
        for m, proc in enumerate(self.learner_procs):
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"learner {m} exited with code {proc.returncode}; its log ends:\n"
                                   f"{tail(self.work / f'learner-{m}.log')}")

    def _sleep_until(self, t: float) -> None:
        while (left := t - time.time()) > 0:
            self._check_children()
            time.sleep(min(left, 0.1))

    def measure(self) -> dict[str, Any]:
        """Go; warm up; a window of at least --seconds that also holds --min-pushes pushes taken per
        shard (at most --max-seconds); then the learners' reports and each shard's Status."""
        args = self.args
        t0 = time.time() + 0.5
        (self.work / "go.tmp").write_text(repr(t0))
        (self.work / "go.tmp").rename(self.work / "go")
        self._sleep_until(t0)
        self.sampler.loaded = True
        w0 = t0 + args.warmup
        self._sleep_until(w0)
        cpu0 = [cpu_seconds(p.pid) for p in self.shard_procs]
        profiles0 = read_profiles(self.work, self.combo.shards, args.profile)
        rounds0 = self._rounds()
        self._sleep_until(w0 + args.seconds)
        wanted = args.min_pushes * self.combo.shards
        while time.time() < w0 + args.max_seconds and self._progress() < wanted:
            self._sleep_until(time.time() + 0.2)
        w1 = time.time()
        cpu1 = [cpu_seconds(p.pid) for p in self.shard_procs]
        profiles = window_profiles(profiles0, read_profiles(self.work, self.combo.shards, args.profile))
        rounds1 = self._rounds()
        self.sampler.sample()
        self.sampler.loaded = False  # the window is over: what the shards do next is not load
        (self.work / "stop.tmp").write_text(repr(w1))
        (self.work / "stop.tmp").rename(self.work / "stop")
        deadline = time.monotonic() + PUSH_BOUND_S + DRAIN_S + 60
        while not all((self.work / f"report-{m}.json").is_file() for m in range(self.combo.learners)):
            self._check_children()
            if time.monotonic() > deadline:
                raise RuntimeError("the learners did not report after the window")
            time.sleep(0.05)
        reports = [json.loads((self.work / f"report-{m}.json").read_text()) for m in range(self.combo.learners)]
        statuses = []
        with self.sampler.probing():  # the learners are done: the shards answer at once
            for c in self.clients:
                try:
                    status = c.status(timeout_s=120)
                    statuses.append({"rounds": status.rounds, "alive": list(status.alive),
                                     "report": json.loads(status.report_json)})
                except Exception as exc:  # noqa: BLE001 — the figures stand without it
                    statuses.append({"error": str(exc)})
        (self.work / "release").write_text("read\n")  # the learners may disconnect now
        return {"window": (w0, w1), "reports": reports, "statuses": statuses,
                "rounds_closed": [None if a is None or b is None else b - a for a, b in zip(rounds0, rounds1)],
                "cpu_s": [b - a for a, b in zip(cpu0, cpu1)], "profiles": profiles, "join": self.join()}

    def join(self) -> dict[str, Any]:
        """What a learner joining now pulls: Θ of every shard, whole (fp32), timed: as a join pulls it,
        each fragment on its own stream, PULL_STREAMS at once over all shards (observer pulls, which change
        nothing on the shards)."""
        from diloco.client.joining import PULL_STREAMS

        owned = shard_fragments(self.combo.fragments, self.combo.shards)
        pulls = [(c, p) for c, mine in zip(self.clients, owned) for p in mine]

        def pull(client: Any, p: int) -> int:
            values = client.pull(0, observer=True, fragments=[p]).values
            return sum(v.numel() * v.element_size() for v in values.values())

        times = []
        for _ in range(max(1, self.args.joins)):
            started = time.perf_counter()
            try:
                with ThreadPoolExecutor(max_workers=min(PULL_STREAMS, len(pulls))) as pool:
                    pulled = sum(pool.map(lambda cp: pull(*cp), pulls))
            except Exception as exc:  # noqa: BLE001 — the run's other figures stand without it
                return {"error": f"{type(exc).__name__}: {exc}"}
            times.append(time.perf_counter() - started)
        return {"seconds": statistics.median(times), "join_seconds": times, "bytes": pulled,
                "streams": min(PULL_STREAMS, len(pulls))}

    def _rounds(self) -> list[int | None]:
        return [rounds_closed(c) for c in self.clients]

    def _progress(self) -> int:
        """Pushes taken since the window opened, summed over the learners' progress files."""
        total = 0
        for m in range(self.combo.learners):
            with contextlib.suppress(OSError, ValueError):
                total += int((self.work / f"progress-{m}").read_text())
        return total

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()
        self.procs.stop(self.learner_procs, grace_s=5.0, sig=signal.SIGKILL)
        self.procs.stop(self.shard_procs, grace_s=10.0)
        if self.sampler is not None:
            self.sampler.close()


SCALE_SCRIPT = str(Path(__file__).with_name("scale.py"))
"""The benchmark itself: its learners are `scale.py --worker SPEC` processes."""
def summarize(combo: Combo, m: dict[str, Any], sampler: Sampler) -> dict[str, Any]:
    """Per shard and in all: MB/s, latencies, rounds/s, memory."""
    w0, w1 = m["window"]
    seconds = w1 - w0
    per_shard = []
    all_latencies: list[float] = []
    problems = []
    for i in range(combo.shards):
        rows = [r["shards"][i] for r in m["reports"]]
        latencies = sorted(x for r in rows for x in r["latencies"])
        all_latencies += latencies
        status = m["statuses"][i]
        report = status.get("report", {})
        memory = report.get("memory")
        refused, busy, unanswered = (sum(r[k] for r in rows) for k in ("refused", "busy", "unanswered"))
        errors = [r["first_error"] for r in rows if r["first_error"]]
        if refused or errors:
            problems.append(f"shard {i}: {refused} pushes refused, {busy} busy; {errors[0] if errors else ''}")
        if unanswered:
            problems.append(f"shard {i}: {unanswered} pushes of the window unanswered")
        if "error" in status:
            problems.append(f"shard {i}: no Status after the window ({status['error']})")
        elif len(status["alive"]) < combo.learners:
            problems.append(f"shard {i}: only {len(status['alive'])} of {combo.learners} learners alive at the end")
        rounds = {tuple(x) for r in rows for x in r["rounds"]}
        push_params = sum(r["push_params"] for r in rows)
        per_shard.append({
            "shard": i, "fragments": report.get("fragments"),
            "cpu_s": m["cpu_s"][i], "push_params": push_params, "cpu_profile": m["profiles"][i],
            "cpu_ns_per_param": m["cpu_s"][i] * 1e9 / push_params if push_params else None,
            "rss_bytes": sampler.rss_load[i], "hwm_bytes": sampler.hwm[i],
            "theta_bytes": memory.get("theta_bytes") if isinstance(memory, dict) else None, "memory": memory,
            "push_mb_s": sum(r["push_bytes"] for r in rows) / seconds / MB,
            "pull_mb_s": sum(r["pull_bytes"] for r in rows) / seconds / MB,
            "pushes": sum(r["pushes"] for r in rows), "answers": sum(r["answers"] for r in rows),
            "unanswered": unanswered, "refused": refused, "busy": busy,
            "push_errors": report.get("push_errors"),
            "latency_median_s": statistics.median(latencies) if latencies else None,
            "latency_p95_s": percentile(latencies, 0.95),
            "rounds_per_s": len(rounds) / seconds,
            "rounds_closed": (closed := m["rounds_closed"][i]),
            "pushes_per_round": push_params * combo.fragments / combo.params / closed if closed else None,
        })
    all_latencies.sort()
    largest = max(range(combo.shards), key=lambda i: per_shard[i]["rss_bytes"])
    pushed = sum(s["push_params"] for s in per_shard)
    return {
        "seconds": seconds,
        "cpu_ns_per_param": sum(s["cpu_s"] for s in per_shard) * 1e9 / pushed if pushed else None,
        "push_mb_s": sum(s["push_mb_s"] for s in per_shard), "pull_mb_s": sum(s["pull_mb_s"] for s in per_shard),
        "rss_bytes": per_shard[largest]["rss_bytes"], "hwm_bytes": max(s["hwm_bytes"] for s in per_shard),
        "theta_bytes": per_shard[largest]["theta_bytes"], "memory": per_shard[largest]["memory"],
        "latency_median_s": statistics.median(all_latencies) if all_latencies else None,
        "latency_p95_s": percentile(all_latencies, 0.95),
        "rounds_per_s": sum(s["rounds_per_s"] for s in per_shard), "join": m["join"],
        "pushes_per_round": pushed * combo.fragments / combo.params / closed
        if (closed := sum(s["rounds_closed"] or 0 for s in per_shard)) else None,
        "learners_rss_bytes": sampler.learners_rss, "min_available_bytes": sampler.min_available,
        "problems": problems, "per_shard": per_shard,
    }


def run_combo(procs: Processes, root: Path, combo: Combo, args: argparse.Namespace, model: MemoryModel,
              console) -> dict[str, Any]:
    layout = model_layout(combo.params, combo.fragments, args.max_tensor)
    owned = shard_fragments(combo.fragments, combo.shards)
    per_shard_params = max(sum(t.numel for p in o for t in layout[p]) for o in owned)
    record: dict[str, Any] = {
        "params": combo.params, "learners": combo.learners, "shards": combo.shards, "codec": combo.codec,
        "down_codec": combo.down, "fragments": combo.fragments, "params_per_shard": per_shard_params,
        "seconds": args.seconds, "warmup_s": args.warmup, "journal": args.journal, "secret": not args.plaintext,
        "quorum": min(args.quorum, combo.learners), "key": combo.key, "status": "ok", "reason": "",
        "rss_bytes": None, "push_mb_s": None, "pull_mb_s": None, "socket_mb_s": None, "push_vs_socket": None,
        "pull_vs_socket": None, "join_vs_socket": None, "cpu_ns_per_param": None, "roofline_ns_per_param": None, "cpu_vs_roofline": None,
        "paced": args.paced, "sink": args.sink, "push_rate": args.push_rate, "shard_threads": args.shard_threads,
    }
    predicted, how = model.predict(combo.key, per_shard_params, combo.learners)
    need = predicted * combo.shards + combo.learners * LEARNER_RSS_BYTES
    available = mem_available()
    record["predicted_peak_bytes"] = predicted
    margin = int(args.min_free_gib * GIB)
    if need > available - margin:
        why = (f"needs ~{need / GIB:.1f} GiB ({combo.shards} shard(s) of ~{predicted / GIB:.1f} GiB, {how}; "
               f"{combo.learners} learners), {available / GIB:.1f} GiB available, "
               f"{args.min_free_gib:g} GiB to keep free")
        if not args.force:
            record.update(status="skipped", reason=why + " (--force runs it anyway)")
            return record
        console.print(f"[yellow]running anyway (--force): {why}[/]")
    name = f"payload-{combo.codec}-{args.block}-{combo.params}-{combo.fragments}-{args.max_tensor}"
    payload = write_payloads(root / name, layout, combo.codec, args.block)
    work = root / (f"run-{combo.params}-{combo.learners}l-{combo.shards}s-{combo.codec}-{combo.down}")
    work.mkdir(parents=True, exist_ok=True)
    run = Run(procs, work, combo, args, payload, layout, console)
    try:
        run.start_shards()
        record["seed_s"] = run.seed()
        run.start_learners()
        measured = run.measure()
    except MemoryError as exc:
        record.update(status="aborted", reason=str(exc))
        measured = None
    except Exception as exc:  # noqa: BLE001 — this combination failed: say why, go on with the next
        if run.sampler is not None and run.sampler.low:
            record.update(status="aborted", reason=run.sampler.low)
        else:
            record.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
        measured = None
    finally:
        run.close()
    sampler = run.sampler
    record["hwm_bytes"] = max(sampler.hwm) if sampler else None
    if measured is None:
        record["rss_bytes"] = max(sampler.rss_max) if sampler else None
        if record["status"] == "aborted":  # it needed more than it had reached
            model.runs.append({**record, "hwm_bytes": max(record["hwm_bytes"] or 0, predicted)})
        return record
    record.update(summarize(combo, measured, sampler))
    model.runs.append(record)
    largest = max(sum(t.numel for t in tensors) for tensors in layout)
    record["roofline_ns_per_param"] = roofline_ns_per_param(largest)
    if record["cpu_ns_per_param"] is not None:
        record["cpu_vs_roofline"] = record["cpu_ns_per_param"] / record["roofline_ns_per_param"]
    largest_fragment = max(payload["fragments"].values(), key=lambda f: f["bytes"])
    try:
        sock = socket_baseline(procs, work, largest_fragment["file"], args.socket_seconds)
    except (OSError, RuntimeError) as exc:
        record["problems"].append(f"no socket baseline: {exc}")
        return record
    record["socket_mb_s"] = sock["mb_s"]
    record["message_bytes"] = sock["message_bytes"]
    record["push_vs_socket"] = max(s["push_mb_s"] for s in record["per_shard"]) / sock["mb_s"]
    record["pull_vs_socket"] = max(s["pull_mb_s"] for s in record["per_shard"]) / sock["mb_s"]
    join = record.get("join") or {}
    if "seconds" in join:  # join time over the plain socket's time for the same bytes
        record["join_s"], record["join_bytes"] = join["seconds"], join["bytes"]
        record["join_vs_socket"] = join["seconds"] / (join["bytes"] / (sock["mb_s"] * MB))
    return record
