"""Admission in the planner: how many batches ahead of training the rollout may start groups.

The product's rule (buffer/staleness.py, "Lookahead"), copied because the planner imports nothing else
of megatron_flash; tests/unit/test_planner_admission.py drives both through the same takes and
checks they agree. The simulation asks one `Admission` object two things, so that a new rule replaces
this module and nothing in simulation.py:

    limit(version)   samples that may have been admitted in all: (V + L + 1) · B (L = α: eager)
    note_take(...)   after each batch the trainer takes (its wait, the finished samples left buffered)

The lookahead L starts at the floor min(1, α) (adaptive) or at α (eager); after each take but the first
(which only starts the take-to-take clock):

    the trainer waited for rollout longer than WAIT_TOLERANCE of the take-to-take period,
    RAISE_AFTER takes in a row                                             →  L + 1  (up to α)
    a whole batch of finished samples was still buffered after the take   →  L − 1  (down to the floor)

Worked example (α = 2, B = 1, RAISE_AFTER = 2): takes at 1.0, 1.2, 2.2, 3.4 s after waits of 1.0,
0.0, 0.8, 1.0 s, nothing left buffered: the first starts the clock; 1.2 did not wait; 2.2 waited 0.8
of a 1.0 s period (one in a row, L stays 1); 3.4 waited 1.0 of 1.2 s (two in a row) → L = 2.
"""

from __future__ import annotations

ADMISSIONS = ("adaptive", "eager")
WAIT_TOLERANCE = 0.05
"""A trainer wait up to this share of the take-to-take period is noise, not a rollout bottleneck."""
RAISE_AFTER = 2
"""Takes in a row that waited past WAIT_TOLERANCE before the lookahead grows (one is a blip)."""


def lookahead_floor(alpha: int) -> int:
    """The least lookahead that still overlaps generation with training (0 only when α = 0)."""
    return min(1, alpha)


def waited(waited_s: float, period_s: float) -> bool:
    """Did the trainer wait for rollout past the tolerance in a take-to-take period of `period_s`?"""
    return period_s > 0 and waited_s > WAIT_TOLERANCE * period_s


def next_lookahead(lookahead: int, *, alpha: int, waits_in_a_row: int, surplus: int, batch_size: int) -> int:
    """The lookahead after a take that ended `waits_in_a_row` waiting takes (0: this one did not wait)
    and left `surplus` finished samples buffered."""
    if waits_in_a_row >= RAISE_AFTER:
        return min(lookahead + 1, alpha)
    if surplus >= batch_size:
        return max(lookahead - 1, lookahead_floor(alpha))
    return lookahead


class Admission:
    """The admission lookahead L (in batches) of one simulated run and the limit it sets (in samples)."""

    def __init__(self, *, admission: str, alpha: int, batch_size: int) -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"admission={admission!r}: must be one of {', '.join(ADMISSIONS)}")
        self.admission, self.alpha, self.batch_size = admission, alpha, batch_size
        self.lookahead = alpha if admission == "eager" else lookahead_floor(alpha)
        self.waits = 0  # takes in a row that waited, since the lookahead last rose
        self.last_take: float | None = None

    def limit(self, version: int) -> int:
        """Samples the rollout may have admitted in all at `version`, not counting dropped ones: the
        product's capacity() with nothing consumed or outstanding."""
        return (version + self.lookahead + 1) * self.batch_size

    def note_take(self, *, waited_s: float, surplus: int, now: float) -> None:
        """The trainer took a batch at `now` after waiting `waited_s` for rollout, leaving `surplus`
        finished samples buffered."""
        if self.admission == "adaptive" and self.last_take is not None:
            self.waits = self.waits + 1 if waited(waited_s, now - self.last_take) else 0
            before = self.lookahead
            self.lookahead = next_lookahead(before, alpha=self.alpha, waits_in_a_row=self.waits, surplus=surplus,
                                            batch_size=self.batch_size)
            if self.lookahead > before:
                self.waits = 0
        self.last_take = now
