"""`diloco chaos`: the real runtime under SIGKILL, next to the same run without faults.

The faulty run kills learners and syncer shards at random times (seeded) and restarts each after a
delay: a learner with its id (it resumes from its own checkpoint and the current Θ), a shard with
`--resume` (its saved state and journal). Then both runs are compared, and every token is accounted
for: what each learner trained, in all its lives (from its per-step metrics), against what the syncer
merged, on time or stale; the difference is lost (trained after a learner's last push, before it was
killed), and a token counted more often than it was trained would be a duplicate.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.config import Config
from diloco.core.accounting import learner_tokens, ledger_of
from diloco.metrics.records import learner_lives, records_of
from diloco.outputs import write_output
from diloco.launch.launcher import Launcher
from diloco.launch.outage_timeline import shard_outages
from diloco.launch.spare import Spares
from diloco.shard.ownership import placed_shard_count

log = logging.getLogger(__name__)

REFILL_AFTER_S = 3.0
"""How long after a restart that took a pool's last spare another is started (or at the next kill, if that
comes sooner): a spare's start imports torch, seconds of CPU, which the restarted shard's resume and the
learners' rejoining need more on a machine whose cores the run shares."""
SPARE_READY_S = 120.0
"""The longest the run's start waits for its spares' imports."""


@dataclass
class Kill:
    at_s: float
    """Seconds into training."""
    victim: str
    restarted_at_s: float | None = None
    killed_unix: float | None = None
    """When it was killed and restarted (Unix time: the children's metrics share that axis)."""
    restarted_unix: float | None = None


@dataclass
class ChaosMonkey:
    launcher: Launcher
    kills: list[Kill]
    restart_after_s: float
    spare_count: int = 0
    """At most this many pre-started spare learners (`launch/spare.py`) for the restarts to take (and, if
    any, a spare shard per planned shard kill)."""
    done: threading.Event = field(default_factory=threading.Event)
    spares: dict[str, Spares] | None = None
    """Per role (`learner`, `syncer`), the spares its restarts take (`ready_spares`)."""
    spares_ready: dict[str, Any] = field(default_factory=dict)
    """How long the start waited for the spares' imports, and whether they were all done."""

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        thread.start()
        return thread

    def ready_spares(self) -> None:
        """On the launcher's thread, before its learners start (they live as long as it: PR_SET_PDEATHSIG):
        the spares, one per planned kill up to `spare_count` learners, imported before training begins. On
        a machine whose cores the run shares, a spare's imports (seconds of CPU) during training would slow
        the other learners, which on their own hosts no restart would; past them, a restart that takes a
        pool's last spare has another started `REFILL_AFTER_S` later."""
        if not self.spare_count:
            return
        planned = {role: sum(1 for k in self.kills if k.victim.startswith(role)) for role in ("learner", "syncer")}
        launcher = self.launcher
        self.spares = {"learner": Spares(launcher.children, launcher.learner_env(),
                                         min(self.spare_count, max(1, planned["learner"]))),
                       "syncer": Spares(launcher.children, launcher.env, max(1, planned["syncer"]), "syncer")}
        began = clock.monotonic()
        for pool in self.spares.values():
            pool.fill()
        ready = all([pool.wait_ready(SPARE_READY_S) for pool in self.spares.values()])  # each pool waited for
        if not ready:
            log.warning("spares still importing after %.0f s: training starts beside them", SPARE_READY_S)
        self.spares_ready = {"waited_s": clock.monotonic() - began, "all_ready": ready,
                             "count": {role: pool.count for role, pool in self.spares.items()}}

    def _run(self) -> None:
        launcher = self.launcher
        while not hasattr(launcher, "training_started"):
            if self.done.wait(0.1):
                return
        refill_at = None
        for kill in self.kills:
            due = launcher.training_started + kill.at_s
            if refill_at is not None and self._refill(min(refill_at, due)):
                return
            refill_at = None
            if self.done.wait(max(0.0, due - clock.monotonic())):
                return
            child = launcher.children.children.get(kill.victim)
            if child is None or child.returncode is not None:
                continue  # it already finished: nothing to kill
            launcher.expected_down.add(kill.victim)
            kill.killed_unix = clock.now()
            launcher.children.kill(kill.victim)
            if self.done.wait(self.restart_after_s):
                return
            extra = ("--resume",) if kill.victim.startswith("syncer") else ()
            pool = self.spares.get(kill.victim.split("-")[0]) if self.spares else None
            kill.restarted_unix = clock.now()
            if pool is not None:
                pool.restart(kill.victim, extra, refill=False)
                refill_at = clock.monotonic() + REFILL_AFTER_S
            else:
                launcher.children.restart(kill.victim, extra)
            kill.restarted_at_s = clock.monotonic() - launcher.training_started
            launcher.expected_down.discard(kill.victim)
        if refill_at is not None and self._refill(refill_at):
            return
        # The kernel ends a child when the *thread* that started it ends (PR_SET_PDEATHSIG): the
        # children restarted here must outlive this thread's work, so it waits for the run's end.
        self.done.wait()

    def _refill(self, at: float) -> bool:
        """At `at` (monotonic), start a spare for each pool the restarts emptied (here: it lives as long as
        this thread); True if the run ended first."""
        if self.done.wait(max(0.0, at - clock.monotonic())):
            return True
        for pool in (self.spares or {}).values():
            pool.fill(1)
        return False


