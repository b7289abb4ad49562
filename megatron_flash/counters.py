"""Counters for one metrics window: a dataclass of numbers whose `take()` returns the window so far and
starts a new one (each field back to its type's zero). The rollout scheduler's and the agentic env
manager's stats are such windows, read once per training step."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

T = TypeVar("T", bound="Counters")


class Counters:
    """Mix into a @dataclass whose fields are ints or floats; only one thread may write them."""

    def take(self: T) -> T:
        snap = dataclasses.replace(self)  # type: ignore[type-var]
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, type(getattr(self, f.name))())
        return snap
