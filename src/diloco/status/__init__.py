"""A syncer shard's human-readable status page: an HTML renderer and a small HTTP server for it."""
