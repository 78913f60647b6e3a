"""The real runtime's commands `diloco run`, `diloco chaos` and `diloco learner`, and the plumbing every command
of the runtime shares (config, logging, signals, HTTP endpoints); `diloco syncer` is in `syncer_cli.py`."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from diloco.config import Config, load_config
from diloco.config.learners_section import FRAMEWORKS
from diloco.console import learners_table, print_table, progress_bars, results_table, show_outputs
from diloco.errors import DilocoError, print_error
from diloco.outputs import output_folder, write_output
from diloco.launch.ignored_keys import warn_ignored
from diloco.status.endpoint import HttpExposure, credentials_for
from diloco.transport.security_settings import TransportSecurity, add_security_arguments, security_from_args, with_run_secret

if TYPE_CHECKING:  # it loads torch and gRPC: the commands import it when they run
    from diloco.launch.launcher import Launcher

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
    p.add_argument("--no-bulk-port", "--no-bulk-pulls", dest="bulk_port", action="store_false",
                   help="shards move Θ and pushes over gRPC only (by default also on a bulk port of their host: "
                        "`diloco syncer --bulk-port`)")
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
    if "jax" in config.learners.frameworks:
        from diloco.jax import require_jax

        require_jax()  # one line before any process starts, rather than a learner failing later
    configured = security_from_args(args, role="both")
    check_http_auth(args, configured)
    out = output_folder(Path(args.out) if args.out else
                        Path("runs") / f"run-{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}")
    security, secret_env = with_run_secret(configured)
    options = dict(shards=args.shards, verbose=args.verbose, security=security, env=secret_env,
                   http_auth=args.http_auth, bulk_port=args.bulk_port)
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
        print_table(console, table)
        print_table(console, learners_table(launcher.result))
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
    p.add_argument("--spares", type=int, default=10, metavar="N",
                   help="spare learners, one per planned learner kill up to N, imported before training starts: "
                        "a restarted learner is one of them, so its restart costs a join and a step, not a Python "
                        "start, and no spare's imports slow the others' training (past N, a restart's spare is "
                        "replaced 3 s later); with any, also a spare shard per planned shard kill (default 10, "
                        "about 0.3 GB of memory each; 0: fresh starts)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: runs/chaos-TIME)")
    add_http_auth_argument(p)


def cmd_chaos(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from diloco.launch.chaos import run_chaos
    from diloco.launch.outage_timeline import describe as describe_outage

    config = runtime_config(args)
    if min(args.kill_learners, args.kill_syncer, args.spares) < 0 or args.restart_after < 0:
        raise DilocoError("--kill-learners, --kill-syncer, --spares and --restart-after must be zero or positive")
    configured = security_from_args(args, role="both")
    check_http_auth(args, configured)
    out = output_folder(Path(args.out) if args.out else Path("runs") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    security, secret_env = with_run_secret(configured)
    console.print(f"fault-free run, then {args.kill_learners} learner and {args.kill_syncer} syncer kills "
                  f"(seed {args.seed}); about twice as long as `diloco run`")
    with sigterm_as_interrupt():  # as Ctrl-C: the launcher running stops its children in order
        result = run_chaos(config, config_args(args), out, kill_learners=args.kill_learners,
                           kill_syncer=args.kill_syncer, seed=args.seed, restart_after_s=args.restart_after,
                           shards=args.shards, spares=args.spares, security=security, env=secret_env,
                           http_auth=args.http_auth)
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
    table.add_row("tokens lost / trained", "", f"{faulty['tokens_lost_share']:.2%}", "≤ 3%")
    if faulty["restarts"]:
        table.add_row("learner restart, start to first step", "", f"median {faulty['restart_s_median']:.1f} s, "
                      f"max {faulty['restart_s_max']:.1f} s", "")
    table.add_row("tokens counted twice", "", f"{faulty['tokens_counted_twice']:,.0f}", "0")
    table.add_row("retried pushes recognised", "", str(faulty["retries_recognised"]), "")
    console.print(table)
    for outage in result["shard_outages"]:
        console.print(describe_outage(outage), highlight=False)
    console.print(f"details: {out / 'chaos.json'}")
    return 0 if faulty["tokens_counted_twice"] == 0 else 1


def add_http_arguments(p: argparse.ArgumentParser, default_host: str) -> None:
    """The Prometheus endpoint, and where (and for whom) this process's HTTP endpoints serve."""
    p.add_argument("--metrics-port", type=port_number, metavar="PORT",
                   help="serve Prometheus metrics on PORT (0: any; of a learner, its rank 0)")
    p.add_argument("--metrics-port-file", metavar="PATH", help="write the Prometheus metrics port to PATH")
    p.add_argument("--http-bind", metavar="HOST",
                   help=f"host the metrics (and status page) listen on (default: {default_host}); "
                        "0.0.0.0 for every interface")
    add_http_auth_argument(p)


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
    p.add_argument("--framework", choices=FRAMEWORKS,
                   help="train with torch or with JAX (the built-in GPT in Flax; needs diloco[jax]); default: "
                        "this learner's learners.frameworks entry, else torch")
    add_http_arguments(p, default_host="127.0.0.1")


def cmd_learner(args: argparse.Namespace, console: Console) -> int:
    from diloco.client.builtin_loop import dist_world, finish_distributed, init_distributed, run_learner
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
    framework = args.framework or (config.learners.framework_of(args.id) if args.id is not None else "torch")
    if framework == "jax":
        from diloco.jax import require_jax

        require_jax()
        from diloco.jax.jax_loop import run_jax_learner as run_learner
    else:
        init_distributed()
    try:
        report = run_learner(config, syncer=args.syncer, learner=args.id, out=out,
                             emulate_link=args.emulate_link, stop=stop, connect_timeout_s=args.connect_timeout,
                             metrics_port=args.metrics_port, metrics_port_file=args.metrics_port_file,
                             security=security, metrics_http=http)
    except DilocoError as exc:
        if dist_world() > 1:  # a rank may be gone mid-collective: the group cannot be torn down safely
            if args.verbose:
                traceback.print_exc()
            print_error(exc)  # gloo's threads can abort the teardown (SIGABRT instead of this line's exit 2)
            os._exit(2)
        finish_distributed(failed=True)
        raise
    except BaseException:
        finish_distributed(failed=True)
        raise
    finish_distributed()
    if not args.quiet and report["rank"] == 0:
        print(json.dumps(report), flush=True)
    return 0
