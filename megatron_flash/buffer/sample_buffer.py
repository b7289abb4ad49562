"""The versioned sample buffer between the rollout side (producer) and the trainer (consumer).

The rollout thread `put`s finished, rewarded, filtered groups; the trainer thread blocks in
`take_batch` until enough *trainable* samples exist for the step at the current version, and —
without redundant prompts — until no sample that would expire after this step is still in flight
(see "Expiry" in staleness.py). With redundant prompts (`extra` > 0) a full batch goes at once and
the rollout side cancels what expired (scheduler.py).
Groups that became too stale are evicted on the way and handed to `on_evict` (the scheduler
re-queues their prompt when `async_rl.stale_policy=regenerate`). Oldest groups go first, which
keeps staleness low and makes α = 0 take exactly the groups started at the current version.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from megatron_flash.buffer.staleness import StalenessManager, is_trainable, late_share
from megatron_flash.trace import TRACER
from megatron_flash.types import Group


class BufferClosed(RuntimeError):
    """The rollout side stopped (its error, if any, is the cause) while the trainer waited."""


class SampleBuffer:
    def __init__(self, staleness: StalenessManager, *, stale_policy: str = "drop",
                 on_evict: Optional[Callable[[Group], None]] = None) -> None:
        if stale_policy not in ("drop", "regenerate"):
            raise ValueError(f"stale_policy must be drop|regenerate, got {stale_policy!r}")
        self.staleness = staleness
        self.stale_policy = stale_policy
        self.on_evict = on_evict
        self._groups: list[Group] = []
        self._arrived: dict[int, float] = {}  # id(group) → when it entered the buffer (monotonic)
        self._cond = threading.Condition()
        self._closed: Optional[BaseException] = None
        self._is_closed = False

    # ------------------------------------------------------------------ producer side
    def put(self, group: Group) -> None:
        with self._cond:
            self._groups.append(group)
            self._arrived[id(group)] = time.monotonic()
            self._cond.notify_all()
        TRACER.instant("put", "buffer", "buffer", group=group.group_id, prompt=group.prompt_index,
                       version_start=group.version_start, samples=len(group))

    def landed(self, version_start: int, num_samples: int) -> None:
        """A group admitted at `version_start` left flight, whatever became of it (buffered, filtered,
        failed, cancelled). Under the buffer's lock and with a wake-up: a trainer waiting for
        expiring in-flight samples re-checks at once (a filtered group never calls `put`)."""
        with self._cond:
            self.staleness.on_landed(version_start, num_samples)
            self._cond.notify_all()

    def close(self, error: Optional[BaseException] = None) -> None:
        """No more groups will come; a waiting trainer wakes with BufferClosed (chained to `error`)."""
        with self._cond:
            self._is_closed, self._closed = True, error
            self._cond.notify_all()

    def snapshot(self) -> list[Group]:
        """The buffered groups (for a checkpoint); the buffer keeps them."""
        with self._cond:
            return list(self._groups)

    def restore(self, groups: list[Group]) -> None:
        """Put checkpointed groups back (before the producer starts); they count as outstanding."""
        with self._cond:
            self._groups.extend(groups)
            self._arrived.update((id(g), time.monotonic()) for g in groups)
            self.staleness.counters.outstanding += sum(len(g) for g in groups)
            self.staleness.counters.submitted += sum(len(g) for g in groups)
            self._cond.notify_all()

    # ------------------------------------------------------------------ consumer side
    def __len__(self) -> int:
        with self._cond:
            return sum(len(g) for g in self._groups)

    def num_groups(self) -> int:
        with self._cond:
            return len(self._groups)

    def evict_stale(self) -> int:
        """Evict groups no step at or after the current version may train; returns samples evicted."""
        with self._cond:
            return self._evict_locked()

    def _evict_locked(self) -> int:
        version, alpha = self.staleness.version, self.staleness.alpha
        keep, evicted = [], []
        for g in self._groups:
            (keep if is_trainable(version, g.version_start, alpha) else evicted).append(g)
        self._groups = keep
        for g in evicted:
            self._arrived.pop(id(g), None)
            self.staleness.on_drop(len(g), reason="regenerated" if self.stale_policy == "regenerate" else "stale",
                                   lengths=[len(s.response_ids) for s in g.samples])
            if self.on_evict is not None:
                self.on_evict(g)
        return sum(len(g) for g in evicted)

    def take_batch(self, num_samples: int, *, timeout_s: Optional[float] = None,
                   poll_s: float = 0.5, wake: Optional[Callable[[], bool]] = None) -> Optional[list[Group]]:
        """Block until whole groups totalling exactly `num_samples` trainable samples are buffered
        and nothing expiring after this step is in flight; remove and return them (oldest start
        version first). Raises TimeoutError after `timeout_s`, BufferClosed if the producer stopped.
        Returns None, taking nothing, when `wake()` (asked every `poll_s` while waiting) is true: the
        trainer has something to do first (send restarted engines its weights, which this batch may need)."""
        entered = time.monotonic()
        deadline = None if timeout_s is None else entered + timeout_s
        with self._cond:
            while True:
                self._evict_locked()
                expiring = self.staleness.version - self.staleness.alpha
                # Without redundant prompts the in-flight samples that expire after this step belong
                # in this batch (at most B of them exist: staleness.py "Expiry"), so wait for them.
                # With redundant prompts they may be surplus: a full batch of buffered samples goes
                # now, and the rollout side cancels the expired ones after the push.
                waiting_for_old = self.staleness.extra == 0 and self.staleness.in_flight_through(expiring) > 0
                picked = None if waiting_for_old else self._pick(num_samples)
                if picked is not None:
                    chosen = set(map(id, picked))
                    self._groups = [g for g in self._groups if id(g) not in chosen]
                    self.staleness.on_consume(num_samples)
                    now = time.monotonic()
                    # Arrival, not time_finished: a group finished before the wait but put after it
                    # began (the rollout thread descheduled in between) still kept the trainer waiting.
                    tokens = [sum(len(s.response_ids) for s in g.samples) for g in picked]
                    arrived = [self._arrived.pop(id(g), now) for g in picked]
                    sit = sum(max(0.0, now - g.time_finished) * len(g) for g in picked) / num_samples
                    self.staleness.note_take(waited_s=now - entered, now=now,
                                             surplus=sum(len(g) for g in self._groups),
                                             late=late_share(tokens=tokens, arrived=arrived, since=entered),
                                             sit_s=sit)
                    TRACER.instant("take", "buffer", "buffer", samples=num_samples, groups=len(picked),
                                   left=sum(len(g) for g in self._groups))
                    return picked
                if self._is_closed:
                    raise BufferClosed("the rollout side stopped before a full batch was ready") from self._closed
                if wake is not None and wake():
                    return None
                wait = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
                if wait <= 0:
                    have = sum(len(g) for g in self._groups)
                    raise TimeoutError(f"no batch of {num_samples} samples within {timeout_s:.0f} s "
                                       f"({have} buffered)")
                self._cond.wait(wait)

    def _pick(self, num_samples: int) -> Optional[list[Group]]:
        order = sorted(self._groups, key=lambda g: (g.version_start, g.time_finished))
        picked, total = [], 0
        for g in order:
            if total + len(g) <= num_samples:
                picked.append(g)
                total += len(g)
            if total == num_samples:
                return picked
        return None
