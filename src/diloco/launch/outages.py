"""Regional outages in the real runtime: `failures.outages` naming a region kills the region's processes
(its learners, and with the regional tier its syncer) with SIGKILL, as a lost region would, and starts them
again `duration_s` later: the region's syncer first (on its port, from the global Θ), then its learners,
each with its id (from its own checkpoint and the current Θ).

`at_s` counts from when every learner of the region has trained (the launcher sees its tokens): processes
take seconds to start, more on a loaded machine, and an outage meant for the middle of a run must not hit
a region that has not begun."""

from __future__ import annotations

import threading
from typing import Protocol

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.config import Config, Topology
from diloco.launch.processes import Children


class SeenProgress(Protocol):
    tokens: dict[int, int]
    """Per learner, the tokens its syncer has counted."""


class Launched(Protocol):
    """What the outages need of the launcher (`launch/launcher.py`), which starts them."""

    config: Config
    children: Children
    progress: SeenProgress
    expected_down: set[str]
    training_started: float


class RegionOutages:
    def __init__(self, launcher: Launched) -> None:
        self.launcher = launcher
        config = launcher.config
        self.plan = sorted((o.at_s, o.duration_s, o.region) for o in config.failures.outages if o.region)
        self.done = threading.Event()
        self.log: list[dict[str, float | str | list[str]]] = []
        """What was killed and restarted, when (seconds into training)."""

    def start(self) -> None:
        if self.plan:
            threading.Thread(target=self._run, name="outages", daemon=True).start()

    def _victims(self, region: str) -> list[str]:
        learners = [f"learner-{m}" for m in Topology(self.launcher.config).learners_of(region)]
        syncer = [f"region-{region}"] if f"region-{region}" in self.launcher.children.children else []
        return syncer + learners

    def _run(self) -> None:
        launcher = self.launcher
        while not hasattr(launcher, "training_started"):
            if self.done.wait(0.1):
                return
        for at_s, duration_s, region in self.plan:
            members = list(Topology(launcher.config).learners_of(region))
            while not all(launcher.progress.tokens.get(m, 0) > 0 for m in members):
                if self.done.wait(0.1):
                    return
            if self.done.wait(at_s):
                return
            children = launcher.children.children
            killed = [name for name in self._victims(region)
                      if name in children and children[name].returncode is None]
            for name in killed:
                launcher.expected_down.add(name)
                launcher.children.kill(name)
            entry = {"region": region, "killed": killed, "at_s": clock.monotonic() - launcher.training_started}
            self.log.append(entry)
            if self.done.wait(duration_s):
                return
            for name in killed:  # the region's syncer first: its learners join it
                launcher.children.restart(name, ())
                launcher.expected_down.discard(name)
            entry["back_s"] = clock.monotonic() - launcher.training_started
        # Children restarted here die with the thread that started them (PR_SET_PDEATHSIG): wait for the end.
        self.done.wait()
