"""What the syncer core refuses."""

from __future__ import annotations


class ProtocolError(Exception):
    """A message that breaks the protocol; the syncer's state is left as it was."""


class RoundRefused(ProtocolError):
    """Closing a round would have made Θ or the outer optimizer's state non-finite: the call that
    closed it is undone whole (its push or report included) and refused."""
