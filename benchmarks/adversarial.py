"""Adversarial probes against a live `diloco syncer` and the command line: what is refused, what crashes.

    python benchmarks/adversarial.py [--json PATH] [--idle-connections N]

About 2 minutes on 2 cores. A `diloco syncer` subprocess is started with a shared secret and state on
disk; two honest learners (0 and 1) join it, seed Θ and push once each. Then every probe runs, as
  outsider  a caller without the secret (or with a wrong one): every RPC, and half-open calls that send
            their headers and never their body;
  insider   learner 0's own credentials, used to lie: to act as learner 1, to send pushes that would
            ruin Θ (huge, non-finite, walked up a little at a time), to claim impossible counters or a
            rate that would spend the budget at once, to seed Θ with 3e38; credentials in forms not
            canonical; then, the shard killed, its state file rewritten with a recomputed checksum, and
            a fresh run (same secret, --operator-seeds) sent a push recorded in the first and a learner's Init;
  resource  connections and calls held open, a declared 256 GiB Init;
  cli       bad command lines and files: one line of error, never a traceback, never a silent start.
The probes live in `_adversarial_probes.py`, the shard under test in `_adversarial_shard.py`.
After each probe the shard must still be healthy: learner 1's heartbeat answered within 1 s, Θ finite,
and, for a refused probe, the shard's state (versions, rounds, tokens, ledger, Θ) as before the probe.

Each probe ends as one of
  refused   the bad input was turned away with a one-line reason and nothing changed;
  accepted  the bad input was taken (silently, or it changed state);
  crashed   the shard stalled (no answer within 1 s), died, or the CLI printed a traceback.
Prints a table per kind and writes JSON (default benchmarks/results/adversarial.json). Targets: 0
crashed, 0 accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch
from rich.console import Console
from rich.table import Table

from _adversarial_probes import (bound_metadata, claim_probes, half_open_calls, idle_connections, init_too_large,
                                 insider_probes, outsider_probes, replay, replayed_into, seeded_by_a_learner,
                                 seeded_huge, streams_and_half_open, walking_up)
from _adversarial_shard import TINY_SETS, Outcome, Refused, Shard, call
from diloco.state_files import save_checked
from diloco.transport.security import TransportSecurity, learner_security


def cli_probes(workdir: Path) -> Iterator[tuple[str, list[str]]]:
    """(probe, arguments to `diloco`)."""
    bad_config = workdir / "latin1.toml"
    bad_config.write_bytes(b"[train]\ntokens = 1000 # caf\xe9\n")
    a_file = workdir / "a-file"
    a_file.write_text("not a directory")
    empty = workdir / "no-state"
    empty.mkdir()
    torn = workdir / "torn"
    (torn / "syncer").mkdir(parents=True)
    (torn / "syncer" / "shard-0.state.pt").write_bytes(b"PK\x03\x04 torn")
    pickled = workdir / "pickled"
    (pickled / "checkpoints").mkdir(parents=True)
    (pickled / "checkpoints" / "learner-0.pt").write_bytes(
        b"\x80\x04cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.")
    sim = ["sim", "-q", "--out", str(workdir / "sim-out")]
    yield "a config file that is not UTF-8", ["sim", str(bad_config), "-q"]
    yield "train.tokens=1e30", [*sim, "--set", "train.tokens=1e30"]
    yield "codec.block=2^40", [*sim, "--set", f"codec.block={2**40}"]
    yield "outer.lr=inf", [*sim, "--set", "outer.lr=inf"]
    yield "outer.lr=1e308", [*sim, "--set", "outer.lr=1e308"]
    yield "outer.outlier_factor=inf", [*sim, "--set", "outer.outlier_factor=inf"]
    yield "learners.count=10^6", [*sim, "--set", "learners.count=1000000"]
    yield "--metrics-port 70000", ["syncer", "--metrics-port", "70000"]
    yield "--out a file", ["sim", "-q", "--out", str(a_file)]
    yield "--out in a read-only place", ["sim", "-q", "--out", "/proc/diloco-out"]
    yield "--resume with no saved state", ["syncer", "--out", str(empty), "--resume", "--bind", "127.0.0.1:0"]
    yield "--resume from a torn state file", ["syncer", "--out", str(torn), "--resume", "--bind",
                                              "127.0.0.1:0"]
    for name, damage in (("deleted", None), ("a directory", "mkdir")):
        ran = workdir / f"ran-{name.replace(' ', '-')}"
        (ran / "syncer").mkdir(parents=True)
        (ran / "syncer" / "shard-0.seeded").write_text("seeded\n")  # what a shard that seeded Θ leaves
        (ran / "syncer" / "shard-0.journal").touch()  # emptied at its last save: a clean exit
        if damage:
            (ran / "syncer" / "shard-0.state.pt").mkdir()
        yield f"--resume of a shard that ran, its state file {name}", [
            "syncer", *TINY_SETS, "--out", str(ran), "--resume", "--bind", "127.0.0.1:0"]
    yield "a pickle as a learner checkpoint", ["learner", *TINY_SETS, "--no-sync", "--id", "0", "--out",
                                              str(pickled)]


def run_cli(arguments: list[str], timeout_s: float = 60) -> object:
    done = subprocess.run([sys.executable, "-m", "diloco", *arguments], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if "Traceback" in done.stderr:
        raise RuntimeError(f"a traceback: {lines[-1] if lines else ''}")
    if done.returncode == 0:
        return f"exit code 0: {(lines or ['no output'])[-1]}"
    if len(lines) != 1:
        raise RuntimeError(f"{len(lines)} lines of error: {' | '.join(lines)[:200]}")
    raise Refused(lines[0])


# ---------------------------------------------------------------- running and reporting


def judge(kind: str, name: str, probe: Callable[[], object], shard: Shard | None) -> Outcome:
    before = shard.state() if shard is not None else None
    try:
        returned = probe()
    except Refused as refusal:
        reason = str(refusal)
        if "\n" in reason.strip():
            return Outcome(kind, name, "crashed", f"a refusal of several lines: {reason[:200]!r}")
        if shard is not None:
            problem = shard.healthy()
            if problem:
                return Outcome(kind, name, "crashed", problem)
            if shard.state() != before:
                return Outcome(kind, name, "accepted", f"refused ({reason}) but the shard's state changed")
        return Outcome(kind, name, "refused", reason)
    except Exception as exc:  # noqa: BLE001 — any other failure of the probe is the service failing it
        return Outcome(kind, name, "crashed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    problem = shard.healthy() if shard is not None else None
    if problem:
        return Outcome(kind, name, "crashed", problem)
    return Outcome(kind, name, "accepted", str(returned)[:200] if isinstance(returned, str) else "taken")


def probe_shard(workdir: Path, half_open: int = 32, idle: int = 1100) -> list[Outcome]:
    """Every probe against one live shard (outsider, insider, resource), in order; the shard is stopped."""
    outcomes = []
    shard = Shard(workdir)
    try:
        outcomes.append(judge("insider", "Init of Θ = 3e38", seeded_huge(shard), None))
        outcomes.append(judge("resource", "Init declaring 256 GiB", init_too_large(shard), None))
        for name, probe in outsider_probes(shard):
            outcomes.append(judge("outsider", name, lambda probe=probe: call(probe), shard))
        for who, security in (("no secret", None), ("a wrong secret", TransportSecurity(secret=b"guess"))):
            outcomes.append(judge("outsider", f"{half_open} half-open calls with {who}",
                                  half_open_calls(shard, half_open, security), shard))
        for name, probe in [*insider_probes(shard), *claim_probes(shard)]:
            outcomes.append(judge("insider", name, lambda probe=probe: call(probe), shard))
        outcomes.append(judge("insider", "the same push again, numbered one higher", replay(shard), None))
        outcomes.append(judge("insider", "pushes walking the outlier bound up", walking_up(shard), None))
        outcomes.append(judge("resource", f"{half_open} half-open calls as learner 0",
                              half_open_calls(shard, half_open, learner_security(shard.run_secret, 0)), shard))
        outcomes.append(judge("resource", f"64 update streams and {half_open} half-open calls",
                              streams_and_half_open(shard, 64, half_open), shard))
        outcomes.append(judge("resource", f"{idle} idle connections", idle_connections(shard, idle), shard))
        recorded = bound_metadata(shard, 0)
    finally:
        shard.stop()
    outcomes.append(judge("insider", "the state file rewritten with Θ = 3e38, its checksum recomputed",
                          rewritten_state(workdir), None))
    return outcomes + fresh_run(workdir / "fresh", recorded)


def fresh_run(workdir: Path, recorded: list[tuple[str, str]]) -> list[Outcome]:
    """A second run with the same secret, only the operator seeding: a learner's Init, then a push recorded
    in the first run."""
    workdir.mkdir()
    fresh = Shard(workdir, "--operator-seeds")
    try:
        outcomes = [judge("insider", "Init by a learner under --operator-seeds", seeded_by_a_learner(fresh), None)]
        fresh.seed(by_operator=True)
        outcomes.append(judge("insider", "a push recorded in another run with the same secret",
                              replayed_into(fresh, recorded), fresh))
    finally:
        fresh.stop()
    return outcomes


def rewritten_state(workdir: Path) -> Callable[[], object]:
    """The killed shard's state file with Θ rewritten to 3e38 and an unkeyed checksum recomputed over it,
    resumed with the run's secret."""

    def probe() -> object:
        out = workdir / "tampered"
        shutil.copytree(workdir / "syncer", out)
        path = out / "syncer" / "shard-0.state.pt"
        state = torch.load(path, weights_only=True)
        state["core"]["theta"] = {n: torch.full_like(t, 3e38) for n, t in state["core"]["theta"].items()}
        save_checked(state, path)
        return run_cli(["syncer", *TINY_SETS, "--out", str(out), "--resume", "--secret-file",
                        str(workdir / "secret"), "--bind", "127.0.0.1:0"], timeout_s=30)

    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "adversarial.json")
    parser.add_argument("--idle-connections", type=int, default=1100)
    parser.add_argument("--half-open", type=int, default=32)
    args = parser.parse_args()
    console = Console()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="diloco-adversarial-") as tmp:
        workdir = Path(tmp)
        outcomes += probe_shard(workdir, args.half_open, args.idle_connections)
        for name, arguments in cli_probes(workdir):
            outcomes.append(judge("cli", name, lambda arguments=arguments: run_cli(arguments), None))
    report(console, outcomes)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")
    console.print(f"wrote {args.json}")


def report(console: Console, outcomes: list[Outcome]) -> None:
    detail = Table(title="probes")
    for column in ("kind", "probe", "result", "reason or failure"):
        detail.add_column(column, overflow="fold")
    for o in outcomes:
        style = {"refused": "green", "accepted": "yellow", "crashed": "red"}[o.result]
        detail.add_row(o.kind, o.probe, f"[{style}]{o.result}[/]", o.detail[:120])
    console.print(detail)
    summary = Table(title="summary (targets: 0 crashed or stalled, 0 silently accepted)")
    for column in ("kind", "probes", "refused", "crashed", "accepted"):
        summary.add_column(column, justify="right" if column != "kind" else "left")
    for kind in [*dict.fromkeys(o.kind for o in outcomes), "all"]:
        mine = [o for o in outcomes if kind in ("all", o.kind)]
        summary.add_row(kind, str(len(mine)), *(str(sum(o.result == r for o in mine))
                                                for r in ("refused", "crashed", "accepted")))
    console.print(summary)


if __name__ == "__main__":
    main()
