"""Protocol version 1 between learners and syncer shards: `diloco.proto` and the modules protoc
generates from it (committed, so an install needs no code generator; `make proto` regenerates them)."""
