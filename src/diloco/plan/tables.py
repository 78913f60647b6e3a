"""What `diloco plan` prints: the deployment, then per learner, per link, per region, per shard, the run's
totals and what would make it fit. Bytes in decimal units (as links are rated), links in bits per
second, memory in GiB."""

from __future__ import annotations

import math
from collections import Counter

from rich.console import Console
from rich.table import Table

from diloco.plan.reports import Plan
from diloco.plan.search import Advice
from diloco.plan.syncer_cost import (SHARD_BULK_PULL_BYTES_PER_S, SHARD_CPU_NS_PER_PARAM, SHARD_PULL_BYTES_PER_S,
                                     SHARD_SERIAL_SHARE)
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
              + (f"; speeds {', '.join(f'{v:g}' for v in speeds)}" if len(speeds) > 1 else "")
              + (f" ({d.step_time_source})" if d.step_time_source else "")),
             ("links", _links_setting(p))]
    if p.homes:
        homed = Counter(p.homes)
        rows.append((f"placement: {d.network.placement}", ", ".join(f"{name} {n}" for name, n in homed.items())
                     + " fragment(s) homed"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _links_setting(p: Plan) -> str:
    d = p.deployment
    if d.network is not None:
        regions = d.network.regions
        return (f"{len(regions)} regions ({', '.join(f'{r.name} {len(r.speeds)}' for r in regions)} learners), "
                f"topology {d.network.topology}: see per link")
    if d.regions:
        return ", ".join(f"{r.name} {bits(r.bandwidth_bps)} {r.latency_s * 1e3:g} ms" for r in d.regions)
    return f"{bits(d.bandwidth_bps)} per learner, {d.latency_s * 1e3:g} ms"


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


def network_table(p: Plan) -> Table:
    """The config's regions: every link with everything that crosses it, each way (`up`: the way its name
    points), against the τ budget of the sender it is tightest for. Why a link falls short is printed
    under the table (`link_problems`), to keep the table narrow."""
    table = Table(title="per link, all traffic sharing it (up: the way the name points)")
    for col in ("link", "bandwidth", "up", "down", "use", "round trip", "τ budget", "keeps up"):
        table.add_column(col, justify="right")
    for lk in p.links:
        same = lk.bandwidth_up_bps == lk.bandwidth_down_bps
        table.add_row(lk.name, bits(lk.bandwidth_up_bps) if same else
                      f"{bits(lk.bandwidth_up_bps)} / {bits(lk.bandwidth_down_bps)}",
                      bits(lk.up_per_s * 8), bits(lk.down_per_s * 8),
                      f"{max(lk.up_utilisation, lk.down_utilisation):.1%}", seconds(lk.round_trip_s),
                      seconds(lk.budget_s), "[green]yes[/]" if lk.keeps_up else "[red]no[/]")
    return table


def link_problems(p: Plan) -> list[str]:
    """Why each link that falls short does, and the routes that miss τ though each of their links alone
    keeps up (their latencies add up)."""
    return ([f"[red]{lk.name}[/] does not keep up: {lk.why}" for lk in p.links if not lk.keeps_up]
            + [f"[red]route too slow[/]: {route}" for route in p.slow_routes])


def link_totals_table(p: Plan) -> Table:
    exact = all(lk.exact for lk in p.links)
    table = Table(title="per link over the run" + (" (exact: replayed)" if exact else " (estimate: steady state)"))
    for col in ("link", "bytes up", "bytes down"):
        table.add_column(col, justify="right")
    for lk in p.links:
        table.add_row(lk.name, f"{human_bytes(lk.bytes_up)} ({lk.bytes_up:,})",
                      f"{human_bytes(lk.bytes_down)} ({lk.bytes_down:,})")
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
    for col in ("shard", "fragments", "parameters", "in / s", "out / s", "cores", "resident", "closing", "pushes",
                "peak"):
        table.add_column(col, justify="right")
    for s in p.shards:
        m = s.memory
        table.add_row(str(m.index), _fragment_list(m.fragments), f"{m.parameters:,}", rate(s.in_per_s),
                      rate(s.out_per_s), f"{s.cores:.3g}", gib(m.resident_bytes), gib(m.transient_bytes),
                      gib(m.receiving_bytes), gib(m.peak_bytes))
    return table


def syncer_lines(p: Plan) -> list[str]:
    """The syncer's CPU and a join, from the measured constants (`syncer_cost.py`)."""
    cores = [s.cores for s in p.shards]
    lines = [f"syncer CPU: {sum(cores):.3g} cores in all, {max(cores):.3g} on the busiest shard "
             f"({SHARD_CPU_NS_PER_PARAM:g} ns per pushed parameter, measured)"]
    busiest = max(cores, default=0.0)
    if busiest > 1:
        threads = p.shard_threads
        most = f"{SHARD_SERIAL_SHARE:.0%} of its merging stays on one thread: a shard gets through at most " \
               f"{1 / SHARD_SERIAL_SHARE:.3g} cores' worth"
        lines.append(f"start each shard with `diloco syncer --threads {threads}` ({most})" if threads else
                     f"no thread count is enough for the busiest shard ({most}): use more shards (--shards, "
                     "--shard-cores)")
    limit = p.deployment.shard_cores
    of = f" of {limit:g} cores" if limit is not None else ""
    if p.shards_for_cores:
        lines.append(f"shards needed for the CPU: {p.shards_for_cores}{of}")
    elif p.shards and not p.homes:
        lines.append(f"shards needed for the CPU: no shard{of} is enough: one fragment alone needs more; use more "
                     "fragments or a larger H")
    if p.join_s is not None:
        theta = 4 * p.deployment.layout.parameters
        lines.append(f"a join: {human_bytes(theta)} of fp32 Θ from {len(p.shards)} shard(s) at once, "
                     f"{seconds(p.join_s)} (each shard serving {rate(SHARD_BULK_PULL_BYTES_PER_S)} over its bulk "
                     f"port, measured, and all of it over the slowest learner's link; over gRPC a shard "
                     f"serves {rate(SHARD_PULL_BYTES_PER_S)})")
    return lines


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
    if p.links:  # a learner's own link is then its route: the links it crosses, shared
        console.print(network_table(p))
        for line in link_problems(p):
            console.print(line)
    else:
        console.print(links_table(p))
    if p.regions:
        console.print(regions_table(p))
    if p.shards:
        console.print(shards_table(p))
        if memory_limit is not None:
            needed = (f"{p.shards_needed} shard(s) of {gib(memory_limit)}" if p.shards_needed else
                      f"no shard count fits {gib(memory_limit)}: one fragment alone is bigger; use more fragments")
            console.print(f"shards needed: {needed}")
        for line in syncer_lines(p):
            console.print(line)
    if p.totals is not None:
        console.print(totals_table(p))
        if p.links:
            console.print(link_totals_table(p))
    verdict = "[green]keeps up[/]" if p.keeps_up else "[red]does not keep up[/]"
    console.print(f"verdict: {verdict}")
    for line in advice.lines:
        console.print(f"- {line}")
