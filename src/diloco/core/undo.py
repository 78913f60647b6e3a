"""All or nothing for the syncer core, at the cost of what a call changes, not of what the core holds.

A call that ends in RoundRefused (a round whose result would not be finite) must leave the core exactly
as it was before the call, the event that triggered it included. Copying the core's state before every
event would cost in proportion to the learners it knows; instead every part of the core records here,
before it changes something, the old value of just that entry (one learner's ledger entry, one
fragment's round state) the first time the call touches it. A refused call puts them back, newest
first; an accepted one drops them. Tensors anyone may hold are never changed in place (a round writes
new ones into buffers nobody holds, `scratch.py`, and swaps them in), so an entry's old value is a shallow
copy, or a copy of its small containers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable, TypeVar

from diloco.core.refusals import RoundRefused

T = TypeVar("T")
MISSING = object()
"""The old value of an entry that did not exist: putting it back removes the entry."""


def same(value: T) -> T:
    return value


class UndoLog:
    """The old values of what the current transaction changed; outside a transaction it keeps nothing."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] | None = None
        self._kept: set[tuple[int, Hashable]] = set()
        self.serial = 0
        """Counts transactions: what one made (`made_here`) it may change in place, nobody else holds it."""

    @property
    def active(self) -> bool:
        return self._undo is not None

    def _first(self, owner: object, key: Hashable) -> bool:
        """True the first time this transaction touches `key` of `owner` (later changes keep nothing)."""
        if self._undo is None or (id(owner), key) in self._kept:
            return False
        self._kept.add((id(owner), key))
        return True

    def keep(self, mapping: dict, key: Hashable, copy: Callable[[Any], Any] = same) -> None:
        """`mapping[key]` is about to change (or appear, or go): `copy` its old value so it can return."""
        if not self._first(mapping, key):
            return
        old = mapping.get(key, MISSING)
        old = old if old is MISSING else copy(old)

        def put_back() -> None:
            if old is MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old
        self._undo.append(put_back)

    def keep_attrs(self, owner: object, *names: str, copy: Callable[[Any], Any] = same) -> None:
        """Attributes of `owner` about to be replaced (or, with `copy`, changed inside)."""
        for name in names:
            if self._first(owner, "." + name):
                old = copy(getattr(owner, name))
                self._undo.append(lambda name=name, old=old: setattr(owner, name, old))

    def keep_member(self, members: set, item: Hashable) -> None:
        """`item` is about to join or leave the set `members`."""
        if self._first(members, item):
            present = item in members
            self._undo.append(lambda: members.add(item) if present else members.discard(item))

    def keep_length(self, items: list) -> None:
        """`items` is about to be appended to."""
        if self._first(items, "#"):
            length = len(items)
            self._undo.append(lambda: items.__delitem__(slice(length, None)))

    def on_undo(self, put_back: Callable[[], None]) -> None:
        """Call `put_back` if the transaction is refused (for changes the helpers above do not fit)."""
        if self._undo is not None:
            self._undo.append(put_back)

    def run(self, call: Callable[[], T]) -> T:
        """Run `call` as one transaction (within one already open, as part of it)."""
        if self._undo is not None:
            return call()
        self._undo = []
        self.serial += 1
        try:
            return call()
        except RoundRefused:
            for put_back in reversed(self._undo):
                put_back()
            raise
        finally:
            self._undo = None
            self._kept.clear()


def atomic(method: Callable[..., T]) -> Callable[..., T]:
    """A method of an object with an `undo` log, run as one transaction of it."""

    @functools.wraps(method)
    def run(owner: Any, *args: Any, **kwargs: Any) -> T:
        return owner.undo.run(lambda: method(owner, *args, **kwargs))
    return run
