"""The real driver's syncer shard: the core served over gRPC, its journal and saved state, its waker, its regional tier."""
