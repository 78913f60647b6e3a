"""`diloco run`: the syncer shard(s) and every learner as processes on this machine.

The launcher itself is an observer: it starts the children with the same config, shows each
learner's progress from the syncer's status, evaluates Θ at the configured token marks (a read-only
pull), and at the end merges the children's reports into `summary.json`, in the shape `diloco sim`
writes plus `wall_clock_s`, next to the final model (`model.pt`) and the children's logs.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.config import Config, Topology
from diloco.driver_kit.run_summary import build_run_result
from diloco.driver_kit.schedule import EvalMarks, planned_tokens
from diloco.errors import DilocoError
from diloco.materials import prepare
from diloco.metrics import open_metrics
from diloco.metrics.records import learner_lives
from diloco.outputs import write_output, writing
from diloco.process_times import ORIGIN_ENV
from diloco.transport.ports import read_port_file, wait_for_port
from diloco.launch.child_reports import learner_outcomes, merge_metrics, report_from_metrics, unfinished_syncers
from diloco.launch.outages import RegionOutages
from diloco.launch.processes import Child, Children
from diloco.launch.rank_group import group_command
from diloco.transport.run_settings import check_shards
from diloco.transport.wire_messages import settings_of
from diloco.shard.ownership import placed_shard_count
from diloco.strategies import build_strategy
from diloco.training import evaluate
from diloco.transport.calls import ShardClient
from diloco.transport.security import PLAINTEXT, TransportSecurity

POLL_S = 0.5
STARTUP_TIMEOUT_S = 60.0
"""Bound on the children's start (imports, binding); a start that takes longer is reported, not awaited."""
ONE_XLA_THREAD = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
"""A JAX learner's XLA held to one thread, as OMP_NUM_THREADS=1 holds a torch learner's."""


@dataclass
class Progress:
    """What the launcher shows while the run goes on."""

    tokens: dict[int, int] = field(default_factory=dict)
    planned: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    eval_loss: float | None = None


