"""Pre-started spare processes (`python -m diloco.prestarted`): a learner restart that costs a join and a
step, not a Python start; a syncer shard's, its state and journal.

A fresh learner process spends most of its start importing (torch, and `torch._dynamo`, which every
`torch.optim` optimizer imports the first time it is built): seconds, more on a loaded machine. A spare
is a process that has already done that and waits, blocked on its stdin, for the identity of the learner
it replaces: the whole command line of that learner, its log file, and the instant the launcher handed
it over. It then becomes that learner (`diloco learner ARGS`, as a fresh process would run it) with its
output in the learner's log; the learner's `start` metrics count from the handover, not from the spare's
own start. The launcher starts another spare at once, so the next restart finds one.

A syncer shard's spare does the same with what a shard imports; it becomes the shard with `--resume`.
A spare is used only where it is the same as a fresh start: the same interpreter, the same `diloco`
command, the same environment (OMP_NUM_THREADS is read once, as torch is imported). Anything else is
started afresh.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from diloco.clock import SYSTEM_CLOCK as clock
from diloco.launch.processes import Child, Children, with_extra

DILOCO_MODULE = ["-m", "diloco"]


class Spares:
    """`count` spare processes for the children of one `role` (`learner`, `syncer`), started with those
    children's environment; each restart takes one and starts its replacement."""

    def __init__(self, children: Children, env: dict[str, str], count: int, role: str = "learner") -> None:
        self.children, self.env, self.count, self.role = children, dict(env), count, role
        self.prefix = f"spare-{role}-"
        self.started = 0
        self.handed_over: list[dict[str, Any]] = []
        """Each handover: the child, the spare, when (Unix time)."""

    def fill(self, count: int | None = None) -> None:
        """Start spares until there are `count` (default the pool's) running, not yet handed over."""
        while len(self.waiting()) < (self.count if count is None else count):
            name = f"{self.prefix}{self.started}"
            self.started += 1
            ready = self._ready_file(name)
            ready.unlink(missing_ok=True)
            self.children.start(name, [sys.executable, "-m", "diloco.prestarted", self.role, str(ready)], self.env,
                                stdin=subprocess.PIPE)

    def _ready_file(self, name: str) -> Path:
        return self.children.log_dir / f"{name}.ready"

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every spare waiting has done its imports (or died), at most `timeout_s`; whether they all
        had."""
        deadline = clock.monotonic() + timeout_s
        while any(not self._ready_file(c.name).exists() for c in self.waiting()):
            if clock.monotonic() >= deadline:
                return False
            clock.sleep(0.1)
        return True

    def waiting(self) -> list[Child]:
        return self.children.running(self.prefix)

    def restart(self, name: str, extra_args: tuple[str, ...] = (), refill: bool = True) -> Child:
        """Child `name` started again with the arguments it had plus `extra_args`: by a spare taking its place
        where one fits, else (no spare running, or the child's command or environment is not the one a spare
        runs) as `Children.restart` starts it. `refill`: start the spare's replacement now (else the caller
        calls `fill` when the restart's own work is done)."""
        old = self.children.children[name]
        spares = self.waiting()
        if not spares or old.argv[:3] != [sys.executable, *DILOCO_MODULE] or old.env != self.env:
            return self.children.restart(name, extra_args)
        spare, argv = spares[0], with_extra(old.argv, extra_args)
        handed = clock.now()
        message = {"argv": argv[3:], "log": str(old.log_path), "handed_over_unix": handed}
        try:
            spare.process.stdin.write((json.dumps(message) + "\n").encode())
            spare.process.stdin.close()
        except OSError:  # it died before it was handed over: a fresh start instead
            return self.children.restart(name, extra_args)
        child = Child(name, argv, old.env, old.log_path, process=spare.process, log_file=spare.log_file)
        del self.children.children[spare.name]
        self._ready_file(spare.name).unlink(missing_ok=True)
        self.children.children[name] = child
        self.handed_over.append({"child": name, "spare": spare.name, "handed_over_unix": handed})
        if refill:
            self.fill()
        return child
