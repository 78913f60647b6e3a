"""Sans-I/O state machines: they take events and return actions; no sockets, threads or sleeps.

The simulated driver (virtual clock) and the real driver (processes, network) run the same cores.
"""

from diloco.core.learner_core import LearnerCore, Poll
from diloco.core.messages import Push, Update, tensors_wire_bytes
from diloco.core.syncer_core import Publish, ProtocolError, SyncerCore, Timer

__all__ = ["LearnerCore", "Poll", "Push", "Update", "SyncerCore", "ProtocolError", "Publish", "Timer",
           "tensors_wire_bytes"]
