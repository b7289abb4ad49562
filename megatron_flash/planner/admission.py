"""Admission in the planner: how far ahead of training the rollout may start groups.

The product's own rule, not a copy: `buffer.staleness.Lookahead` ("Lookahead" and "Token lookahead" in
buffer/staleness.py) moves the lookahead L after each take, here on the simulation's clock. This
module only adapts it to the simulation's events:

    limit(version)     samples that may have been admitted in all: (V + 1) · B + ⌊L · B⌋
                       (the product's `capacity` with nothing consumed or outstanding)
    on_admit(now)      a group was admitted             } the engines' idle time (nothing in flight),
    on_landed(now, n)  a group left flight, n still in  } which the tokens rule reads
    note_take(...)     after each batch the trainer takes: its wait, the finished samples left
                       buffered, the share of its tokens that landed during the wait

The lookahead L (batches) starts at α (eager), min(1, α) (adaptive) or min(max(1, min_lookahead), α)
(tokens); buffer/staleness.py tables how each rule moves it, with worked examples.
"""

from __future__ import annotations

from megatron_flash.buffer.staleness import ADMISSIONS, Lookahead, capacity
from megatron_flash.config.sections.async_rl import AsyncConfig

DEFAULT_ADMISSION = AsyncConfig().admission
"""The product's default `async_rl.admission`."""


class Admission(Lookahead):
    """The admission lookahead L (batches) of one simulated run and the limit it sets (samples)."""

    def __init__(self, *, admission: str, alpha: int, batch_size: int, min_lookahead: float = 1.0,
                 start: float = 0.0) -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"admission={admission!r}: must be one of {', '.join(ADMISSIONS)}")
        if not 0.0 <= min_lookahead <= max(alpha, 1):
            raise ValueError(f"min_lookahead={min_lookahead}: must be in [0, max(alpha, 1)]")
        super().__init__(admission=admission, alpha=alpha, batch_size=batch_size, min_lookahead=min_lookahead,
                         start=start)

    @property
    def lookahead(self) -> float:
        return self.value

    @lookahead.setter
    def lookahead(self, value: float) -> None:
        self.value = value

    def limit(self, version: int) -> int:
        """Samples the rollout may have admitted in all at `version`, not counting dropped ones."""
        return capacity(version=version, alpha=self.value, batch_size=self.batch_size, extra=0, consumed=0,
                        outstanding=0)

    def on_admit(self, *, now: float) -> None:
        self.busy(now)

    def on_landed(self, *, now: float, in_flight: int) -> None:
        """A group left flight (buffered, dropped or cancelled); `in_flight` groups are still generating."""
        if not in_flight:
            self.idle(now)

    def note_take(self, *, waited_s: float, surplus: int, now: float, late: float = 0.0) -> None:
        self.take(waited_s=waited_s, surplus=surplus, now=now, late=late)
