"""`diloco token --learner M`: print learner M's own credential, for a learner that should hold only
its own identity and not the run secret (give it the line in `--learner-token-file` or
DILOCO_LEARNER_TOKEN). Reads the run secret as the syncer does; no gRPC."""

from __future__ import annotations

import argparse

from diloco.errors import DilocoError
from diloco.transport.security_settings import MAX_LEARNER_ID, SECRET_ENV, LearnerCredential, resolve_secret


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learner", type=int, required=True, action="append", metavar="M",
                   help="the learner id (repeat for several: one line each)")
    p.add_argument("--secret-file", metavar="FILE", help=f"file holding the run secret (default: ${SECRET_ENV})")


def run(args: argparse.Namespace) -> int:
    secret = resolve_secret(args.secret_file)
    if secret is None:
        raise DilocoError(f"a learner's credential is derived from the run secret: give --secret-file or set "
                          f"{SECRET_ENV}")
    for learner in args.learner:
        if not 0 <= learner <= MAX_LEARNER_ID:
            raise DilocoError(f"--learner must be between 0 and {MAX_LEARNER_ID}, got {learner}")
    for learner in args.learner:
        print(LearnerCredential.of(secret, learner).text(), flush=True)
    return 0
