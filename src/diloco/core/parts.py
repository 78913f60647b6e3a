"""How the syncer core shows its parts' state under the names drivers and tests have always used."""

from __future__ import annotations

import functools
from typing import Any


class Of:
    """An attribute of one of the core's parts, read and set through the core under its usual name."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def _part(self, core: Any) -> Any:
        return functools.reduce(getattr, self.part.split("."), core)

    def __get__(self, core: Any, owner: type | None = None) -> Any:
        return self if core is None else getattr(self._part(core), self.name)

    def __set__(self, core: Any, value: Any) -> None:
        setattr(self._part(core), self.name, value)
