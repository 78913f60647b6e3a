"""Flat against regional, and fragments homed in one region against homes spread by the links: four regions,
with and without a regional outage.

    python benchmarks/topology.py [--config PATH] [--tokens N] [--seeds S] [--set key=value ...]
                                  [--json PATH] [--plot PATH] [--runtime [--skip-sim]]

The config (default examples/regions.toml): 4 regions × 2 learners, ap-south on half-speed chips, LAN
10 Gbit/s, WAN 1 Gbit/s with 30–80 ms, the global syncer in us-east. In the simulator, at equal token
budget (`--tokens`), for each seed (`--seeds S`: seeds 0 … S-1):

  flat                      every learner syncs with the global syncer, across the WAN outside us-east
  regional                  `topology = "regional"`: a syncer per region, one push per region per round
  regional, push_every 2    the same, pushing up after every second regional round of a fragment
  flat, placement links     flat, fragments' home shards spread over the regions (`placement = "links"`)
  regional, placement links regional, the global syncer's home shards spread likewise

each without an outage, then with one of `--outage-region` (default eu-west): its learners crash at
`--outage-at` × T for `--outage-length` × T (defaults 0.375 and 0.25: a quarter of the run, centred on
its middle), T being the virtual length of the flat run without outage of the same seed, so that every
setting sees the same outage.

Per run: final eval loss and its ratio to flat (same outage setting, same seed), WAN bytes and flat's
over this run's, LAN bytes, virtual time and its ratio to flat, tokens trained / merged / stale / lost,
the lost tokens of the outage region's learners and of the others, duplicates, each WAN link's bytes, and
for the outage runs the goodput of the other regions: their learners' busy fraction in the outage run
over the same learners' busy fraction in the same setting's run without outage (the mean of theirs over
the mean of theirs, and the lowest learner's own ratio), next to the absolute busy fractions; and the
busiest WAN direction's share of the run spent carrying bytes (the link that decides whether rounds keep
up: what `placement = "links"` lightens).

Targets (the issue): regional against flat at equal tokens: WAN bytes ≥ 2× fewer, final loss within 1%
(ratio ≤ 1.01), virtual time no worse (ratio ≤ 1); an outage costs only the outage region's unpushed
progress (no token lost elsewhere) and the others' goodput ≥ 0.97. Spread homes: the busiest WAN direction
lighter than with the same topology's homes in one region, loss within 1% of flat.

Prints the tables and writes JSON (default benchmarks/results/topology.json) and a plot (default
benchmarks/results/topology.png: WAN bytes, final loss and the others' goodput per setting). Each
simulation of the default budget takes about 40 s on a quiet 2-core machine (all six about 4 minutes;
several times that when the cores are shared); the figures are virtual time, so load on the machine does
not change them (two invocations gave bit-identical figures).

`--runtime` adds real runs at reduced size (`--runtime-tokens`, default 196608): `diloco run` of each
setting in `--runtime-settings` (default "flat;regional", semicolon-separated) on this machine, same fields from each run's
summary.json (time is measured there; they run without outage). Not run by default.
With `--skip-sim` only that pair runs, and only the `runtime` entry of an existing JSON is replaced.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from diloco.config import Config, Topology, load_config
from diloco.sim import simulate

from topology_report import (GOODPUT_TARGET, LOSS_TARGET, RUN_TIMEOUT_S, SETTINGS, SPREAD, TIME_TARGET,  # benchmarks/
                             WAN_TARGET, plot, print_tables, print_targets)


# ---------------------------------------------------------------- one run's figures


def row_of(name: str, outage: dict[str, Any] | None, seed: int, summary: dict[str, Any], config: Config,
           host_s: float) -> dict[str, Any]:
    """The fields the tables and the JSON keep, from a simulator's or a launcher's summary."""
    down = set(Topology(config).learners_of(outage["region"])) if outage else set()
    lost_region = sum(p["tokens_lost"] for p in summary["per_learner"] if p["learner"] in down)
    lost_others = sum(p["tokens_lost"] for p in summary["per_learner"] if p["learner"] not in down)
    return {
        "setting": name, "outage": outage, "seed": seed,
        "final_eval_loss": summary["final_eval_loss"],
        "learners_eval_loss_mean": summary.get("learners_eval_loss_mean"),
        "wan_bytes": summary["wan_bytes"], "lan_bytes": summary["lan_bytes"],
        "training_time_s": summary["training_time_s"], "clock": summary.get("clock", "virtual"),
        "tokens": summary["tokens"], "tokens_merged": summary["tokens_merged"],
        "tokens_stale": summary["tokens_stale"], "tokens_lost": summary["tokens_lost"],
        "tokens_lost_outage_region": lost_region, "tokens_lost_others": lost_others,
        "duplicates": summary.get("duplicates", 0), "rounds": summary["rounds"],
        "wan_busiest": max((u for link in summary["links"] if link["kind"] == "wan"
                            for u in (link["utilisation_up"], link["utilisation_down"]) if u is not None),
                           default=None),
        "wan_links": {link["name"]: {"bytes_up": link["bytes_up"], "bytes_down": link["bytes_down"],
                                     "bytes": link["bytes_up"] + link["bytes_down"]}
                      for link in summary["links"] if link["kind"] == "wan"},
        "per_learner": [{"learner": p["learner"], "region": Topology(config).region_of(p["learner"]),
                         "busy_fraction": p["busy_fraction"], "tokens": p["tokens"],
                         "tokens_lost": p["tokens_lost"], "crashes": p.get("crashes", 0),
                         "down_s": p.get("down_s", 0.0)} for p in summary["per_learner"]],
        "host_seconds": host_s,
    }


def simulated(config_path: str, name: str, overrides: list[str], outage: dict[str, Any] | None, seed: int,
              console: Console) -> dict[str, Any]:
    if outage:
        overrides = [*overrides, f'failures.outages=[{{region = "{outage["region"]}", at_s = {outage["at_s"]!r}, '
                                 f'duration_s = {outage["duration_s"]!r}}}]']
    config = load_config(config_path, [*overrides, f"seed={seed}"])
    started = time.perf_counter()
    summary = simulate(config).summary()
    row = row_of(name, outage, seed, summary, config, time.perf_counter() - started)
    row["overrides"] = overrides
    console.print(f"seed {seed} {name}{' + outage' if outage else ''}: loss {row['final_eval_loss']:.4f}, "
                  f"WAN {row['wan_bytes'] / 1e6:.2f} MB, virtual {row['training_time_s']:.3f} s "
                  f"({row['host_seconds']:.0f} s on this host)")
    return row


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Each run against flat of the same seed and outage setting; each outage run's other regions against
    the same setting's run without outage."""
    def find(setting: str, seed: int, outage: bool) -> dict[str, Any] | None:
        return next((r for r in rows if r["setting"] == setting and r["seed"] == seed
                     and bool(r["outage"]) == outage), None)

    for r in rows:
        flat = find("flat", r["seed"], bool(r["outage"]))
        r["loss_vs_flat"] = r["final_eval_loss"] / flat["final_eval_loss"] if flat else None
        r["wan_flat_over_this"] = flat["wan_bytes"] / r["wan_bytes"] if flat and r["wan_bytes"] else None
        r["time_vs_flat"] = r["training_time_s"] / flat["training_time_s"] if flat else None
        together = find(r["setting"].split(",")[0], r["seed"], bool(r["outage"])) if SPREAD in r["setting"] else None
        r["busiest_vs_together"] = (r["wan_busiest"] / together["wan_busiest"] if together and r["wan_busiest"]
                                    and together["wan_busiest"] else None)
        r["others_busy_fraction"] = r["others_busy_fraction_no_outage"] = None
        r["outage_region_busy_fraction"] = None
        r["goodput_others"] = r["goodput_others_min"] = None
        if not r["outage"]:
            continue
        base = find(r["setting"], r["seed"], False)
        down = r["outage"]["region"]
        mine = {p["learner"]: p["busy_fraction"] for p in r["per_learner"] if p["region"] != down}
        theirs = {p["learner"]: p["busy_fraction"] for p in base["per_learner"] if p["region"] != down} if base else {}
        hit = [p["busy_fraction"] for p in r["per_learner"] if p["region"] == down]
        r["outage_region_busy_fraction"] = sum(hit) / len(hit) if hit else None
        r["others_busy_fraction"] = sum(mine.values()) / len(mine)
        if theirs:
            r["others_busy_fraction_no_outage"] = sum(theirs.values()) / len(theirs)
            r["goodput_others"] = r["others_busy_fraction"] / r["others_busy_fraction_no_outage"]
            r["goodput_others_min"] = min(mine[m] / theirs[m] for m in mine)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run but flat against the issue's targets (spread homes: also against the same topology's run)."""
    out = []
    for r in rows:
        if r["setting"] == "flat":
            continue
        checks = {} if r["setting"] == f"flat, {SPREAD}" else {
            f"WAN bytes flat/this ≥ {WAN_TARGET:g}": (r["wan_flat_over_this"], r["wan_flat_over_this"] is not None
                                                      and r["wan_flat_over_this"] >= WAN_TARGET),
            f"loss / flat ≤ {LOSS_TARGET:g}": (r["loss_vs_flat"], r["loss_vs_flat"] is not None
                                               and r["loss_vs_flat"] <= LOSS_TARGET),
            f"virtual time / flat ≤ {TIME_TARGET:g}": (r["time_vs_flat"], r["time_vs_flat"] is not None
                                                       and r["time_vs_flat"] <= TIME_TARGET),
        }
        if r["setting"] == f"flat, {SPREAD}":
            checks[f"loss / flat ≤ {LOSS_TARGET:g}"] = (r["loss_vs_flat"], r["loss_vs_flat"] is not None
                                                        and r["loss_vs_flat"] <= LOSS_TARGET)
        if SPREAD in r["setting"]:
            checks["busiest WAN direction / homes together < 1"] = (
                r["busiest_vs_together"], r["busiest_vs_together"] is not None and r["busiest_vs_together"] < 1)
        if r["outage"]:
            checks["tokens lost outside the outage region = 0"] = (r["tokens_lost_others"],
                                                                   r["tokens_lost_others"] == 0)
            checks[f"others' goodput ≥ {GOODPUT_TARGET:g}"] = (r["goodput_others"], r["goodput_others"] is not None
                                                              and r["goodput_others"] >= GOODPUT_TARGET)
        out.append({"setting": r["setting"], "outage": bool(r["outage"]), "seed": r["seed"],
                    "checks": {k: {"value": v, "met": met} for k, (v, met) in checks.items()}})
    return out


# ---------------------------------------------------------------- the real runtime (not run by default)


def runtime_pair(config_path: str, tokens: int, extra: list[str], work: Path, console: Console,
                 names: list[str]) -> list[dict]:
    """The settings `names` with `diloco run` on this machine, at reduced size; the same fields from each
    run's summary.json. Raises SystemExit with the run's last output when a run fails."""
    sys.path.insert(0, str(Path(__file__).parent))
    from children import Processes, diloco, tail  # benchmarks/children.py

    rows = []
    processes = Processes()
    try:
        for name, overrides in [(n, o) for n, o in SETTINGS if n in names]:
            out = work / f"run-{name.replace(', ', '-').replace(' ', '-')}"
            sets = [*overrides, f"train.tokens={tokens}", *extra]
            argv = diloco("run", config_path, "--out", str(out), *[x for s in sets for x in ("--set", s)])
            log = out.with_suffix(".log")
            console.print(f"runtime {name}: {' '.join(argv[1:])} (log {log})")
            started = time.perf_counter()
            proc = processes.start(argv, log)
            try:
                code = proc.wait(timeout=RUN_TIMEOUT_S)
            except Exception:
                processes.stop([proc])
                raise SystemExit(f"runtime {name}: `diloco run` still running after {RUN_TIMEOUT_S:g} s; "
                                 f"{log} ends:\n{tail(log)}") from None
            summary_path = out / "summary.json"
            if code != 0 or not summary_path.exists():
                raise SystemExit(f"runtime {name}: `{' '.join(argv)}` failed (exit code {code}"
                                 f"{'' if summary_path.exists() else ', no summary.json'}). {log} ends:\n"
                                 f"{tail(log, 25)}")
            summary = json.loads(summary_path.read_text())
            config = load_config(config_path, sets)
            row = row_of(name, None, config.seed, summary, config, time.perf_counter() - started)
            row["overrides"] = sets
            row["out"] = str(out)
            rows.append(row)
            console.print(f"runtime {name}: loss {row['final_eval_loss']:.4f}, WAN {row['wan_bytes'] / 1e6:.2f} MB, "
                          f"training {row['training_time_s']:.1f} s ({row['host_seconds']:.0f} s in all)")
    finally:
        processes.stop_all()
    add_comparisons(rows)
    flat, regional = rows[0], next((r for r in rows if r["setting"] == "regional"), None)
    if flat["setting"] == "flat" and regional and regional["wan_bytes"] >= 0.9 * flat["wan_bytes"]:
        console.print(f"[bold red]warning[/]: the regional run's WAN bytes ({regional['wan_bytes']:,}) are not "
                      f"below the flat run's ({flat['wan_bytes']:,}): did `diloco run` build the regional tier, "
                      f"or run flat?")
    return rows


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/regions.toml", help="TOML config with [[regions]]")
    parser.add_argument("--tokens", type=int, default=983_040, help="token budget of every simulated run")
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds (0 … S-1)")
    parser.add_argument("--outage-region", default="eu-west")
    parser.add_argument("--outage-at", type=float, default=0.375,
                        help="the outage's start, as a share of the flat run's virtual time")
    parser.add_argument("--outage-length", type=float, default=0.25,
                        help="the outage's duration, as a share of the flat run's virtual time")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for all runs")
    parser.add_argument("--json", default="benchmarks/results/topology.json", help="JSON file to write")
    parser.add_argument("--plot", default="benchmarks/results/topology.png", help="PNG file to write")
    parser.add_argument("--runtime", action="store_true",
                        help="also one real-runtime pair (flat, regional) with `diloco run` at reduced size")
    parser.add_argument("--runtime-tokens", type=int, default=196_608, help="token budget of the real runs")
    parser.add_argument("--runtime-settings", default="flat;regional",
                        help=f"semicolon-separated settings for the real runs, of: {'; '.join(n for n, _ in SETTINGS)}")
    parser.add_argument("--skip-sim", action="store_true", help="with --runtime: only the real-runtime pair")
    parser.add_argument("--keep", metavar="DIR", help="keep the real runs' folders under DIR")
    args = parser.parse_args()
    if args.skip_sim and not args.runtime:
        parser.error("--skip-sim needs --runtime")
    runtime_settings = [n.strip() for n in args.runtime_settings.split(";") if n.strip()]
    unknown = [n for n in runtime_settings if n not in dict(SETTINGS)]
    if unknown or not runtime_settings:
        parser.error(f"--runtime-settings: unknown {unknown}; known: {'; '.join(n for n, _ in SETTINGS)}")

    console = Console(width=max(Console().width, 150))
    json_path, plot_path = Path(args.json), Path(args.plot)
    result: dict[str, Any] = json.loads(json_path.read_text()) if args.skip_sim and json_path.exists() else {}

    if not args.skip_sim:
        load_config(args.config, args.set)  # a bad config or override fails before the first run
        common = [f"train.tokens={args.tokens}", *args.set]
        rows: list[dict[str, Any]] = []
        for seed in range(args.seeds):
            healthy = [simulated(args.config, name, [*common, *o], None, seed, console) for name, o in SETTINGS]
            flat_time = healthy[0]["training_time_s"]
            outage = {"region": args.outage_region, "at_s": round(args.outage_at * flat_time, 4),
                      "duration_s": round(args.outage_length * flat_time, 4)}
            console.print(f"seed {seed}: outage of {outage['region']} at {outage['at_s']:.3f} s for "
                          f"{outage['duration_s']:.3f} s (virtual; the flat run lasted {flat_time:.3f} s)")
            rows += healthy
            rows += [simulated(args.config, name, [*common, *o], outage, seed, console) for name, o in SETTINGS]
        add_comparisons(rows)
        checks = targets(rows)
        title = (f"{args.config}, {args.tokens:,} tokens, simulator (virtual time), outage: "
                 f"{args.outage_region} for {args.outage_length:.0%} of the run from {args.outage_at:.1%}")
        print_tables(rows, title, console, args.seeds > 1)
        print_targets(checks, console, args.seeds > 1)
        result = {"config": args.config, "tokens": args.tokens, "seeds": args.seeds, "overrides": common,
                  "outage": {"region": args.outage_region, "at_share": args.outage_at,
                             "length_share": args.outage_length},
                  "targets": {"wan_flat_over_regional": WAN_TARGET, "loss_ratio_max": LOSS_TARGET,
                              "time_ratio_max": TIME_TARGET, "goodput_others_min": GOODPUT_TARGET},
                  "runs": rows, "checks": checks, "runtime": None}
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, plot_path, title)
        console.print(f"plot: {plot_path}")

    if args.runtime:
        work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="diloco-topology-"))
        work.mkdir(parents=True, exist_ok=True)
        pair = runtime_pair(args.config, args.runtime_tokens, args.set, work.resolve(), console, runtime_settings)
        print_tables(pair, f"the real runtime, `diloco run` on this machine, {args.runtime_tokens:,} tokens "
                           f"(measured time)", console, False)
        result["runtime"] = {"tokens": args.runtime_tokens, "runs": pair}

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"JSON: {json_path}")


if __name__ == "__main__":
    main()
