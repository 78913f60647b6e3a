"""The real driver: syncer shard server, learner client, built-in learner loop and local launcher."""
