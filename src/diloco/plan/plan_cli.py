"""`diloco plan`: argparse wiring (the lead's cli.py calls `add_arguments` and `run`).

The deployment comes from the same config file and `--set` overrides as `diloco sim`, with flags for the
keys a plan usually changes (each maps onto its config key, so the config's rules check it); `--params`
skips building the model and assumes a layout instead.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from diloco.errors import DilocoError
from diloco.plan import units

if TYPE_CHECKING:
    from diloco.plan.reports import Plan
    from diloco.plan.search import Combination

DIRECT_FLAGS = (
    ("--strategy", "NAME", "ddp, diloco, streaming, async, async-dn or decoupled (config: strategy)"),
    ("--params", "N", "parameter count, e.g. 12B: plan without building the model (assumes a layout)"),
    ("--learners", "N", "N equal learners (config: learners.count)"),
    ("--fragments", "P", "fragments (config: outer.fragments)"),
    ("--H", "STEPS", "inner steps between syncs of a fragment (config: outer.H)"),
    ("--tau", "STEPS", "overlap τ in inner steps (config: outer.tau)"),
    ("--step-time", "TIME", "one inner step, e.g. 1.5s or 800ms (config: learners.step_time_s; with --params "
                            "default: 6 × params × step tokens ÷ --learner-flops)"),
    ("--step-tokens", "N", "tokens per inner step per learner (default: batch × seq_len; with --params 524288)"),
    ("--learner-flops", "FLOPS", "one learner's effective FLOP/s, e.g. 25P, for a --params plan's step time "
                                 "(default: 64 H100s at 40%%, 25.3P)"),
    ("--tokens", "N", "the run's token budget, e.g. 1T, for totals (config: train.tokens)"),
    ("--codec", "NAME", "uplink codec: fp32, bf16, int8, int4, fp4 (config: codec.up)"),
    ("--down-codec", "NAME", "downlink codec (config: codec.down)"),
    ("--bandwidth", "RATE", "each learner's link per direction, e.g. 5Gbit or 2.5 (Gbit/s)"),
    ("--latency", "TIME", "one-way latency, e.g. 40ms or 40 (ms)"),
    ("--regions", "NAME=RATE[@TIME],...", "regions and their WAN links, e.g. us=2,eu=5@80ms; learners are "
                                           "spread over them in turn and share their region's link"),
    ("--shards", "N", "syncer shards to show (default: as many as --shard-memory needs, else 1)"),
    ("--shard-memory", "SIZE", "memory of one shard, e.g. 64GiB: how many shards the fragments need"),
    ("--shard-cores", "N", "CPU cores of one shard's merging: how many shards it needs (a shard merges on one "
                           "core unless started with `diloco syncer --threads N`)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML config, as for `diloco sim`; the built-in default when omitted")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    for flag, metavar, help_text in DIRECT_FLAGS:
        parser.add_argument(flag, metavar=metavar, help=help_text, dest=flag.lstrip("-").replace("-", "_"))
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    """Build the deployment, plan it, print it (unless --quiet), write --json; DilocoError for bad input."""
    from diloco.config import load_config
    from diloco.outputs import write_output
    from diloco.plan.build import build_deployment, replayed_run
    from diloco.plan.plan_model import plan
    from diloco.plan.search import advise
    from diloco.plan.tables import print_plan

    check_json_path(args.json)
    config = load_config(args.config, [*(args.set or []), *config_overrides(args)])
    deployment = build_deployment(config, args)
    result = plan(deployment, replayed_run(config, deployment, args))
    advice = advise(deployment)
    proposal = proposed_command(args, advice.combination, plan_of(result, advice.combination))
    if not args.quiet:
        print_plan(Console(), result, advice, deployment.shard_memory_bytes)
        if proposal:
            Console().print(f"- try: {proposal}", soft_wrap=True, highlight=False)
    if args.json:
        data = {**result.to_dict(), "advice": {**asdict(advice), "lines": list(advice.lines), "command": proposal}}
        write_output(Path(args.json), json.dumps(_finite(data), indent=2) + "\n")
        if args.quiet:
            print(args.json)
    return 0


def plan_of(result: Plan, combo: Combination | None) -> Plan | None:
    """The plan with the proposed combination's knobs (None without one)."""
    from diloco.plan.plan_model import plan

    if combo is None:
        return None
    d = result.deployment
    return plan(replace(d, H=combo.H, codec_up=combo.codec, codec_down=combo.codec,
                        layout=d.layout.with_fragments(combo.fragments)))


def proposed_command(args: argparse.Namespace, combo: Combination | None, combo_plan: Plan | None) -> str:
    """The command line that plans the combination: the user's own, its H, fragments and codecs replaced
    (and its shard count, where memory or cores call for more than one)."""
    if combo is None or combo_plan is None:
        return ""
    words = ["diloco", "plan", *([args.config] if args.config else [])]
    for item in args.set or []:
        words += ["--set", item]
    changed = {"--H": str(combo.H), "--fragments": str(combo.fragments), "--codec": combo.codec,
               "--down-codec": combo.codec}
    if len(combo_plan.shards) > 1:
        changed["--shards"] = str(len(combo_plan.shards))
    for flag, _, _ in DIRECT_FLAGS:
        value = changed.pop(flag, getattr(args, flag.lstrip("-").replace("-", "_")))
        if value is not None:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def _finite(value: object) -> object:
    """JSON has no infinity: an unbounded wait or round trip is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The direct flags as `--set` overrides, each value checked first in the flag's own terms."""
    out: list[str] = []
    if args.strategy is not None:
        out.append(f"strategy={json.dumps(args.strategy)}")
    if args.learners is not None:
        out += [f"learners.count={units.integer('--learners', args.learners)}", "learners.speeds=[]"]
    for flag, key, minimum in (("fragments", "outer.fragments", 1), ("H", "outer.H", 1), ("tau", "outer.tau", 0)):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{key}={units.integer('--' + flag, value, minimum)}")
    if args.step_time is not None:
        out.append(f"learners.step_time_s={units.seconds('--step-time', args.step_time)!r}")
    from diloco.plan.build import derived_step

    derived = derived_step(args)
    if derived is not None:
        out.append(f"learners.step_time_s={derived[0]!r}")
    if args.tokens is not None:
        out.append(f"train.tokens={units.count('--tokens', args.tokens)}")
    for flag, key in (("codec", "codec.up"), ("down_codec", "codec.down")):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{key}={json.dumps(value)}")
    if args.bandwidth is not None:
        out.append(f"link.bandwidth_mbit={units.bandwidth_bps('--bandwidth', args.bandwidth) / 1e6!r}")
    if args.latency is not None:
        out.append(f"link.latency_ms={units.seconds('--latency', args.latency, 'ms', allow_zero=True) * 1e3!r}")
    return out


def check_json_path(path: str | None) -> None:
    if path is not None and Path(path).is_dir():
        raise DilocoError(f"--json {path} is a folder, not a file")
