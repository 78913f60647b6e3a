"""The real driver's client side: what joins a run and talks to the syncer's shards (the user's `Learner`, a regional syncer's uplink), and the built-in training loop."""
