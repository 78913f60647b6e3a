"""What `diloco plan` prints: the deployment, then per learner, per link, per region, per shard, the run's
totals and what would make it fit. Bytes in decimal units (as links are rated), links in bits per
second, memory in GiB."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from diloco.plan.reports import Plan
from diloco.plan.search import Advice
from diloco.results import human_bytes

GIB = 2**30


def bits(bps: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def rate(bytes_per_s: float) -> str:
    return f"{human_bytes(bytes_per_s)}/s"


def seconds(s: float) -> str:
    if math.isinf(s):
        return "unbounded"
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 100:
        return f"{s:,.0f} s"
    return f"{s:.3g} s" if s >= 0.1 or s == 0 else f"{s * 1000:.3g} ms"


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def deployment_table(p: Plan) -> Table:
    d = p.deployment
    table = Table(title=f"diloco plan: {d.strategy}, {d.learners} learners")
    table.add_column("setting")
    table.add_column("value", justify="right")
    sizes = p.fragment_numels
    rows = [("parameters", f"{d.layout.parameters:,}"), ("layout", d.layout.source),
            ("fragments", f"{len(sizes)} ({min(sizes):,} to {max(sizes):,} parameters)")]
    if d.exchange == "outer":
        rows += [("H, τ", f"{d.H:,} steps, τ = {d.tau}"),
                 ("codec up / down", f"{d.codec_up} / {d.codec_down}" + (f" (block {d.block})" if d.block else "")),
                 ("sync period", f"{seconds(p.period_s)} (H × {seconds(d.grid_step_s)} per step)")]
    speeds = sorted(set(d.speeds))
    rows += [("step time", f"{seconds(d.step_time_s)} at speed 1"
              + (f"; speeds {', '.join(f'{v:g}' for v in speeds)}" if len(speeds) > 1 else "")),
             ("links", ", ".join(f"{r.name} {bits(r.bandwidth_bps)} {r.latency_s * 1e3:g} ms" for r in d.regions)
              if d.regions else f"{bits(d.bandwidth_bps)} per learner, {d.latency_s * 1e3:g} ms")]
    for name, value in rows:
        table.add_row(name, value)
    return table


def learners_table(p: Plan) -> Table:
    gradients = p.deployment.exchange == "gradients"
    per = "step" if gradients else "period"
    table = Table(title="per learner" + (" (ring all-reduce share per step)" if gradients else ""))
    for col in ("learner", "n", f"up / {per}", f"down / {per}", "up / s", "down / s", "peak up", "peak down"):
        table.add_column(col, justify="right")
    for s in p.sites:
        table.add_row(s.name or "each", str(s.learners), human_bytes(s.up_per_period), human_bytes(s.down_per_period),
                      rate(s.up_per_s), rate(s.down_per_s), human_bytes(s.peak_up), human_bytes(s.peak_down))
    return table


def links_table(p: Plan) -> Table:
    gradients = p.deployment.exchange == "gradients"
    table = Table(title="per link (one learner's, per direction)")
    for col in ("learner", "available", "needed up", "needed down", "all-reduce" if gradients else "round trip",
                "τ budget", "keeps up"):
        table.add_column(col, justify="right")
    for s in p.sites:
        verdict = "[green]yes[/]" if s.keeps_up else f"[red]no[/]: {s.why}"
        table.add_row(s.name or "each", bits(s.bandwidth_bps), bits(s.up_per_s * 8), bits(s.down_per_s * 8),
                      "unbounded" if math.isinf(s.round_trip_s) else seconds(s.round_trip_s), seconds(s.budget_s),
                      verdict)
    return table


def regions_table(p: Plan) -> Table:
    table = Table(title="per region (WAN link shared by its learners)")
    for col in ("region", "learners", "bandwidth", "needed up", "needed down", "keeps up"):
        table.add_column(col, justify="right")
    for r in p.regions:
        table.add_row(r.name, str(r.learners), bits(r.bandwidth_bps), bits(r.needed_up_bps), bits(r.needed_down_bps),
                      "[green]yes[/]" if r.keeps_up else "[red]no[/]")
    return table


def shards_table(p: Plan) -> Table:
    d = p.deployment
    held = f"Θ, {d.optimizer} state, {d.merge_rule} sums" + (", published copy" if d.codec_down != "fp32" else "")
    table = Table(title=f"per shard ({len(p.shards)}; fp32: {held})")
    for col in ("shard", "fragments", "parameters", "in / s", "out / s", "resident", "closing", "peak"):
        table.add_column(col, justify="right")
    for s in p.shards:
        m = s.memory
        table.add_row(str(m.index), _fragment_list(m.fragments), f"{m.parameters:,}", rate(s.in_per_s),
                      rate(s.out_per_s), gib(m.resident_bytes), gib(m.transient_bytes), gib(m.peak_bytes))
    return table


def _fragment_list(fragments: tuple[int, ...]) -> str:
    if len(fragments) <= 4:
        return ",".join(map(str, fragments))
    return f"{len(fragments)} ({fragments[0]},{fragments[1]},…)"


def totals_table(p: Plan) -> Table:
    t = p.totals
    table = Table(title="over the run" + (" (exact: replayed)" if t.exact else " (estimate)"))
    table.add_column("total")
    table.add_column("value", justify="right")
    for name, value in (("tokens", f"{p.deployment.tokens:,}"), ("steps per learner", f"{t.steps:,}"),
                        ("time", seconds(t.time_s)), ("wire bytes up", f"{human_bytes(t.bytes_up)} ({t.bytes_up:,})"),
                        ("wire bytes down", f"{human_bytes(t.bytes_down)} ({t.bytes_down:,})"), ("how", t.note)):
        table.add_row(name, value)
    return table


def print_plan(console: Console, p: Plan, advice: Advice, memory_limit: float | None) -> None:
    console.print(deployment_table(p))
    console.print(learners_table(p))
    console.print(links_table(p))
    if p.regions:
        console.print(regions_table(p))
    if p.shards:
        console.print(shards_table(p))
        if memory_limit is not None:
            needed = (f"{p.shards_needed} shard(s) of {gib(memory_limit)}" if p.shards_needed else
                      f"no shard count fits {gib(memory_limit)}: one fragment alone is bigger; use more fragments")
            console.print(f"shards needed: {needed}")
    if p.totals is not None:
        console.print(totals_table(p))
    verdict = "[green]keeps up[/]" if p.keeps_up else "[red]does not keep up[/]"
    console.print(f"verdict: {verdict}")
    for line in advice.lines:
        console.print(f"- {line}")
