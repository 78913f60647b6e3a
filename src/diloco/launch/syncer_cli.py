"""`diloco syncer`: serve one syncer shard (CPU only), its status page and its metrics, until stopped."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from diloco.errors import DilocoError
from diloco.launch.runtime_cli import (add_config_arguments, add_http_arguments, http_exposure, port_number,
                                       runtime_config, setup_logging, stop_on_signals)
from diloco.metrics import open_metrics
from diloco.outputs import output_folder, write_output
from diloco.status.endpoint import LOOPBACK, HttpExposure
from diloco.state_files import file_key
from diloco.transport.ports import report_port, resolve_address, write_port_file
from diloco.transport.security_settings import TransportSecurity, add_security_arguments, security_from_args

if TYPE_CHECKING:  # these load torch and gRPC: the command imports them when it runs
    import grpc

    from diloco.shard.server import SyncerShard
    from diloco.status.status_server import StatusServer

METRICS_EVERY_S = 2.0
"""How often a syncer shard records its own metrics."""
MAX_THREADS = 1024


def thread_count(text: str) -> int:
    """argparse type of --threads: 1..MAX_THREADS."""
    try:
        threads = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a thread count (1..{MAX_THREADS})") from None
    if not 1 <= threads <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{threads} is not a thread count (1..{MAX_THREADS})")
    return threads


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
    p.add_argument("--bulk-port", "--bulk-pulls", dest="bulk_port", action="store_true",
                   help="also listen on a bulk port of --bind's host (any free one): learners pull Θ and send "
                        "their pushes' data there over plain TCP (TLS with --tls-cert), several times faster than "
                        "over gRPC, with a one-use ticket their authenticated Pull or Push hands out; open it in "
                        "firewalls as the gRPC port (--bulk-pulls: the same, its earlier name)")
    p.add_argument("--threads", type=thread_count, default=1, metavar="N",
                   help="threads for the merge arithmetic (default 1): a round's compiled loops run in pieces on "
                        "N threads at once (torch keeps one; without numba its ops take the N); the values do not "
                        "depend on N. More shorten a round where cores and memory bandwidth are idle; "
                        "benchmarks/merge_threads.py says whether they pay on a host (docs/runtime.md)")
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


def cmd_syncer(args: argparse.Namespace, console: Console) -> int:
    from diloco.process_times import run_origin
    from diloco.launch.processes import die_with_parent
    from diloco.transport.run_settings import check_shards
    from diloco.shard.regional_shard import RegionTier
    from diloco.shard.ownership import global_shard_plan
    from diloco.shard.server import ShardPlan, SyncerShard, parse_shard
    from diloco.shard.serving import huge_pages_for_tensors, merge_threads

    from diloco.cpu_profile import start_from_env

    start_from_env()  # benchmarks/scale.py --profile: where this shard's CPU goes, by Python frame
    huge_pages_for_tensors()  # before a resumed state is loaded: torch reads it at its first large tensor
    merge_threads(args.threads)
    die_with_parent()
    setup_logging(args.verbose)
    from diloco.codecs import compiled

    logging.getLogger("diloco.syncer").debug("codecs: %s", compiled.describe())  # start's output stays one line
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
    metrics.record("serving", shard=index, resumed=shard.core is not None and args.resume)  # a shard kill's timeline
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
        server, port = serve(shard, args.bind, security=security, bulk_port=args.bulk_port)
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
    from diloco.status.status_server import StatusServer

    bind = join_bind(http.host, port)
    try:
        return StatusServer(shard.snapshot, bind, credentials=http.credentials)
    except OSError as exc:
        raise DilocoError(f"cannot serve the status page on {bind}: {exc.strerror or exc}") from None
