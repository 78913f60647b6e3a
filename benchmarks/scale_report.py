"""scale.py's report: the runs, the shards and the targets as tables."""

from __future__ import annotations

from typing import Any


from scale_model import CPU_ROOFLINE_TARGET, GIB, JOIN_RATIO_TARGET, RSS_RATIO_TARGET, SCALING_TARGET, SOCKET_RATIO_TARGET



def gib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / GIB:.2f}"


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f}"


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "n/a" if x is None else format(x, spec)


def human(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size and n % (size // 1000 or 1) == 0:
            return f"{n / size:g}{unit}"
    return str(n)


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets, per group of runs that differ only in the learner count."""
    rows = []
    ok = [r for r in runs if r["status"] == "ok"]
    groups: dict[tuple, dict[int, dict]] = {}
    for r in ok:
        group = (r["params"], r["shards"], r["codec"], r["down_codec"], r["fragments"])
        groups.setdefault(group, {})[r["learners"]] = r
    for (params, shards, codec, down, fragments), by in sorted(groups.items()):
        where = f"{human(params)} params, {shards} shard(s), {codec}"
        one = by.get(1)
        if one is not None:
            bigger = [n for n in by if n > 1]
            if bigger:
                n = 16 if 16 in by else max(bigger)
                value = by[n]["rss_bytes"] / one["rss_bytes"]
                rows.append({"where": where, "measure": f"syncer RSS, {n} learners / 1 learner", "value": value,
                             "target": f"≤ {RSS_RATIO_TARGET}" + ("" if n == 16 else " (stated for 16)"),
                             "met": value <= RSS_RATIO_TARGET if n == 16 else None})
            if one.get("push_vs_socket") is not None:
                rows.append({"where": where, "measure": "push MB/s of one shard (1 learner) / plain socket",
                             "value": one["push_vs_socket"], "target": f"≥ {SOCKET_RATIO_TARGET}",
                             "met": one["push_vs_socket"] >= SOCKET_RATIO_TARGET})
            if 8 in by:
                for what in ("push", "pull"):
                    base = one[f"{what}_mb_s"]
                    value = by[8][f"{what}_mb_s"] / base if base else None
                    rows.append({"where": where, "measure": f"a shard's {what} MB/s, 8 learners / 1 learner",
                                 "value": value, "target": f"≥ {SCALING_TARGET}",
                                 "met": value is not None and value >= SCALING_TARGET})
        if 8 in by and by[8].get("cpu_vs_roofline") is not None:
            rows.append({"where": where + (", paced" if by[8]["paced"] else ", quorum 1"),
                         "measure": f"shard CPU ns per pushed parameter ({by[8]['cpu_ns_per_param']:.2f}), 8 learners "
                                    f"/ roofline ({by[8]['roofline_ns_per_param']:.3f})",
                         "value": by[8]["cpu_vs_roofline"], "target": f"≤ {CPU_ROOFLINE_TARGET}",
                         "met": by[8]["cpu_vs_roofline"] <= CPU_ROOFLINE_TARGET})
        sink = max(by.values(), key=lambda r: r["learners"])
        if sink.get("sink") and sink.get("push_vs_socket") is not None:
            for what in ("push", "pull"):
                rows.append({"where": where + ", sink", "measure": f"transport alone: {what} MB/s of one shard "
                                                                   f"({sink['learners']} learners) / plain socket",
                             "value": sink[f"{what}_vs_socket"], "target": f"≥ {SOCKET_RATIO_TARGET}",
                             "met": sink[f"{what}_vs_socket"] >= SOCKET_RATIO_TARGET})
        for r in sorted(by.values(), key=lambda r: r["learners"]):
            if r.get("join_vs_socket") is not None:
                rows.append({"where": where, "measure": f"join: Θ pulled ({r['join_bytes'] / 1e6:.0f} MB, "
                                                        f"{r['join_s']:.2f} s) / plain socket, same bytes",
                             "value": r["join_vs_socket"], "target": f"≤ {JOIN_RATIO_TARGET}",
                             "met": r["join_vs_socket"] <= JOIN_RATIO_TARGET})
                break
        # the best a shard did against the socket, at any learner count
        best = max(by.values(), key=lambda r: r.get("push_vs_socket") or 0)
        if best.get("push_vs_socket") is not None and (one is None or best is not one):
            rows.append({"where": where, "measure": f"push MB/s of one shard ({best['learners']} learners, the best) "
                                                    "/ plain socket", "value": best["push_vs_socket"],
                         "target": "", "met": None})
    return rows


def print_report(console, runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="runs (MB = 10^6 bytes of tensor payload; RSS of the largest shard, under load)")
    for col in ("params", "learners", "shards", "codec", "push MB/s", "pull MB/s", "socket MB/s", "push/socket",
                "CPU ns/param", "roofline ns/param",
                "RSS GiB", "HWM GiB", "Θ held GiB", "lat p50 ms", "lat p95 ms", "rounds/s", "status"):
        table.add_column(col, justify="right")
    for r in runs:
        status = r["status"] if r["status"] != "ok" else ("[yellow]problems[/]" if r.get("problems") else "ok")
        table.add_row(human(r["params"]), str(r["learners"]), str(r["shards"]),
                      r["codec"] + ("" if r["down_codec"] == r["codec"] else f"/{r['down_codec']}"),
                      fmt(r["push_mb_s"]), fmt(r["pull_mb_s"]), fmt(r["socket_mb_s"]), fmt(r["push_vs_socket"], ".3g"),
                      fmt(r.get("cpu_ns_per_param"), ".2f"), fmt(r.get("roofline_ns_per_param"), ".3f"),
                      gib(r["rss_bytes"]), gib(r.get("hwm_bytes")), gib(r.get("theta_bytes")),
                      ms(r.get("latency_median_s")), ms(r.get("latency_p95_s")), fmt(r.get("rounds_per_s"), ".1f"),
                      status)
    console.print(table)
    for r in runs:
        if r["status"] != "ok":
            console.print(f"[yellow]{human(r['params'])} params, {r['learners']} learners, {r['shards']} shard(s), "
                          f"{r['codec']}: {r['status']}: {r['reason']}[/]")
        for p in r.get("problems") or []:
            console.print(f"[yellow]{human(r['params'])} params, {r['learners']} learners: {p}[/]")

    shards = Table(title="per shard")
    for col in ("params", "learners", "shard", "fragments", "push MB/s", "pull MB/s", "RSS GiB", "HWM GiB",
                "Θ GiB", "optimizer GiB", "accumulating GiB", "downlink GiB", "total GiB", "lat p50 ms",
                "lat p95 ms", "rounds/s", "pushes/round", "pushes", "busy"):
        shards.add_column(col, justify="right")
    for r in runs:
        for s in r.get("per_shard") or []:
            mem = s["memory"] if isinstance(s["memory"], dict) else {}
            shards.add_row(human(r["params"]), str(r["learners"]), str(s["shard"]),
                           ",".join(map(str, s["fragments"] or [])), fmt(s["push_mb_s"]), fmt(s["pull_mb_s"]),
                           gib(s["rss_bytes"]), gib(s["hwm_bytes"]),
                           *(gib(mem.get(k)) for k in ("theta_bytes", "optimizer_bytes", "accumulating_bytes",
                                                       "downlink_bytes", "total_bytes")),
                           ms(s["latency_median_s"]), ms(s["latency_p95_s"]), fmt(s["rounds_per_s"], ".1f"),
                           fmt(s.get("pushes_per_round"), ".2f"), str(s["pushes"]), str(s["busy"]))
    console.print(shards)

    rows = targets(runs)
    table = Table(title="targets")
    for col in ("runs", "measure", "value", "target", ""):
        table.add_column(col, justify="right" if col in ("value", "target") else "left")
    for row in rows:
        met = "" if row["met"] is None else ("[green]met[/]" if row["met"] else "[red]not met[/]")
        table.add_row(row["where"], row["measure"], fmt(row["value"], ".3g"), row["target"], met)
    if not rows:
        table.add_row("", "(no targets: runs with 1 learner and with 8 or 16 are needed)", "", "", "")
    console.print(table)
