"""User-facing errors: the CLI prints these as one line, without a traceback."""


class DilocoError(Exception):
    """A problem the user can fix: bad config, missing file, unusable model. The message names it."""


class ConfigError(DilocoError):
    """A config key with an unknown name, a wrong type or an impossible value."""
