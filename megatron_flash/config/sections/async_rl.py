"""Rollout–train asynchrony (`async_rl`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_flash.config.sections.base import _Section

STALE_POLICIES = ("drop", "regenerate")
ADMISSIONS = ("tokens", "adaptive", "eager")
"""The admission rules (async_rl.admission), defined here only; buffer/staleness.py implements them."""


@dataclass
class AsyncConfig(_Section):
    _section: ClassVar[str] = "async_rl"

    alpha: int = 2
    """Asynchronous ratio: max policy versions a sample may lag (trained at V+1 only if its
    generation started at v with V − v <= alpha); 0 = synchronous."""
    stale_policy: str = "drop"
    """What happens to a sample that exceeds alpha: drop | regenerate (re-queue its prompt)."""
    admission: str = "tokens"
    """How far ahead of training rollout starts samples: tokens (the default: a fraction of a batch
    ahead, moved by the trainer's waits and the share of the batch's tokens that came late; above one
    batch only after two waits running with the engines also left with nothing admitted: no staleness
    that buys no speed; as fast as adaptive or faster and learning alike in paired runs,
    docs/benchmarks.md) | adaptive (whole batches, one ahead, more — up to alpha — while the trainer
    keeps waiting; fewer again once a whole batch sits finished) | eager (always alpha batches ahead).
    The metrics rollout_lookahead and admission/* show the choice; buffer/staleness.py "Lookahead" and
    "Token lookahead" the rules."""
    min_lookahead: float = 1.0
    """admission=tokens only: the least lookahead, in batches (≤ alpha). 1 keeps the next batch generated
    while this one trains; below 1 part of it starts only after the push — fresher tokens, paid for by
    the trainer's wait for them (the rule rises again when the wait passes 5 % of the step)."""
    batch_timeout_s: float = 600.0
    """The trainer stops with an error (after saving what it can) when no full batch arrives for
    this long."""

    def validate(self) -> None:
        self._at_least("alpha", 0)
        self._one_of("stale_policy", STALE_POLICIES)
        self._one_of("admission", ADMISSIONS)
        if self.alpha == 0 and self.admission == "eager":
            raise ValueError(f"async_rl.admission={self.admission!r} needs async_rl.alpha >= 1 (at alpha=0 rollout "
                             "never runs ahead, so there is nothing to admit early)")
        self._at_least("min_lookahead", 0.0)
        self._require(self.admission == "tokens" or self.min_lookahead == 1.0, "min_lookahead",
                      f"is used only with async_rl.admission=tokens (got admission={self.admission!r})")
        self._require(self.min_lookahead <= max(self.alpha, 1), "min_lookahead",
                      f"must be <= async_rl.alpha ({self.alpha})")
        self._positive("batch_timeout_s")