def plan_kills(rng: random.Random, learners: int, shards: int, kill_learners: int, kill_syncer: int,
               duration_s: float) -> list[Kill]:
    """Kill times spread over the middle of the run, victims drawn at random."""
    victims = [f"learner-{rng.randrange(learners)}" for _ in range(kill_learners)]
    victims += [f"syncer-{rng.randrange(shards)}" for _ in range(kill_syncer)]
    rng.shuffle(victims)
    times = sorted(rng.uniform(0.1, 0.8) * duration_s for _ in victims)
    return [Kill(t, v) for t, v in zip(times, victims)]


def account(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Trained against merged, per learner and fragment, over every life of every learner."""
    shards = json.loads((out / "syncer" / "shards.json").read_text())
    numel = {int(p): n for s in shards for p, n in s["fragment_numel"].items()}
    lives = learner_lives(out / "metrics")
    per_learner = []
    for m, ends in sorted(lives.items()):
        tokens = learner_tokens(sum(r["tokens"] for r in ends), *ledger_of(shards, m), numel)
        per_learner.append({"learner": m, "lives": len(ends), "trained": tokens["trained"], "lost": tokens["lost"],
                            "counted_twice": tokens["counted_twice"]})
    lost = sum(r["lost"] for r in per_learner)
    unaccounted = sum(r["counted_twice"] for r in per_learner)
    duplicates = sum(e.get("duplicates", 0) for s in shards for e in s.get("ledger", {}).values())
    return {"tokens_trained": sum(r["trained"] for r in per_learner), "tokens_lost": lost,
            "tokens_counted_twice": unaccounted, "retries_recognised": duplicates,
            "per_learner": per_learner}


def learner_starts(metrics: Path) -> list[dict[str, Any]]:
    """Every learner life's start (the `start` metrics: process start to first step, and its parts), in
    time order; a learner's lives after its first are its restarts."""
    starts = []
    for path in sorted(metrics.glob("learner-*.jsonl")):
        starts += [{**record, "restart": life > 0} for life, record in enumerate(records_of(path, "start"))]
    return sorted(starts, key=lambda r: r["time_s"])


def restart_summary(starts: list[dict[str, Any]]) -> dict[str, Any]:
    """Restart times (process start to first step) of the restarts among `starts`."""
    times = sorted(r["start_to_first_step_s"] for r in starts if r["restart"])
    return {"restarts": len(times), "restart_s_max": times[-1] if times else None,
            "restart_s_median": times[len(times) // 2] if times else None,
            "restart_s_mean": sum(times) / len(times) if times else None}


def run_chaos(config: Config, config_args: list[str], out: Path, *, kill_learners: int, kill_syncer: int,
              seed: int, restart_after_s: float, shards: int = 1, spares: int = 0, **launcher_options
              ) -> dict[str, Any]:
    """The fault-free run, then the faulty one; their comparison (also written to OUT/chaos.json)."""
    args = [*config_args, "--set", "metrics.every_steps=1"]  # every step recorded: tokens are accounted exactly
    shards = placed_shard_count(config, shards)  # spread homes: a shard per home region, any of them a victim
    clean = Launcher(config, args, out / "clean", shards=shards, **launcher_options).run()
    faulty_launcher = Launcher(config, args, out / "faulty", shards=shards, **launcher_options)
    kills = plan_kills(random.Random(seed), config.learners.count, shards, kill_learners, kill_syncer,
                       clean["training_time_s"])
    monkey = ChaosMonkey(faulty_launcher, kills, restart_after_s, spares)
    thread = monkey.start()
    try:
        faulty = faulty_launcher.run(before_learners=monkey.ready_spares)
    finally:
        monkey.done.set()
        thread.join()
    accounting = account(out / "faulty", faulty)
    starts = learner_starts(out / "faulty" / "metrics")
    killed = {k.victim for k in kills if k.restarted_at_s is not None}
    survivors = [r for r in faulty["per_learner"] if f"learner-{r['learner']}" not in killed]
    result = {
        "seed": seed, "kills": [vars(k) for k in kills], "spares": spares, "spares_ready": monkey.spares_ready,
        "spare_handovers": [h for pool in (monkey.spares or {}).values() for h in pool.handed_over],
        "clean": {"final_eval_loss": clean["final_eval_loss"], "goodput": clean["goodput"],
                  "rounds": clean["rounds"], "training_time_s": clean["training_time_s"]},
        "faulty": {"final_eval_loss": faulty["final_eval_loss"], "rounds": faulty["rounds"],
                   "training_time_s": faulty["training_time_s"],
                   "goodput_of_survivors": (sum(r["busy_s"] for r in survivors) /
                                            sum(r["busy_s"] / r["busy_fraction"] for r in survivors)
                                            if survivors else None),
                   "survivors": [r["learner"] for r in survivors],
                   "goodput_while_up": (sum(r["busy_s"] for r in faulty["per_learner"]) /
                                        sum(r["busy_s"] / r["busy_fraction"] for r in faulty["per_learner"])),
                   **accounting, **restart_summary(starts),
                   "learner_restarts": [{k: r.get(k) for k in ("learner", "time_s", "start_to_first_step_s", "import_s",
                                                               "join_s", "first_step_s", "steps", "resumed_fragments",
                                                               "spare")}
                                        for r in starts if r["restart"]]},
    }
    result["faulty"]["tokens_lost_share"] = accounting["tokens_lost"] / max(1, accounting["tokens_trained"])
    result["shard_outages"] = shard_outages(out / "faulty" / "metrics", result["kills"], faulty_launcher.started_unix)
    result["loss_vs_clean"] = result["faulty"]["final_eval_loss"] / clean["final_eval_loss"] - 1
    write_output(out / "chaos.json", json.dumps(result, indent=2) + "\n")
    return result