class Launcher:
    def __init__(self, config: Config, config_args: list[str], out: Path, shards: int = 1,
                 verbose: bool = False, security: TransportSecurity | None = None,
                 env: dict[str, str] | None = None, http_auth: bool = False, bulk_port: bool = True) -> None:
        """`config_args` (CONFIG and --set), `security` and `env` (a generated shared secret) reach every
        child: options by argv, the secret only by environment. HTTP endpoints listen on loopback only
        (`http_auth`: requiring the secret). `bulk_port`: shards move Θ, pushes and answers on a bulk port
        too (`transport/bulk.py`)."""
        settings_of(config)  # refuses a strategy the real runtime cannot run, with the reason
        shards = placed_shard_count(config, shards)  # with `placement = "links"`, one per home region
        check_shards(config, shards)
        self.config, self.out, self.shard_count = config, out, shards
        self.shared = self.shared_folder(config, out)
        """Where the children write (state, journals, checkpoints, reports, logs, ports): the output folder
        itself on one machine; a folder every node sees on a cluster."""
        if "," in str(self.shared):
            raise DilocoError(f"--out {self.shared}: a path with a comma cannot be used")
        self.security = security or PLAINTEXT
        self.bulk_args = ["--bulk-port"] if bulk_port else []
        self.http_args = ["--http-bind", "127.0.0.1", *(["--http-auth"] if http_auth else [])]
        self.config_args = [*config_args, *(["--verbose"] if verbose else []), *self.security.argv]
        self.children = self.make_children()
        self.ports = self.shared / "ports"
        """Where each child writes the ports it got: every server here binds port 0."""
        self.addresses: list[str] = []
        """Each shard's address, once it has reported its port."""
        self.region_addresses: dict[str, str] = {}
        """With the regional tier, each region's syncer, once it has reported its port."""
        self.region_clients: list[ShardClient] = []
        self.started_unix = clock.now()
        self.origin_monotonic = clock.monotonic()
        """The run's time 0 (as the children's metrics count it) on this process's monotonic clock."""
        self.env = {ORIGIN_ENV: repr(self.started_unix), **(env or {})}
        self.endpoints: dict[str, str] = {}
        """What each child serves, once it has reported its port: its Prometheus metrics and, for
        shard 0, the status page."""
        self.endpoint_files: dict[str, tuple[Path, str]] = {}
        """Each endpoint's port file, and its URL with {} for the port."""
        self.metrics = open_metrics(self.shared / "metrics", name="launcher", origin=self.started_unix)
        self.clients: list[ShardClient] = []
        torch.set_num_threads(1)  # evaluating Θ here must not take the cores the learners share
        materials = prepare(config)
        self.eval_batches, self.model = materials.eval_batches, materials.model
        self.budget = config.token_budget()
        self.progress = Progress(planned=dict(enumerate(planned_tokens(config))))
        self.eval_marks = EvalMarks(config)
        self.eval_curve: list[dict[str, float]] = []
        self.started = clock.monotonic()
        self.expected_down: set[str] = set()
        """Children that are down on purpose (the chaos command's kills) and will be restarted."""

    # ------------------------------------------------------------ the run

    def run(self, on_progress: Callable[[Progress], None] | None = None,
            before_learners: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """`before_learners`: once the syncers are started, on this thread (the chaos command's spares)."""
        try:
            self._start_syncers()
            self._start_regions()
            before_learners()
            self._start_learners()
            self.outages = RegionOutages(self)
            self.outages.start()
            self.training_started = clock.monotonic()
            self._watch(on_progress)
            self.training_s = clock.monotonic() - self.training_started
            self._wait_finished()
            summary = self._summarise()
            self.children.stop("region", sig=signal.SIGTERM)
            self.children.stop("syncer", sig=signal.SIGTERM)
            self.result.cluster = self.cluster_report(self.result.tokens_merged)  # with the shards' ends
            outages = {"outages": self.outages.log} if self.outages.plan else {}
            return {**summary, "cluster": self.result.cluster, **outages}
        finally:
            self.stop()

    # ------------------------------------------------------------ what a cluster launcher changes

    launcher_name = "local"
    emulate_link = True
    """Every learner's traffic shaped to `link.*`: on one machine there is no other link to study."""
    learner_threads = 1
    """One thread per learner: on one machine they share its cores."""

    @staticmethod
    def shared_folder(config: Config, out: Path) -> Path:
        return out

    def make_children(self) -> Children:
        return Children(self.shared / "logs")

    def _place(self, name: str) -> str:
        """Where the child `name` will run, as the host others reach it at: here, this machine."""
        return "127.0.0.1"

    def _tend(self) -> None:
        """Called on every look at the run: a cluster launcher replaces what it lost here."""

    def cluster_report(self, tokens_merged: float) -> dict[str, Any]:
        """What a cluster run used (nothing on one machine)."""
        return {}

    def may_vanish(self, learner: int) -> bool:
        """Whether a learner may end without its report (its node went away and nobody replaced it)."""
        return False

    def learner_ids(self) -> list[int]:
        """Every learner that took part."""
        return list(range(self.config.learners.count))

    def stop(self) -> None:
        """Learners first (they push what they have and leave), then the shards (they save their state);
        then every process's metrics are merged into one time-ordered metrics.jsonl."""
        if hasattr(self, "outages"):
            self.outages.done.set()
        self.children.stop("learner")
        self.children.stop("region", sig=signal.SIGTERM)
        self.children.stop("syncer", sig=signal.SIGTERM)
        self.children.close()
        for client in self.clients + self.region_clients:
            client.close()
        self.metrics.close()
        merge_metrics(self.shared / "metrics", self.out / "metrics.jsonl")

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "diloco", *args, *self.config_args]

    def _start_syncers(self) -> None:
        """Every shard binds port 0 and reports its port; each completes its shard map from the others'
        reports. Learners get the addresses once every shard has reported."""
        for path in self.ports.glob("*.port"):
            path.unlink()  # a previous run's ports in the same folder
        port_files = [self.ports / f"syncer-{i}.port" for i in range(self.shard_count)]
        hosts = [self._place(f"syncer-{i}") for i in range(self.shard_count)]
        shard_map = ",".join(f"{host}:@{path}" for host, path in zip(hosts, port_files))
        for i, (host, port_file) in enumerate(zip(hosts, port_files)):
            self.children.start(f"syncer-{i}", self._python(
                "syncer", "--bind", f"{host}:0", "--port-file", str(port_file), "--shards", shard_map,
                "--shard", f"{i}/{self.shard_count}", "--out", str(self.shared),
                *self.bulk_args, *self._endpoint_args(f"syncer-{i}", status=i == 0)), env=self.env)
        for i, (host, port_file) in enumerate(zip(hosts, port_files)):
            child = self.children.children[f"syncer-{i}"]
            port = wait_for_port(port_file, f"syncer-{i}", gone=child.why_gone,
                                 timeout_s=STARTUP_TIMEOUT_S)
            child.set_option("--bind", f"{host}:{port}")  # a restarted shard serves where learners look for it
            self.addresses.append(f"{host}:{port}")
            self.clients.append(ShardClient(self.addresses[-1], self.security))
        self._collect_endpoints()

    def _start_regions(self) -> None:
        """With the regional tier, a syncer per region with learners, each a learner of the global shards."""
        for region in Topology(self.config).tier_regions():
            name = f"region-{region.name}"
            port_file = self.ports / f"{name}.port"
            host = self._place(name)
            emulate = ["--emulate-link"] if self.emulate_link else []
            self.children.start(name, self._python(
                "syncer", "--region", region.name, "--upstream", self.addresses[0], "--bind", f"{host}:0",
                "--port-file", str(port_file), "--out", str(self.shared), *emulate,
                *self.bulk_args, *self._endpoint_args(name)), env=self.env)
            child = self.children.children[name]
            port = wait_for_port(port_file, name, gone=child.why_gone,
                                 timeout_s=STARTUP_TIMEOUT_S)
            child.set_option("--bind", f"{host}:{port}")  # a restarted region serves where its learners look
            self.region_addresses[region.name] = f"{host}:{port}"
            self.region_clients.append(ShardClient(f"{host}:{port}", self.security))

    def _start_learners(self) -> None:
        for m in range(self.config.learners.count):
            self._start_learner(m)

    def syncer_of(self, m: int) -> str:
        """Where learner m syncs: its region's syncer with the regional tier, else the syncer."""
        region = Topology(self.config).region_of(m)
        return self.region_addresses[region] if region in self.region_addresses else self.addresses[0]

    def learner_env(self) -> dict[str, str]:
        """What every learner's process gets in its environment (a spare learner too)."""
        return {"OMP_NUM_THREADS": str(self.learner_threads), **(ONE_XLA_THREAD if self.learner_threads == 1 else {}),
                **self.env}

    def _start_learner(self, m: int) -> None:
        self._place(f"learner-{m}")
        emulate = ["--emulate-link"] if self.emulate_link else []
        self.children.start(f"learner-{m}", group_command(self.config.learners.ranks_of(m), self._python(
            "learner", "--syncer", self.syncer_of(m), "--id", str(m), *emulate,
            "--framework", self.config.learners.framework_of(m),
            "--out", str(self.shared), *self._endpoint_args(f"learner-{m}"))), env=self.learner_env())

    def _endpoint_args(self, name: str, status: bool = False) -> list[str]:
        """A child's Prometheus endpoint (and status page) on any free port, reported in a port file."""
        metrics = self.ports / f"{name}.metrics.port"
        self.endpoint_files[f"{name} metrics"] = (metrics, "http://127.0.0.1:{}/metrics")
        args = ["--metrics-port", "0", "--metrics-port-file", str(metrics), *self.http_args]
        if status:
            page = self.ports / "status.port"
            self.endpoint_files["status page"] = (page, "http://127.0.0.1:{}/")
            args += ["--status-port", "0", "--status-port-file", str(page)]
        return args

    def _collect_endpoints(self) -> None:
        """The endpoints reported so far (a restarted child reports its new port)."""
        for name, (path, url) in self.endpoint_files.items():
            port = read_port_file(path)
            if port is not None:
                self.endpoints[name] = url.format(port)

    def _check_children(self) -> None:
        """A child that failed ends the run with its name, exit code and last log lines."""
        for child in self.children.children.values():
            code = child.returncode  # read once: a cluster child's code is asked of its node and may change
            if self._failed(child, code):
                raise DilocoError(f"{child.name} exited with code {code}; its log ({child.log_path}) ends:\n"
                                  f"{child.log_tail()}")

    def _failed(self, child: Child, code: int | None) -> bool:
        return code not in (None, 0) and child.name not in self.expected_down

    def _watch(self, on_progress: Callable[[Progress], None] | None) -> None:
        while True:
            self._tend()
            self._check_children()
            learners_done = not self.children.running("learner") and not any(
                n.startswith("learner") for n in self.expected_down)
            try:
                self._poll_status()
            except DilocoError:  # a shard is restarting: look again next time
                pass
            for _ in range(self.eval_marks.passed(sum(self.progress.tokens.values()))):
                try:
                    self._record_eval()
                except DilocoError:  # a shard is restarting: this point is skipped
                    pass
            self._collect_endpoints()
            if on_progress:
                on_progress(self.progress)
            if learners_done:
                return
            clock.sleep(POLL_S)

    def _poll_status(self) -> None:
        """Each learner's tokens as its syncer counts them (its region's, with the regional tier)."""
        rounds = 0
        for client in self.clients:
            status = client.status()
            rounds += status.rounds
            if not self.region_clients:
                self._count_tokens(json.loads(status.report_json))
        for client in self.region_clients:
            self._count_tokens(json.loads(client.status().report_json))
        self.progress.rounds = rounds

    def _count_tokens(self, report: dict[str, Any]) -> None:
        for m, tokens in report.get("tokens_reported", {}).items():
            self.progress.tokens[int(m)] = max(tokens, self.progress.tokens.get(int(m), 0))

    def _wait_finished(self) -> None:
        """Every learner has left: each shard merges what is still open; wait for that to be done."""
        deadline = clock.monotonic() + STARTUP_TIMEOUT_S
        while not self._all_finished():
            self._check_children()
            if clock.monotonic() > deadline:
                names = [*(f"syncer-{i}" for i in range(len(self.clients))),
                         *(f"region-{r.name}" for r in Topology(self.config).tier_regions())]
                syncers = [(self.children.children[n], c) for n, c in zip(names, self.clients + self.region_clients)]
                raise DilocoError(unfinished_syncers(syncers, STARTUP_TIMEOUT_S))
            clock.sleep(0.1)

    def _all_finished(self) -> bool:
        try:
            return all(c.status().finished for c in self.clients + self.region_clients)
        except DilocoError:
            return False

    # ------------------------------------------------------------ evaluation and the summary

    def home_order(self) -> list[str]:
        """The home regions in the order the fragments first name them: the simulator lists a sender's
        routes to them, so their links, in that order."""
        return list(dict.fromkeys(Topology(self.config).fragment_homes(build_strategy(self.config).fragments)))

    def pull_theta(self) -> dict[str, torch.Tensor]:
        return {name: value for client in self.clients for name, value in client.pull(0, observer=True)[0].items()}

    def _record_eval(self) -> float:
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, value in self.pull_theta().items():
                params[name].copy_(value)
        loss = evaluate(self.model, self.eval_batches)
        point = {"time_s": clock.monotonic() - self.training_started, "tokens": sum(self.progress.tokens.values()),
                 "loss": loss}
        self.eval_curve.append(point)
        self.metrics.record("eval", tokens=point["tokens"], loss=loss)
        self.progress.eval_loss = loss
        return loss

    def _summarise(self) -> dict[str, Any]:
        from diloco.results import links_from_learners, links_from_regions, sent_by_home, traffic_fields

        self._collect_endpoints()
        self._record_eval()
        with writing(self.out / "model.pt"):
            torch.save(self.model.state_dict(), self.out / "model.pt")
        shards = [json.loads(c.status().report_json) for c in self.clients]
        write_output(self.out / "syncer" / "shards.json", json.dumps(shards, indent=2) + "\n")
        regions = [json.loads(c.status().report_json) for c in self.region_clients]
        if regions:
            write_output(self.out / "syncer" / "regions.json", json.dumps(regions, indent=2) + "\n")
        learners_syncers = regions or shards
        """Where the learners' ledgers are: their regions' syncers with the regional tier."""
        lives = learner_lives(self.shared / "metrics")
        learners = []
        for m in self.learner_ids():
            path = self.shared / "learners" / f"learner-{m}.json"
            if path.is_file():
                learners.append(json.loads(path.read_text()))
            elif self.may_vanish(m) and m in lives:
                speeds = self.config.speeds()
                learners.append(report_from_metrics(m, lives[m][-1], speeds[m] if m < len(speeds) else 1.0))
            else:
                raise DilocoError(f"learner {m} left no report at {path}")
        parameters = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        numel = {int(p): n for shard in shards for p, n in shard.get("fragment_numel", {}).items()}
        rounds = [r for shard in shards for r in shard.get("rounds", [])]
        outcomes = learner_outcomes(learners, lives, learners_syncers, numel)
        order = self.home_order()
        by_home = {r["learner"]: sent_by_home(r["bytes_by_home"], order) for r in learners if "bytes_by_home" in r}
        result = build_run_result(
            strategy=self.config.strategy, outcomes=outcomes, training_time_s=self.training_s,
            eval_curve=self.eval_curve, round_records=rounds,
            peak_sync_bytes=max(r["peak_message_bytes_up"] for r in learners),
            rounds=len(rounds), parameters=parameters, config=self.config.to_dict(),
            clock="real", wall_clock_s=clock.monotonic() - self.started,
            duplicates=sum(e.get("duplicates", 0) for s in shards + regions for e in s.get("ledger", {}).values()),
            shards=self.shard_count, endpoints=dict(self.endpoints), launcher=self.launcher_name,
            cluster=self.cluster_report(tokens_merged=sum(o.tokens_split["merged"] for o in outcomes)),
            **traffic_fields(links_from_learners(self.config, [o.report for o in outcomes], by_home)
                             + links_from_regions(self.config, regions, order)))
        self.result = result
        return result.summary()
