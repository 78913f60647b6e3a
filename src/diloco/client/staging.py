"""Moving a learner's tensors between its device and the host without holding up its training.

On a GPU, outer gradients are handed to a side CUDA stream where they are encoded and copied to the
host (the encoding thread waits, the training stream does not), and new versions are copied in and
added to their anchors on that stream; the training stream only waits on an event before it merges
them, between steps. No host synchronisation is in the training thread's path. On the CPU every
method is a no-op and tensors are used where they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


class DeviceStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def hand_off(self, tensors: Iterable[torch.Tensor]) -> torch.cuda.Event | None:
        """Training thread: `tensors` were made on the training stream and will be read on the side
        stream: keep their memory until then, and mark the point the side stream must wait for."""
        if not self.cuda:
            return None
        for tensor in tensors:
            tensor.record_stream(self.stream)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def side(self, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """Background thread: run what follows on the side stream, after `after` (default: after all
        the training stream has queued so far)."""
        if not self.cuda:
            yield
            return
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def to_device(self, value: torch.Tensor) -> torch.Tensor:
        """Inside `side()`: a host tensor copied in without blocking (from pinned memory)."""
        if not self.cuda:
            return value.to(self.device)
        return value.pin_memory().to(self.device, non_blocking=True)

    def done(self) -> torch.cuda.Event | None:
        """Inside `side()`: the point the training stream must wait for before it uses the results."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_in_training(self, event: torch.cuda.Event | None) -> None:
        """Training thread: later work on the training stream waits for `event`; the host does not."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
