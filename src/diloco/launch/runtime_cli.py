"""The real runtime's commands: `diloco run`, `diloco syncer`, `diloco learner`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from diloco.config import Config, load_config
from diloco.console import learners_table, progress_bars, results_table, show_outputs
from diloco.errors import DilocoError
from diloco.metrics import open_metrics
from diloco.outputs import output_folder, write_output
from diloco.launch.ignored_keys import warn_ignored
from diloco.transport.ports import report_port, resolve_address, write_port_file
from diloco.status.endpoint import LOOPBACK, HttpExposure, credentials_for
from diloco.state_files import file_key
from diloco.transport.security_settings import TransportSecurity, add_security_arguments, security_from_args, with_run_secret

if TYPE_CHECKING:  # these load torch and gRPC: the commands import them when they run
    import grpc

    from diloco.launch.launcher import Launcher
    from diloco.shard.server import SyncerShard
    from diloco.status.server import StatusServer

METRICS_EVERY_S = 2.0
"""How often a syncer shard records its own metrics."""


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config; the built-in default when omitted")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")


def config_args(args: argparse.Namespace) -> list[str]:
    """The config options as given, to pass on to child processes."""
    return ([args.config] if args.config else []) + [x for item in args.set or [] for x in ("--set", item)]


def runtime_config(args: argparse.Namespace) -> Config:
    """The config, with a warning for each key set in it that the real runtime ignores."""
    config = load_config(args.config, args.set or [])
    warn_ignored(config, args.command)
    return config


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM: the process finishes its step, saves its state and exits."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within it, SIGTERM (what `kill` and service managers send) is Ctrl-C: a KeyboardInterrupt, so a
    launcher stops its children in the same order (learners push and leave, then shards save)."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def port_number(text: str) -> int:
    """argparse type of a TCP port: 0..65535 (0 takes any free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0..65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0..65535)")
    return port


def add_http_auth_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-auth", action="store_true",
                   help="serve Prometheus metrics and the status page only to requests carrying the shared secret "
                        "(--secret-file or $DILOCO_SECRET) or its token: 'Authorization: Bearer TOKEN' or "
                        "'x-diloco-secret: TOKEN'")


def check_http_auth(args: argparse.Namespace, security: TransportSecurity) -> None:
    """--http-auth needs a secret the user knows (one `diloco run` makes up would lock everyone out)."""
    if getattr(args, "http_auth", False) and security.secret is None:
        raise DilocoError("--http-auth needs the shared secret: give --secret-file FILE or set DILOCO_SECRET")


def http_exposure(args: argparse.Namespace, default_host: str, security: TransportSecurity) -> HttpExposure:
    """Where this process's HTTP endpoints listen (--http-bind, else `default_host`), and for whom."""
    check_http_auth(args, security)
    host = args.http_bind or default_host
    return HttpExposure(host, credentials_for(security.secret) if args.http_auth else ())


