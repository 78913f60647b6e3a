"""The table `benchmarks/sharded.py` prints from its results."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def show(results: dict[str, Any]) -> None:
    table = Table(title="sharded learners")
    for column in ("measure", "value", "target"):
        table.add_column(column)
    for key, row in results.get("memory_speed", {}).items():
        mib = 2 ** 20
        table.add_row(f"{key} params / fragments", f"{row['parameters'] / 1e6:.1f}M / {row['fragments']}", "≥20M / ≥8")
        table.add_row(f"{key} staging peak / largest fragment", f"{row['staging_over_fragment']:.2f}", "≤ 1.5")
        for phase, held in row.get("gathered_peak_rank0_bytes", {}).items():
            table.add_row(f"{key} rank 0 gathered at once, {phase} / largest fragment",
                          f"{held / row['largest_fragment_bytes']:.2f}", "≤ 1")
        table.add_row(f"{key} RSS growth / largest fragment", f"{row['rss_growth_over_fragment']:.2f}", "")
        table.add_row(f"{key} peak RSS per rank (MiB)", f"{row['peak_rss_max_bytes'] / mib:.0f}", "falls with W")
        if "peak_rss_rank0_bytes" in row:
            table.add_row(f"{key} peak RSS rank 0 / other ranks (MiB)", f"{row['peak_rss_rank0_bytes'] / mib:.0f} / "
                          f"{row['peak_rss_other_ranks_bytes'] / mib:.0f}", "")
        if row.get("peak_rss_joined_rank0_bytes"):
            table.add_row(f"{key} peak RSS rank 0 through joining (MiB)",
                          f"{row['peak_rss_joined_rank0_bytes'] / mib:.0f}", "")
        table.add_row(f"{key} anchors per rank (MiB)", f"{row['anchor_bytes_per_rank'] / mib:.1f}", "")
        table.add_row(f"{key} join s", f"{row['join_s']:.2f}", "")
        if row.get("shard_answers_sent") is not None:
            table.add_row(f"{key} shard's answers sent (MiB)", f"{row['shard_answers_sent']} "
                          f"({row['shard_answer_bytes_sent'] / mib:.0f})", "")
        if "speed_ratio" in row:
            table.add_row(f"{key} tokens/s synced / unsynced", f"{row['speed_ratio']:.3f}", "≥ 0.95")
    for h, row in results.get("speed", {}).get("by_H", {}).items():
        table.add_row(f"W2 H={h} tokens/s synced / unsynced (medians)", f"{row['tokens_per_s_synced']:.1f} / "
                      f"{row['tokens_per_s_unsynced']:.1f} = {row['speed_ratio']:.3f}", "≥ 0.95")
        table.add_row(f"W2 H={h} pushes / merges per run while training (and leaving)",
                      f"{row['pushes_trained']} / {row['merges_trained']} ({row['pushes']} / {row['merges']})", "")
        table.add_row(f"W2 H={h} ranks' CPU s per push or answer", f"{row['cpu_s_per_sync_message']:.3f}", "")
        cpu_rows(table, row, "synced", f"syncing at H={h}")
        without = results["speed"].get("thread_cpu_s_unsynced", {})
        for name, cpu in sorted(row.get("thread_cpu_s", {}).items(), key=lambda kv: -kv[1])[:8]:
            table.add_row(f"W2 H={h} CPU s of {name}, synced / unsynced", f"{cpu:.2f} / {without.get(name, 0.0):.2f}", "")
    if "checkpoint" in results:
        row = results["checkpoint"]
        table.add_row("W2 tokens/s checkpoints on / off (medians)", f"{row['tokens_per_s_checkpoints_on']:.1f} / "
                      f"{row['tokens_per_s_checkpoints_off']:.1f}", "")
        table.add_row("W2 checkpoint cost (1 − on / off)", f"{row['checkpoint_cost_fraction']:.3f}", "≤ 0.01")
        table.add_row("W2 checkpoints written / skipped per run", f"{row['checkpoints_written']} / "
                      f"{row['checkpoints_skipped']}", "")
        table.add_row("W2 one checkpoint's cost (s) / period (steps, at most)", f"{row['checkpoint_cost_s']} / "
                      f"{row['checkpoint_period']} ({row['checkpoint_every']})", "")
        table.add_row("W2 checkpoints' cost as the learner measured it / train time",
                      ", ".join(f"{v:.3f}" for v in row["measured_cost_share"]), "≤ 0.01")
        if "checkpoints_cpu_ratio" in row:
            cpu_rows(table, row, "checkpoints", "checkpoints")
    for strategy, row in results.get("equivalence", {}).items():
        table.add_row(f"{strategy}: FSDP vs DDP final loss", f"{row['fsdp_loss']:.6f} vs {row['ddp_loss']:.6f} "
                      f"({row['relative_difference']:.2e})", "≤ 1e-3")
        if "ddp_noise" in row:
            table.add_row(f"{strategy}: DDP vs DDP again (noise)", f"{row['ddp_again_loss']:.6f} "
                          f"({row['ddp_noise']:.2e})", "")
    if "mixed" in results:
        for m, v in results["mixed"]["learners"].items():
            table.add_row(f"mixed run learner {m}: trained / merged / stale / lost",
                          f"{v['trained']:.0f} / {v['merged']:.1f} / {v['stale']:.1f} / {v['lost']:.1f}", "lost 0")
        table.add_row("mixed run: every token merged once", str(results["mixed"]["all_accounted"]), "True")
    Console().print(table)


def cpu_rows(table: Table, row: dict[str, Any], name: str, what: str) -> None:
    """The learner ranks' CPU per token with `what` and without it (every thread), and the shard's CPU."""
    on, off = row[f"learner_cpu_us_per_token_{name}"], row["learner_cpu_us_per_token_baseline"]
    table.add_row(f"W2 ranks' CPU µs per token with / without {what} (runs)",
                  f"{', '.join(f'{v:.0f}' for v in on)} / {', '.join(f'{v:.0f}' for v in off)}", "")
    table.add_row(f"W2 ranks' CPU cost of {what} (1 − without / with, medians)",
                  f"{1 - row[f'{name}_cpu_ratio']:.3f}", "")
    table.add_row("W2 shard CPU s / ranks' CPU s per run", ", ".join(
        f"{s:.1f} / {c:.1f}" for s, c in zip(row["shard_cpu_s"], row["learner_cpu_s"])), "")
