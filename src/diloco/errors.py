"""User-facing errors: the CLI prints these as one line, without a traceback."""

import sys


class DilocoError(Exception):
    """A problem the user can fix: bad config, missing file, unusable model. The message names it."""


class ConfigError(DilocoError):
    """A config key with an unknown name, a wrong type or an impossible value."""


def print_error(exc: BaseException) -> None:
    """The one line a command ends with on a user-facing error (`diloco: error: ...`)."""
    print(f"diloco: error: {exc}", file=sys.stderr, flush=True)
