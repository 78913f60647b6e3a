"""`diloco plan`: a capacity planner for a real deployment.

Given the model's size, the learners, the fragments, H, τ, the step time, the codecs and the links, it
says what each learner and each syncer shard moves per second, whether each link keeps up (a fragment's
round trip fits in τ inner steps), what memory the shards need, and which H, τ, fragment count or codec
would fit. docs/plan.md explains the arithmetic.

- `units.py`: friendly sizes on the command line ("12B", "5Gbit", "80GiB", "40ms").
- `layout.py`: the fragments as tensor sizes, from the real model or assumed from a parameter count.
- `wire.py`: the bytes of each message, from the project's own byte functions.
- `links.py`: a link's steady state over a few sync periods: round trips and utilisation.
- `network.py`: a config's `[[regions]]`: every LAN and WAN link with all the traffic that shares it
  (`placement` and `topology` followed), and whether each keeps up.
- `memory.py`: which fragments each shard owns, and the memory it needs.
- `deployment.py`: what is planned (strategy, learners, links, codecs, shards), as one value.
- `model.py`: the plan computed from it; `reports.py`: what the plan says, as plain data.
- `totals.py`: bytes and time over a run from the steady state.
- `search.py`: the smallest H or τ, the fewest fragments, the least compression that keeps up.
- `replay.py`: exact wire bytes of a synchronous run (each link's too), the simulator's schedule without
  training.
- `build.py`: a config and the flags into a deployment; `command.py`, `tables.py`: the command line,
  its tables and its JSON.

Nothing here loads torch at import: the command imports what it needs when it runs.
"""