# ---------------------------------------------------------------- diloco run


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_security_arguments(p)
    p.add_argument("--out", metavar="DIR", help="output folder (default: runs/run-STRATEGY-TIME)")
    p.add_argument("--shards", type=int, default=1, metavar="N", help="syncer shard processes (default 1)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run on the Ray cluster at ADDRESS (`local`: a Ray instance on this machine, stopped at "
                        "the end); needs the `ray` extra. See docs/cluster.md")
    add_http_auth_argument(p)


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    """Ctrl-C or SIGTERM: learners push what they have and leave, shards save their state; exit 130."""
    from diloco.launch.launcher import Launcher

    config = runtime_config(args)
    if args.shards < 1:
        raise DilocoError("--shards must be at least 1")
    configured = security_from_args(args, role="both")
    check_http_auth(args, configured)
    out = output_folder(Path(args.out) if args.out else
                        Path("runs") / f"run-{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    security, secret_env = with_run_secret(configured)
    options = dict(shards=args.shards, verbose=args.verbose, security=security, env=secret_env,
                   http_auth=args.http_auth)
    with sigterm_as_interrupt():
        if args.ray:
            launcher = ray_launcher()(config, config_args(args), out, address=args.ray, **options)
        else:
            launcher = Launcher(config, config_args(args), out, **options)
        try:
            summary = launcher.run() if args.quiet else _run_with_bars(launcher)
        except KeyboardInterrupt:
            console.print(f"interrupted: learners pushed what they had and left; state saved in {launcher.shared}")
            return 130
    write_output(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    if not args.quiet:
        table = results_table(launcher.result, f"diloco run: {config.strategy}, {config.learners.count} learners")
        table.add_row("wall-clock (whole command)", f"{summary['wall_clock_s']:.1f} s")
        console.print(table)
        console.print(learners_table(launcher.result))
    show_outputs(console, out)
    return 0


def ray_launcher() -> type[Launcher]:
    """The Ray launcher, imported only when asked for: `import diloco` never imports Ray."""
    try:
        from diloco.cluster.ray_launcher import RayLauncher
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise DilocoError("--ray needs Ray: pip install 'diloco[ray]'") from None
    return RayLauncher


def _run_with_bars(launcher: Launcher) -> dict[str, Any]:
    """The launcher's run, with a bar per learner (its tokens) and one for the syncer (its rounds)."""
    with progress_bars("{task.description}", "{task.fields[detail]}") as bars:
        speeds = launcher.config.speeds()
        tasks = {m: bars.add_task(f"learner {m} (speed {speeds[m]:g})", total=planned, detail="")
                 for m, planned in launcher.progress.planned.items()}
        planned_beyond = list(launcher.progress.planned.values())[-1]
        syncer = bars.add_task("syncer", total=None, detail="starting")
        shown: list[bool] = []

        def show(progress) -> None:
            if not shown and "status page" in launcher.endpoints:
                bars.console.print(f"status page: {launcher.endpoints['status page']}")
                shown.append(True)
            for m in progress.tokens.keys() - tasks.keys():  # an elastic run's new learners
                tasks[m] = bars.add_task(f"learner {m} (speed 1)", total=planned_beyond, detail="")
            for m, task in tasks.items():
                done = progress.tokens.get(m, 0)
                bars.update(task, completed=done, detail=f"{done:,} tokens")
            loss = f", eval loss {progress.eval_loss:.3f}" if progress.eval_loss is not None else ""
            bars.update(syncer, detail=f"{progress.rounds} rounds merged{loss}")

        return launcher.run(on_progress=show)


# ---------------------------------------------------------------- diloco chaos


def add_chaos_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_security_arguments(p)
    p.add_argument("--kill-learners", type=int, default=10, metavar="N", help="learner kills (default 10)")
    p.add_argument("--kill-syncer", type=int, default=2, metavar="N", help="syncer shard kills (default 2)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seeds the kill times and victims")
    p.add_argument("--restart-after", type=float, default=2.0, metavar="S",
                   help="seconds from a kill to the restart (default 2)")
    p.add_argument("--shards", type=int, default=1, metavar="N", help="syncer shard processes (default 1)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: runs/chaos-TIME)")
    add_http_auth_argument(p)


def cmd_chaos(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from diloco.launch.chaos import run_chaos

    config = runtime_config(args)
    if min(args.kill_learners, args.kill_syncer) < 0 or args.restart_after < 0:
        raise DilocoError("--kill-learners, --kill-syncer and --restart-after must be zero or positive")
    configured = security_from_args(args, role="both")
    check_http_auth(args, configured)
    out = output_folder(Path(args.out) if args.out else Path("runs") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    security, secret_env = with_run_secret(configured)
    console.print(f"fault-free run, then {args.kill_learners} learner and {args.kill_syncer} syncer kills "
                  f"(seed {args.seed}); about twice as long as `diloco run`")
    with sigterm_as_interrupt():  # as Ctrl-C: the launcher running stops its children in order
        result = run_chaos(config, config_args(args), out, kill_learners=args.kill_learners,
                           kill_syncer=args.kill_syncer, seed=args.seed, restart_after_s=args.restart_after,
                           shards=args.shards, security=security, env=secret_env, http_auth=args.http_auth)
    clean, faulty = result["clean"], result["faulty"]
    table = Table(title=f"diloco chaos: {len(result['kills'])} kills, seed {args.seed}")
    for column in ("", "fault-free", "with kills", "target"):
        table.add_column(column, justify="right")
    goodput = faulty["goodput_of_survivors"]
    table.add_row("final eval loss", f"{clean['final_eval_loss']:.4f}", f"{faulty['final_eval_loss']:.4f} "
                  f"({result['loss_vs_clean']:+.2%})", "within 2%")
    table.add_row("goodput of surviving learners", f"{clean['goodput']:.3f}",
                  "none survived" if goodput is None else f"{goodput:.3f}", "≥ 0.95")
    table.add_row("goodput of every learner, in its last life", "", f"{faulty['goodput_while_up']:.3f}", "")
    table.add_row("rounds merged", str(clean["rounds"]), str(faulty["rounds"]), "")
    table.add_row("tokens trained / lost", "", f"{faulty['tokens_trained']:,} / {faulty['tokens_lost']:,.0f}",
                  "each accounted")
    table.add_row("tokens counted twice", "", f"{faulty['tokens_counted_twice']:,.0f}", "0")
    table.add_row("retried pushes recognised", "", str(faulty["retries_recognised"]), "")
    console.print(table)
    console.print(f"details: {out / 'chaos.json'}")
    return 0 if faulty["tokens_counted_twice"] == 0 else 1


# ---------------------------------------------------------------- diloco syncer


def add_syncer_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_security_arguments(p)
    p.add_argument("--bind", default="127.0.0.1:7070", metavar="HOST:PORT",
                   help="address to serve on; port 0 takes any free port (see --port-file)")
    p.add_argument("--port-file", metavar="PATH", help="write the port it listens on to PATH, once it listens")
    p.add_argument("--shard", default="0/1", metavar="i/N", help="this shard's index and the shard count")
    p.add_argument("--shards", metavar="ADDR,...",
                   help="every shard's address, by index (needed when N > 1); HOST:@PATH stands for the port "
                        "that shard writes to its --port-file PATH (learners' joins wait until it is known)")
    p.add_argument("--out", metavar="DIR", help="where to journal events and save state (and the report on exit)")
    p.add_argument("--resume", action="store_true", help="continue from the state a previous process left in --out")
    p.add_argument("--operator-seeds", action="store_true",
                   help="only the run secret's holder may seed Θ (Init), not a learner's own credential")
    p.add_argument("--exit-when-finished", action="store_true",
                   help="exit once every learner has left and the last rounds are merged")
    p.add_argument("--region", metavar="NAME",
                   help="serve as this region's syncer (topology = \"regional\"): its learners sync here, and it "
                        "syncs with the global syncer at --upstream")
    p.add_argument("--upstream", metavar="HOST:PORT", help="any global syncer shard (with --region)")
    p.add_argument("--emulate-link", action="store_true",
                   help="with --region: shape the traffic to the global syncer as the region's WAN link in the config")
    add_http_arguments(p, default_host="--bind's host")
    p.add_argument("--status-port", type=port_number, metavar="PORT",
                   help="serve the HTML status page on PORT (0: any), on the --http-bind host")
    p.add_argument("--status-port-file", metavar="PATH", help="write the status page's port to PATH")


def add_http_arguments(p: argparse.ArgumentParser, default_host: str) -> None:
    """The Prometheus endpoint, and where (and for whom) this process's HTTP endpoints serve."""
    p.add_argument("--metrics-port", type=port_number, metavar="PORT",
                   help="serve Prometheus metrics on PORT (0: any; of a learner, its rank 0)")
    p.add_argument("--metrics-port-file", metavar="PATH", help="write the Prometheus metrics port to PATH")
    p.add_argument("--http-bind", metavar="HOST",
                   help=f"host the metrics (and status page) listen on (default: {default_host}); "
                        "0.0.0.0 for every interface")
    add_http_auth_argument(p)


def cmd_syncer(args: argparse.Namespace, console: Console) -> int:
    from diloco.client.builtin_loop import run_origin
    from diloco.launch.processes import die_with_parent
    from diloco.transport.run_settings import check_shards
    from diloco.shard.regional_shard import RegionTier
    from diloco.shard.ownership import global_shard_plan
    from diloco.shard.server import ShardPlan, SyncerShard, parse_shard

    die_with_parent()
    setup_logging(args.verbose)
    config = runtime_config(args)
    security = security_from_args(args, role="server")
    index, count = parse_shard(args.shard)
    check_shards(config, count)
    if bool(args.region) != bool(args.upstream):
        raise DilocoError("--region and --upstream go together: a region's syncer syncs with the global one")
    if args.region and (count != 1 or args.resume):
        raise DilocoError("a region's syncer is one shard and keeps no journal: drop --shard/--shards/--resume")
    addresses = tuple(a.strip() for a in args.shards.split(",")) if args.shards else (args.bind,)
    if len(addresses) != count:
        raise DilocoError(f"--shards lists {len(addresses)} address(es) but --shard says there are {count} shards")
    plan = ShardPlan(index, count, addresses) if args.region else global_shard_plan(config, index, count, addresses)
    http = http_exposure(args, _bind_host(args.bind), security)
    stop = stop_on_signals()
    out = output_folder(Path(args.out)) if args.out else None
    name = f"region-{args.region}" if args.region else f"syncer-{index}"
    metrics = open_metrics(out / "metrics" if out else None, name=name,
                           tensorboard=config.metrics.tensorboard, wandb=config.metrics.wandb,
                           prometheus_port=args.metrics_port, http=http, origin=run_origin())
    if args.metrics_port is not None:
        report_port(metrics.prometheus_port, f"shard {index}'s Prometheus metrics", args.metrics_port_file)
    tier = RegionTier(config, args.region, args.upstream, security_from_args(args, role="client"),
                      emulate_link=args.emulate_link, out=out) if args.region else None
    if args.operator_seeds and security.secret is None:
        raise DilocoError("--operator-seeds needs the run secret (--secret-file or DILOCO_SECRET): without it "
                          "no caller is known to be the operator")
    shard = SyncerShard(config, plan, metrics, state_dir=out / "syncer" if out and tier is None else None,
                        resume=args.resume, tier=tier, operator_seeds=args.operator_seeds,
                        state_key=file_key(security.secret))
    server, status = _serve_shard(shard, args, security, http)
    halted = None
    while not stop.wait(METRICS_EVERY_S):
        shard.record_metrics()
        if args.exit_when_finished and shard.finished:
            break
        if shard.store is not None and (halted := shard.store.halted) is not None:
            break  # its journal can take nothing more: stop, and resume from disk once it is fixed
    shard.stop()
    if tier is not None:
        tier.close()
    if halted is not None:
        server.stop(grace=2).wait()
        raise DilocoError(f"shard {index} stopped: {halted}; fix the disk, then restart it with --resume")
    if out:
        shard.save_state()
        with shard.lock:
            report = shard.report()
        write_output(out / "syncer" / f"{'region-' + args.region if args.region else f'shard-{index}'}.json",
                     json.dumps(report, indent=2) + "\n")
    server.stop(grace=2).wait()
    if status:
        status.close()
    metrics.close()
    return 0


def _bind_host(bind: str) -> str:
    """The host of --bind HOST:PORT, without the brackets of an IPv6 address."""
    return bind.rpartition(":")[0].strip("[]") or "0.0.0.0"


def _serve_shard(shard: SyncerShard, args: argparse.Namespace, security: TransportSecurity,
                 http: HttpExposure = LOOPBACK) -> tuple[grpc.Server, StatusServer | None]:
    """Serve the shard and its status page, report their ports, then complete the shard map learners
    get at Join: its own address, and the ports other shards report. Joins take the shard's lock, held
    until the map is complete, so no learner is ever given an address still unknown."""
    from diloco.shard.server import serve

    plan, host = shard.plan, args.bind.rsplit(":", 1)[0]
    with shard.lock:
        server, port = serve(shard, args.bind, security=security)
        status = None
        if args.status_port is not None:
            status = _serve_status(shard, http, args.status_port)
            print(f"status page: {status.url}", flush=True)
            write_port_file(args.status_port_file, status.port)
        write_port_file(args.port_file, port)
        shard.plan = dataclasses.replace(plan, addresses=tuple(
            f"{host}:{port}" if i == plan.index and args.bind.endswith(":0") else
            resolve_address(address, f"syncer shard {i}") for i, address in enumerate(plan.addresses)))
    print(f"diloco syncer shard {plan.index}/{plan.count} listening on {host}:{port} ({security.describe()})",
          flush=True)
    return server, status


def _serve_status(shard: SyncerShard, http: HttpExposure, port: int) -> StatusServer:
    from diloco.status.endpoint import join_bind
    from diloco.status.server import StatusServer

    bind = join_bind(http.host, port)
    try:
        return StatusServer(shard.snapshot, bind, credentials=http.credentials)
    except OSError as exc:
        raise DilocoError(f"cannot serve the status page on {bind}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------- diloco learner


def add_learner_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_security_arguments(p)
    p.add_argument("--syncer", metavar="HOST:PORT", help="any syncer shard of the run")
    p.add_argument("--no-sync", action="store_true",
                   help="train the same way without syncing (a baseline for what syncing costs); needs --id")
    p.add_argument("--id", type=int, metavar="N", help="this learner's id (default: the syncer picks)")
    p.add_argument("--out", metavar="DIR", help="where to write the report and checkpoint")
    p.add_argument("--emulate-link", action="store_true",
                   help="shape this learner's traffic to link.bandwidth_mbit and link.latency_ms")
    p.add_argument("--connect-timeout", type=float, default=60.0, metavar="S",
                   help="give up if no syncer answers within S seconds (default 60)")
    add_http_arguments(p, default_host="127.0.0.1")


def cmd_learner(args: argparse.Namespace, console: Console) -> int:
    from diloco.client.builtin_loop import finish_distributed, init_distributed, run_learner
    from diloco.launch.processes import die_with_parent

    die_with_parent()
    setup_logging(args.verbose)
    config = runtime_config(args)
    if args.id is not None and args.id < 0:
        raise DilocoError(f"--id must be zero or positive, got {args.id}")
    if bool(args.syncer) == args.no_sync:
        raise DilocoError("give --syncer HOST:PORT, or --no-sync to train without syncing")
    security = security_from_args(args, role="client")
    http = http_exposure(args, "127.0.0.1", security)
    out = output_folder(Path(args.out)) if args.out else None
    stop = stop_on_signals()
    init_distributed()
    report = run_learner(config, syncer=args.syncer, learner=args.id, out=out,
                         emulate_link=args.emulate_link, stop=stop, connect_timeout_s=args.connect_timeout,
                         metrics_port=args.metrics_port, metrics_port_file=args.metrics_port_file,
                         security=security, metrics_http=http)
    finish_distributed()
    if not args.quiet and report["rank"] == 0:
        print(json.dumps(report), flush=True)
    return 0
