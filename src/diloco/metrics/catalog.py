"""Every metric by kind of record, with what it means. The simulator and the runtime write the same
names; JSONL keeps them as they are, Prometheus prefixes them `diloco_<kind>_`, TensorBoard files them
under `<kind>/<source>/`."""

from __future__ import annotations

LABELS = {"learner": ("learner",), "start": ("learner",), "round": ("shard", "fragment"), "syncer": ("shard",),
          "eval": (), "resume": ("shard",), "serving": ("shard",), "reconnect": ("learner", "shard")}
"""Fields that say whose record it is: Prometheus labels, not values."""

CATALOG: dict[str, dict[str, str]] = {
    "learner": {
        "tokens": "tokens this learner trained on so far",
        "steps": "inner steps so far",
        "tokens_per_s": "tokens per second since the previous record",
        "step_time_s": "the latest inner step's time, emulated slowness included",
        "busy_fraction": "time inside inner steps over time since the learner started",
        "bytes_up": "bytes this learner's link carried to the syncer so far",
        "bytes_down": "bytes this learner's link carried from the syncer so far",
        "loss": "the latest inner step's training loss",
        "outer_grad_norm": "L2 norm of the latest push's outer gradient",
        "staleness": "versions the fragment had moved on (by other learners) when the latest merge arrived",
        "last_merged_version": "the newest version merged, over fragments",
    },
    "start": {
        "start_to_first_step_s": "from this learner process's start to the end of its first inner step",
        "import_s": "from the process's start until the learner began building its model",
        "join_s": "joining the run and taking Θ (with its own progress put back on top)",
        "first_step_s": "the first inner step",
        "steps": "the inner step it resumed from (0: a fresh start)",
        "resumed_fragments": "fragments whose own unpushed progress it resumed from its checkpoint",
    },
    "round": {
        "version": "the version this round produced",
        "participants": "learners whose pushes this round merged (a list in JSONL, a count in Prometheus)",
        "stale": "pushes based on an older version than the round's (they missed the round they were based on)",
        "staleness": "per participant, versions its push was behind (0: on time; a list in JSONL, the mean in "
                     "Prometheus)",
        "time_to_quorum_s": "from the round's first push until it had its quorum",
        "held_s": "time the round stayed open after its quorum, waiting for learners predicted to arrive",
        "final": "the run's last round of this fragment (the consolidation onto the learners' mean)",
        "update_norm": "L2 norm of the change the round made to Θ",
        "cosine": "mean pairwise cosine similarity of the participants' outer gradients (none with one)",
        "tokens": "tokens the round merged",
    },
    "syncer": {
        "queue_length": "updates waiting in learners' outboxes",
        "checkpoint_age_s": "seconds since the shard last saved its state (none before the first)",
        "memory_bytes": "resident memory of the shard process",
        "rounds": "rounds merged so far",
    },
    "eval": {
        "tokens": "tokens trained over all learners when Θ was evaluated",
        "loss": "held-out loss of Θ",
    },
    "resume": {
        "resume_s": "a restarted shard's resume, from loading its saved state to taking its journal's last event",
        "load_s": "reading and checking the digest of the saved state",
        "check_s": "checking the saved state (its identity, Θ) and building the core from it",
        "read_s": "reading and decoding the journal after the saved state",
        "replay_s": "replaying the journaled events through the core",
        "events": "journaled events replayed",
    },
    "serving": {
        "resumed": "the shard serves (learners can reach it): 1 after a resume from its saved state, else 0",
    },
    "reconnect": {
        "down_s": "from the first call of a kind (a push, a heartbeat) a shard left unanswered to the first that "
                  "got through again, as this learner saw it",
        "push": "1: the call was a push (the learner's progress waited on it); 0: a heartbeat",
    },
}
KINDS = tuple(CATALOG)
