"""What a run in virtual time needs, below the simulator (`diloco.sim`) and the planner's replay
(`plan/replay.py`): step timers, the event queue, and pushes taken in the order they were numbered."""
