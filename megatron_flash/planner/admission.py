"""Admission in the planner: how far ahead of training the rollout may start groups.

The product's rules (buffer/staleness.py, "Lookahead" and "Token lookahead"), copied because the
planner imports nothing else of megatron_flash; tests/unit/test_planner_admission.py drives both
through the same events and checks they agree. The simulation talks to one `Admission` object only,
so that a new rule replaces this module and nothing in simulation.py:

    limit(version)     samples that may have been admitted in all: (V + 1) · B + ⌊L · B⌋
    on_admit(now)      a group was admitted             } the engines' idle time (nothing in flight),
    on_landed(now, n)  a group left flight, n still in  } which the tokens rule reads
    note_take(...)     after each batch the trainer takes: its wait, the finished samples left
                       buffered, the share of its tokens that landed during the wait

The lookahead L (batches) starts at α (eager), min(1, α) (adaptive) or min(max(1, min_lookahead), α)
(tokens). After each take but the first (which only starts the take-to-take clock), with "waited" =
the trainer waited past WAIT_TOLERANCE of the take-to-take period:

    adaptive  waited RAISE_AFTER takes in a row                      →  L + 1  (up to α)
              a whole batch of finished samples still buffered       →  L − 1  (down to min(1, α))
    tokens    did not wait                                           →  L − STEP_DOWN  (down to min_lookahead)
              waited, L < 1                                          →  L + late share  (up to 1)
              waited RAISE_AFTER takes in a row, L ≥ 1, the engines sat
                  idle past the tolerance over this step and the
                  one before                                         →  L + late share  (up to α)
              waited, L ≥ 1, otherwise (busy engines, or one wait)   →  L

Worked example (adaptive, α = 2, B = 1, RAISE_AFTER = 2): takes at 1.0, 1.2, 2.2, 3.4 s after waits of
1.0, 0.0, 0.8, 1.0 s, nothing left buffered: the first starts the clock; 1.2 did not wait; 2.2 waited
0.8 of a 1.0 s period (one in a row, L stays 1); 3.4 waited 1.0 of 1.2 s (two in a row) → L = 2.
"""

from __future__ import annotations

import math
from typing import Sequence

ADMISSIONS = ("tokens", "adaptive", "eager")
DEFAULT_ADMISSION = "adaptive"
"""The product's default `async_rl.admission` (a unit test keeps them equal)."""
WAIT_TOLERANCE = 0.05
"""A trainer wait up to this share of the take-to-take period is noise, not a rollout bottleneck."""
RAISE_AFTER = 2
"""Adaptive: takes in a row that waited past WAIT_TOLERANCE before the lookahead grows (one is a blip)."""
STEP_DOWN = 0.125
"""Tokens: after a take that did not wait, the lookahead falls by this share of a batch."""


def lookahead_floor(alpha: int) -> int:
    """The least lookahead that still overlaps generation with training (0 only when α = 0)."""
    return min(1, alpha)


def waited(waited_s: float, period_s: float) -> bool:
    """Did the trainer wait for rollout past the tolerance in a take-to-take period of `period_s`?"""
    return period_s > 0 and waited_s > WAIT_TOLERANCE * period_s


def next_lookahead(lookahead: int, *, alpha: int, waits_in_a_row: int, surplus: int, batch_size: int) -> int:
    """Adaptive: the lookahead after a take that ended `waits_in_a_row` waiting takes (0: this one did
    not wait) and left `surplus` finished samples buffered."""
    if waits_in_a_row >= RAISE_AFTER:
        return min(lookahead + 1, alpha)
    if surplus >= batch_size:
        return max(lookahead - 1, lookahead_floor(alpha))
    return lookahead


def late_share(*, tokens: Sequence[float], arrived: Sequence[float], since: float) -> float:
    """The share of a batch's response tokens in groups that reached the buffer after `since` (when
    the trainer began to wait). `tokens[i]`, `arrived[i]`: group i."""
    total = sum(tokens)
    return sum(t for t, a in zip(tokens, arrived) if a > since) / total if total else 0.0


