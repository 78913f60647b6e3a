"""What tests of the syncer core use to say "refused in one line" and "nothing changed"."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

from diloco.core.refusals import ProtocolError


def refused(call: Callable[[], Any]) -> str:
    """The one-line reason `call` is refused with (it must raise ProtocolError)."""
    with pytest.raises(ProtocolError) as caught:
        call()
    message = str(caught.value)
    assert message and "\n" not in message
    return message


def frozen(core: Any) -> dict:
    """The core's whole saved state, as it is now (later changes do not reach it)."""
    return copy.deepcopy(core.state_dict())


def same(a: Any, b: Any) -> bool:
    """Equal to the bit, tensors by dtype and value, containers all the way down."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
