"""Staleness arithmetic of the asynchronous ratio α, in one small pure place.

Definitions (ROLL Flash; ../shared/DESIGN.md):
    version V      the policy version = number of weight pushes so far. Train step k runs at
                   version V = k and its weight push produces version k + 1.
    start v        the version at which a sample's generation started (its oldest token).
    staleness      V − v at the step that trains the sample. Trainable iff V − v <= α.
    B              samples per train step (one rollout batch).

Admission control. The rollout side may have at most

    capacity(V) = (V + α + 1) · B + extra − consumed − outstanding

more samples started, where `consumed` counts samples the trainer has taken and `outstanding`
counts samples started and not yet consumed or dropped (in flight + buffered). In steady state
(the trainer has consumed V·B, nothing dropped) this is the familiar bound
"in flight + buffered <= (α + 1) · B": every sample started at version V is consumed by step
V + α at the latest, so nothing is generated only to be thrown away. `extra` (redundant prompts,
in samples) deliberately over-admits; the surplus may turn stale and is then dropped or
regenerated — and counted.

Worked example, B = 4, α = 1, extra = 0:

    event                                 V  consumed  outstanding  capacity
    start                                 0      0          0       (0+2)·4 − 0 − 0 = 8   → start 8
    trainer takes batch 0 (4 samples)     0      4          4       8 − 4 − 4 = 0
    push → V = 1                          1      4          4       12 − 4 − 4 = 4        → start 4
    trainer takes batch 1 (4, v=0)        1      8          4       12 − 8 − 4 = 0        (1 − 0 <= α ✓)
    push → V = 2                          2      8          4       16 − 8 − 4 = 4

With α = 0 the same table gives capacity 4 after each push and 0 in between: synchronous training.

Expiry. Samples started at v must be trained by step v + α. Because at most (v + α + 1)·B were
admitted up to version v and the trainer has consumed (v + α)·B before step v + α, the samples
still in flight or buffered with start <= V − α number at most B: step V can always take all of
them. So the trainer waits (only) for in-flight samples that would expire after this step and
puts them first in the batch; newer samples fill the rest. With no redundant prompts nothing is
then ever dropped as stale, whatever the latency tail.

Eviction. At step V a buffered sample with V − v > α can never be trained again (V only grows):
it is evicted (dropped or regenerated, config `async_rl.stale_policy`). Only over-admission
(`extra`) or a resume makes that happen.

Lookahead (`async_rl.admission=adaptive`). α bounds staleness; it is not a target. Admitting up to
(V + α + 1)·B means a rollout faster than training generates every sample as early as the bound
allows: it then waits finished in the buffer for α steps, as stale as allowed and for no speed
(the trainer was never waiting). Adaptive admission admits up to (V + L + 1)·B with a lookahead L in
[min(1, α), α] (L = α is `eager`), moved by one after each batch the trainer takes:

    the trainer waited for rollout longer than WAIT_TOLERANCE of the step,
    RAISE_AFTER takes in a row                                               →  L + 1  (up to α)
    a whole batch of finished samples was still buffered after the take     →  L − 1  (down to 1)

L = 1 still overlaps all generation with training (the next batch is generated while this one
trains); larger L only buys speed when rollout is the bottleneck (a long latency tail), and then the
trainer waits step after step and L rises. A single short wait — rollout and training nearly
balanced, one slow reply — is not worth α − 1 more versions of staleness on every sample after it. Worked example, B = 4, α = 2, a rollout that finishes every admitted sample
at once:

    event                                 V  consumed  outstanding  L  limit (V+L+1)·B
    start                                 0      0          0       1   8   → start 8 (v = 0)
    take batch 0 (waited: first take)     0      4          4       1       (first take: L kept)
    push → V = 1                          1      4          4       1  12   → start 4 (v = 1)
    take batch 1 (v = 0), 4 left buffered 1      8          4       1       (≥ B, but L is at 1)
    push → V = 2                          2      8          4       1  16   → start 4 (v = 2)

every sample trains one version after it started; eager admission (L = 2) would have started 12 at
v = 0 and trained every later sample two versions after its start, at the same speed.

Token lookahead (`async_rl.admission=tokens`, the default since 2026-12-03). What the losses
correct for is the age of each token's weights, not of its sample's start: a token sampled before
the push that ends step V trains at V + 1 or later, one sampled after it trains fresh. Whole-batch steps of L are coarse
for that: when the trainer waits because the engines are slow (busy all along), adaptive
admission still climbs to L = 2, starts a second batch early, and those tokens, finished fast, sit
through two pushes — staleness that buys little speed, since the engines had no idle time to fill
(docs/benchmarks.md, "Token-staleness admission"). The
tokens rule keeps L a fraction of a batch (admission takes ⌊L·B⌋ samples of the batches ahead) and
reads, at each take, how long the trainer waited, the share of the batch's response tokens that
landed during that wait (`late_share`) and whether the engines sat with nothing in flight in this
step or the one before (idle engines show one step before the wait they cause):

    the trainer did not wait past WAIT_TOLERANCE of the step        →  L − STEP_DOWN  (down to min_lookahead)
    it waited, L < 1 (part of the batch started only at the push)   →  L + late share  (up to 1)
    RAISE_AFTER waits in a row, L ≥ 1, the engines ran dry past
    the tolerance                                                    →  L + late share  (up to α)
    else (the engines were busy all along, or a single wait)        →  L               (more adds only staleness)

`min_lookahead` (`async_rl.min_lookahead`, default 1) is the floor: at 1 the next batch always
generates while this one trains (no wait is traded for freshness); below 1 L probes down until the
trainer waits for the part of the batch that started after the push — fresher tokens for that wait.
Worked example, B = 4 in groups of 2, α = 2, min_lookahead 0, the engines finish what they have:

    time  event                                    V  consumed  outstanding  L      limit (V+1)·B + ⌊L·B⌋
    0.0   start                                    0      0          0       1      4 + 4 = 8  → start 8 (v = 0)
    1.0   all landed; take batch 0                 0      4          4       1      (first take: the clock starts)
    2.0   push → V = 1, at once take 1, no wait    1      8          0       0.875  8 + 3 = 11 → start 2 (v = 1)
    2.5   that group lands; the engines sit idle
    3.0   push → V = 2                             2      8          2       0.875  12 + 3 = 15 → start 4 (v = 2)
    3.4   take batch 2 after 0.4 s (> 5 % of 1.4 s), half its tokens landed in the wait
                                                   2     12          2       1      0.875 + 0.5, at most 1

batch 2's second group sampled its tokens at version 2 and trains at 2: fresh, for a 0.4 s wait;
the engines' idle 0.5 s (2.5 → 3.0) is `admission/starved_s`. With the default min_lookahead 1 the
second row keeps L = 1 and the next batch starts whole, as with adaptive admission; the two differ
when the trainer waits on busy engines, where tokens holds L while adaptive climbs.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Callable, Optional, Sequence

from megatron_flash.config.sections.async_rl import ADMISSIONS


def staleness(version: int, version_start: int) -> int:
    """How many pushes behind the current policy a sample started."""
    return version - version_start


def is_trainable(version: int, version_start: int, alpha: int) -> bool:
    """May the step at `version` (producing version + 1) train a sample started at `version_start`?"""
    return 0 <= version - version_start <= alpha


def capacity(*, version: int, alpha: float, batch_size: int, extra: int, consumed: int, outstanding: int) -> int:
    """Samples the rollout side may start now (negative = over-admitted, e.g. after drops). `alpha`
    is the admission lookahead in batches: α itself for eager admission, a fraction with `tokens`
    (whole samples only: ⌊lookahead · B⌋ of the batches ahead)."""
    ahead = math.floor(alpha * batch_size + 1e-9)
    return (version + 1) * batch_size + ahead + extra - consumed - outstanding


WAIT_TOLERANCE = 0.05
"""A trainer wait for rollout up to this share of the step is noise (a reply in flight, the GIL), not
a rollout bottleneck that more lookahead would hide."""
RAISE_AFTER = 2
"""Takes in a row that waited past WAIT_TOLERANCE before the lookahead grows (one is a blip)."""


def lookahead_floor(alpha: int) -> int:
    """The least lookahead that still overlaps generation with training (0 only when α = 0)."""
    return min(1, alpha)


def waited(waited_s: float, period_s: float) -> bool:
    """Did the trainer wait for rollout past the tolerance in a step of `period_s` (take to take)?"""
    return period_s > 0 and waited_s > WAIT_TOLERANCE * period_s


def next_lookahead(lookahead: int, *, alpha: int, waits_in_a_row: int, surplus: int, batch_size: int) -> int:
    """The lookahead after a take that ended `waits_in_a_row` takes that waited (0: this one did not)
    and left `surplus` finished samples buffered (see "Lookahead" above)."""
    if waits_in_a_row >= RAISE_AFTER:
        return min(lookahead + 1, alpha)
    if surplus >= batch_size:
        return max(lookahead - 1, lookahead_floor(alpha))
    return lookahead


STEP_DOWN = 0.125
"""`tokens` admission: after a take that did not wait, the lookahead falls by this share of a batch
(two groups of the quickstart's sixteen), so it creeps back toward the least that keeps the trainer fed."""


def late_share(*, tokens: Sequence[int], arrived: Sequence[float], since: float) -> float:
    """The share of a batch's response tokens in groups that reached the buffer after `since` (the
    moment the trainer began to wait): what came too late. `tokens[i]`, `arrived[i]`: group i."""
    total = sum(tokens)
    return sum(t for t, a in zip(tokens, arrived) if a > since) / total if total else 0.0


def next_token_lookahead(lookahead: float, *, alpha: int, waits_in_a_row: int, late: float, starved: bool,
                         floor: float = 1.0) -> float:
    """The `tokens` lookahead (batches, a fraction) after a take (see "Token lookahead" above) that
    ended `waits_in_a_row` takes waiting past the tolerance (0: this one did not), `late` = its
    `late_share`, `starved` = the engines sat with nothing admitted past the tolerance in this step
    or the one before; never below `floor` (`async_rl.min_lookahead`, at most α)."""
    if not waits_in_a_row:
        return max(lookahead - STEP_DOWN, min(floor, float(alpha)))
    if lookahead < 1:  # the rest of the batch started only at the push: that is what the trainer waited for
        return min(lookahead + late, 1.0, float(alpha))
    if starved and waits_in_a_row >= RAISE_AFTER:  # a batch ahead, and still the engines ran dry
        return min(lookahead + late, float(alpha))
    # The engines were busy all along (more lookahead would only add staleness), or one wait: a blip
    # (an engine faster than the trainer always idles, so one slow reply must not raise L).
    return lookahead


class Lookahead:
    """The admission lookahead L (batches; a fraction with `tokens`) and the rule that moves it after
    each take ("Lookahead" and "Token lookahead" above). No lock and no clock: every event carries its
    time, so the product (StalenessManager, under its lock, with time.monotonic()) and the planner's
    simulation (its own clock) run this very code."""

    def __init__(self, *, admission: str, alpha: int, batch_size: int, min_lookahead: float = 1.0,
                 start: float = 0.0) -> None:
        self.admission, self.alpha, self.batch_size, self.min_lookahead = admission, alpha, batch_size, min_lookahead
        if admission == "eager":
            self.value: float = alpha
        elif admission == "tokens":
            self.value = min(max(1.0, min_lookahead), float(alpha))
        else:
            self.value = lookahead_floor(alpha)
        self.waits = 0  # takes in a row that waited for rollout (since the lookahead last rose)
        self.last_take: float | None = None  # when the trainer's previous batch was handed out
        self.idle_since: float | None = start  # nothing in flight since then (None: the engines have work)
        self.idle_s = 0.0  # engine time with nothing admitted since the last take (closed stretches)
        self.previous = (0.0, 0.0)  # (idle, period) seconds of the step before the last take

    def busy(self, now: float) -> None:
        """Something was admitted: the engines have work again."""
        if self.idle_since is not None:
            self.idle_s += max(0.0, now - self.idle_since)
            self.idle_since = None

    def idle(self, now: float) -> None:
        """The last group in flight landed: the engines have nothing admitted."""
        if self.idle_since is None:
            self.idle_since = now

    def take(self, *, waited_s: float, surplus: int, now: float, late: float = 0.0) -> float:
        """The trainer took a batch at `now` after waiting `waited_s`, leaving `surplus` finished samples
        buffered; `late` = its `late_share`. Moves L (the first take, with no step before it to compare
        against, only starts the clock); returns the seconds the engines sat with nothing admitted since
        the previous take (`admission/starved_s`)."""
        idle = self.idle_s + (now - self.idle_since if self.idle_since is not None else 0.0)
        self.idle_s = 0.0
        if self.idle_since is not None:
            self.idle_since = now
        if self.last_take is not None:
            period = now - self.last_take
            did_wait = waited(waited_s, period)
            if self.admission == "adaptive":
                self.waits = self.waits + 1 if did_wait else 0
                before = self.value
                self.value = next_lookahead(int(before), alpha=self.alpha, waits_in_a_row=self.waits,
                                            surplus=surplus, batch_size=self.batch_size)
                if self.value > before:
                    self.waits = 0
            elif self.admission == "tokens":
                self.waits = self.waits + 1 if did_wait else 0
                # This step and the one before: idle engines show a step before the wait they cause.
                starved = waited(idle + self.previous[0], period + self.previous[1])
                before = self.value
                self.value = next_token_lookahead(before, alpha=self.alpha, waits_in_a_row=self.waits, late=late,
                                                  starved=starved, floor=self.min_lookahead)
                if self.value > max(before, 1.0):
                    self.waits = 0
            self.previous = (idle, period)
        self.last_take = now
        return idle


@dataclasses.dataclass
class StalenessCounters:
    submitted: int = 0
    consumed: int = 0
    outstanding: int = 0
    dropped_stale: int = 0
    regenerated_stale: int = 0
    dropped_filtered: int = 0
    dropped_failed: int = 0
    dropped_error: int = 0
    cancelled: int = 0
    skipped: int = 0
    """Samples of prompts an engine refused (HTTP 4xx), never retried."""
    lookahead: float = 0
    """Not a count: the admission lookahead L (batches; a fraction with `tokens`) when the counters were read."""
    late_share: float = 0.0
    """Not a count: `late_share` of the last batch taken (0 when the trainer did not wait)."""
    starved_s: float = 0.0
    """Not a count: seconds the engines had nothing admitted (nothing in flight) between the last two takes."""
    sit_s: float = 0.0
    """Not a count: mean seconds the last batch's samples sat finished in the buffer before the take."""


class StalenessManager:
    """Thread-safe counters + the capacity rule. The rollout thread asks `try_admit`; the trainer
    thread reports `on_consume`; anyone reports drops. Counts are in samples."""

    def __init__(self, *, alpha: int, batch_size: int, extra: int = 0, admission: str = "eager",
                 min_lookahead: float = 1.0) -> None:
        if alpha < 0 or batch_size < 1 or extra < 0 or min_lookahead < 0:
            raise ValueError(f"need alpha >= 0, batch_size >= 1, extra >= 0, min_lookahead >= 0; got {alpha}, "
                             f"{batch_size}, {extra}, {min_lookahead}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}; got {admission!r}")
        self.alpha, self.batch_size, self.extra, self.admission = alpha, batch_size, extra, admission
        self.min_lookahead = min_lookahead
        self.counters = StalenessCounters()
        self._lock = threading.Lock()
        self._version = 0
        self._rule = self._new_rule()
        self._in_flight: dict[int, int] = {}  # start version → samples admitted, not yet landed
        self._take = (0.0, 0.0, 0.0)  # the last take's late share, starved seconds, sit seconds
        self._drop_lengths: dict[str, list[int]] = {}
        self.observer: Optional[Callable[[str, int], None]] = None
        """Told ("admit" or "drop {reason}", samples) of every admission and drop, outside the lock (the
        run's trace shows them)."""

    def _new_rule(self) -> Lookahead:
        return Lookahead(admission=self.admission, alpha=self.alpha, batch_size=self.batch_size,
                         min_lookahead=self.min_lookahead, start=time.monotonic())

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        with self._lock:
            if version < self._version:
                raise AssertionError(f"policy version went backwards: {self._version} → {version}")
            self._version = version

    @property
    def lookahead(self) -> float:
        return self._rule.value

    def capacity(self) -> int:
        c = self.counters
        return capacity(version=self._version, alpha=self._rule.value, batch_size=self.batch_size, extra=self.extra,
                        consumed=c.consumed, outstanding=c.outstanding)

    def note_take(self, *, waited_s: float, surplus: int, now: float, late: float = 0.0, sit_s: float = 0.0) -> None:
        """The trainer took a batch after waiting `waited_s`, leaving `surplus` finished samples
        buffered; `late` = its `late_share`, `sit_s` = how long its samples sat finished (mean):
        adaptive and tokens admission move the lookahead (the first take, with no step before it to
        compare against, only starts the clock)."""
        with self._lock:
            idle = self._rule.take(waited_s=waited_s, surplus=surplus, now=now, late=late)
            self._take = (late, idle, sit_s)

    def try_admit(self, num_samples: int, *, now: float | None = None) -> int | None:
        """Admit `num_samples` (one group) if capacity allows; returns the start version, else None.
        Version read and admission happen under one lock, so a push cannot slip in between."""
        with self._lock:
            if self.capacity() < num_samples:
                return None
            self.counters.submitted += num_samples
            self.counters.outstanding += num_samples
            self._in_flight[self._version] = self._in_flight.get(self._version, 0) + num_samples
            self._rule.busy(now if now is not None else time.monotonic())
            version = self._version
        if self.observer is not None:
            self.observer("admit", num_samples)
        return version

    def on_landed(self, version_start: int, num_samples: int, *, now: float | None = None) -> None:
        """A group admitted at `version_start` left flight (buffered, filtered, failed, ...)."""
        with self._lock:
            left = self._in_flight.get(version_start, 0) - num_samples
            assert left >= 0, (version_start, num_samples, self._in_flight)
            if left:
                self._in_flight[version_start] = left
            else:
                self._in_flight.pop(version_start, None)
            if not self._in_flight:
                self._rule.idle(now if now is not None else time.monotonic())

    def in_flight_through(self, version: int) -> int:
        """Samples still being generated whose start version is <= `version`."""
        with self._lock:
            return sum(n for v, n in self._in_flight.items() if v <= version)

    def on_consume(self, num_samples: int) -> None:
        with self._lock:
            self.counters.consumed += num_samples
            self.counters.outstanding -= num_samples
            assert self.counters.outstanding >= 0, self.counters

    def on_drop(self, num_samples: int, *, reason: str, lengths: Sequence[int] = ()) -> None:
        """reason: stale | regenerated (stale, prompt re-queued) | filtered (no learning signal) |
        failed (a reward raised) | error (engines failed the request; prompt re-queued) |
        cancelled (in flight when the run stopped) | skipped (an engine refused the prompt). `lengths`: the dropped responses' lengths, when
        they finished (kept for `take_drop_lengths`)."""
        field = {"stale": "dropped_stale", "regenerated": "regenerated_stale", "filtered": "dropped_filtered",
                 "failed": "dropped_failed", "error": "dropped_error", "cancelled": "cancelled",
                 "skipped": "skipped"}[reason]
        with self._lock:
            self.counters.outstanding -= num_samples
            setattr(self.counters, field, getattr(self.counters, field) + num_samples)
            assert self.counters.outstanding >= 0, self.counters
            if lengths:
                key = "stale" if reason in ("stale", "regenerated") else reason
                self._drop_lengths.setdefault(key, []).extend(lengths)
        if self.observer is not None:
            self.observer(f"drop {reason}", num_samples)

    def snapshot(self) -> StalenessCounters:
        """A consistent copy of the counters (the rollout thread updates them in pairs, under the lock)."""
        with self._lock:
            late, starved_s, sit_s = self._take
            return dataclasses.replace(self.counters, lookahead=self._rule.value, late_share=late,
                                       starved_s=starved_s, sit_s=sit_s)

    def take_drop_lengths(self) -> dict[str, list[int]]:
        """Response lengths of finished samples dropped since the last call, by reason (stale covers
        regenerated): what staleness and filtering took away, to compare with what trained."""
        with self._lock:
            out, self._drop_lengths = self._drop_lengths, {}
        return out

    def restore(self, *, version: int, consumed: int) -> None:
        """Resume: the trainer had consumed `consumed` samples at `version`; nothing is in flight."""
        with self._lock:
            self._version = version
            self._in_flight = {}
            self.counters = StalenessCounters(consumed=consumed, submitted=consumed)
            self._rule = self._new_rule()
