"""The simulated driver: real training, virtual time, simulated links."""

from diloco.sim.driver import RunResult, simulate

__all__ = ["simulate", "RunResult"]
