"""How learners and syncer shards talk: gRPC (`diloco.v1`), framed tensor streams, link shaping."""