def next_token_lookahead(lookahead: float, *, alpha: int, waits_in_a_row: int, late: float, starved: bool,
                         floor: float = 1.0) -> float:
    """Tokens: the lookahead after a take that ended `waits_in_a_row` waiting takes (0: it did not
    wait; the table above); `floor` = min_lookahead (at most α)."""
    if not waits_in_a_row:
        return max(lookahead - STEP_DOWN, min(floor, float(alpha)))
    if lookahead < 1:  # part of the batch started only at the push: that is what the trainer waited for
        return min(lookahead + late, 1.0, float(alpha))
    if starved and waits_in_a_row >= RAISE_AFTER:  # a batch ahead and still the engines ran dry
        return min(lookahead + late, float(alpha))
    return lookahead  # busy engines (more lookahead would only add staleness), or one wait: a blip


class Admission:
    """The admission lookahead L (batches) of one simulated run and the limit it sets (samples)."""

    def __init__(self, *, admission: str, alpha: int, batch_size: int, min_lookahead: float = 1.0,
                 start: float = 0.0) -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"admission={admission!r}: must be one of {', '.join(ADMISSIONS)}")
        if not 0.0 <= min_lookahead <= max(alpha, 1):
            raise ValueError(f"min_lookahead={min_lookahead}: must be in [0, max(alpha, 1)]")
        self.admission, self.alpha, self.batch_size, self.min_lookahead = admission, alpha, batch_size, min_lookahead
        if admission == "eager":
            self.lookahead: float = alpha
        elif admission == "tokens":
            self.lookahead = min(max(1.0, min_lookahead), float(alpha))
        else:
            self.lookahead = lookahead_floor(alpha)
        self.waits = 0  # adaptive: takes in a row that waited, since the lookahead last rose
        self.last_take: float | None = None
        self.idle_since: float | None = start  # nothing in flight since then (None: something is)
        self.idle_s = 0.0  # closed stretches of nothing in flight since the last take
        self.previous = (0.0, 0.0)  # tokens: (idle, period) of the step before the last take

    def limit(self, version: int) -> int:
        """Samples the rollout may have admitted in all at `version`, not counting dropped ones: the
        product's capacity() with nothing consumed or outstanding."""
        return (version + 1) * self.batch_size + math.floor(self.lookahead * self.batch_size + 1e-9)

    def on_admit(self, *, now: float) -> None:
        if self.idle_since is not None:
            self.idle_s += max(0.0, now - self.idle_since)
            self.idle_since = None

    def on_landed(self, *, now: float, in_flight: int) -> None:
        """A group left flight (buffered, dropped or cancelled); `in_flight` groups are still generating."""
        if not in_flight and self.idle_since is None:
            self.idle_since = now

    def note_take(self, *, waited_s: float, surplus: int, now: float, late: float = 0.0) -> None:
        """The trainer took a batch at `now` after waiting `waited_s` for rollout, leaving `surplus`
        finished samples buffered; `late` = the batch's `late_share`."""
        idle = self.idle_s + (now - self.idle_since if self.idle_since is not None else 0.0)
        self.idle_s = 0.0
        if self.idle_since is not None:
            self.idle_since = now
        if self.last_take is not None:
            period = now - self.last_take
            did_wait = waited(waited_s, period)
            if self.admission == "adaptive":
                self.waits = self.waits + 1 if did_wait else 0
                before = self.lookahead
                self.lookahead = next_lookahead(int(before), alpha=self.alpha, waits_in_a_row=self.waits,
                                                surplus=surplus, batch_size=self.batch_size)
                if self.lookahead > before:
                    self.waits = 0
            elif self.admission == "tokens":
                # this step and the one before: idle engines show a step before the wait they cause
                self.waits = self.waits + 1 if did_wait else 0
                starved = waited(idle + self.previous[0], period + self.previous[1])
                before = self.lookahead
                self.lookahead = next_token_lookahead(before, alpha=self.alpha, waits_in_a_row=self.waits, late=late,
                                                      starved=starved, floor=self.min_lookahead)
                if self.lookahead > max(before, 1.0):
                    self.waits = 0
            self.previous = (idle, period)
        self.last_take = now
