"""The LLMProxy's engine slots: each engine's in-flight count, the one FIFO queue of requests waiting
for a slot, who gets a slot that frees, and the busy/idle time accounting over all of it.

Each engine holds at most ``max_inflight_per_engine`` request slots; a request of n samples holds
min(n, max) of one engine's. A request that finds no engine with enough free slots (or finds others
already waiting, or the proxy paused) waits in the queue, and the moment slots free (a request ends,
an engine is re-admitted, generation continues after a pause) the oldest waiter is handed them
directly, so a later arrival never overtakes it. Among engines with enough free slots the one with
the fewest in flight wins; ties rotate. Health is the proxy's: it flips ``EngineState.healthy``
(after ``tick()``) and calls ``dispatch()`` when an engine comes back. Nothing here does I/O.

Metrics, over the window since construction or ``reset_metrics()``, per engine:
    busy_fraction      share of the window with >= 1 request of ours in flight on the engine
    idle_fraction      1 - busy_fraction: zero requests in flight (whatever the queue held,
                       healthy or not)
    idle_while_queued_fraction  share of the window the engine was healthy, not paused, with zero
                       in flight while requests waited in the queue. Queue scheduling keeps this ~0;
                       anything larger is dispatch latency or a bug.
plus in-flight now, the most ever in flight, completed requests, failures (requests or control
calls that failed on it) and health.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Set, Tuple

from megatron_flash.engines.client import EngineClient


@dataclass
class EngineMetrics:
    url: str
    healthy: bool
    unhealthy_reason: str
    inflight: int
    max_inflight: int
    completed: int
    failures: int
    busy_fraction: float
    idle_fraction: float
    idle_while_queued_fraction: float


@dataclass
class ProxyMetrics:
    engines: List[EngineMetrics]
    queue_len: int
    completed: int
    retried: int
    aborted: int
    window_s: float
    reissued: int = 0
    """Requests taken off an engine that left the fleet and sent to another (same rid)."""

    def as_dict(self, prefix: str = "proxy") -> Dict[str, float]:
        """Flat scalars for a logger: proxy/queue_len, proxy/engine0/busy_fraction, ..."""
        out = {f"{prefix}/queue_len": self.queue_len, f"{prefix}/completed": self.completed,
               f"{prefix}/retried": self.retried, f"{prefix}/aborted": self.aborted,
               f"{prefix}/reissued": self.reissued}
        for i, e in enumerate(self.engines):
            for name in ("inflight", "max_inflight", "completed", "failures", "busy_fraction",
                         "idle_fraction", "idle_while_queued_fraction"):
                out[f"{prefix}/engine{i}/{name}"] = float(getattr(e, name))
            out[f"{prefix}/engine{i}/healthy"] = float(e.healthy)
        return out


@dataclass
class EngineState:
    """One engine as the proxy sees it: its client, health, slots in use, the rids it serves, counters."""
    client: EngineClient
    healthy: bool = True
    unhealthy_reason: str = ""
    inflight: int = 0
    max_inflight: int = 0
    completed: int = 0
    failures: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    idle_while_queued_s: float = 0.0
    rids: Set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Waiter:
    rid: str
    future: "asyncio.Future[Optional[EngineState]]"
    slots: int = 1


class EngineSlots:
    """Slots of ``clients``' engines and the FIFO queue for them; see the module docstring."""

    def __init__(self, clients: Sequence[EngineClient], *, max_inflight_per_engine: int) -> None:
        self.max_inflight_per_engine = max_inflight_per_engine
        self.engines = [EngineState(c) for c in clients]
        self.waiters: Deque[_Waiter] = collections.deque()
        self.queued: Dict[str, _Waiter] = {}
        self.paused = False
        """No slot is handed out while paused (the engines are paused by the proxy)."""
        self.min_engines = 1
        """No slot is handed out while fewer engines than this are healthy (engines.min_engines): the run
        waits for the fleet to grow back rather than pile its rollout on what is left."""
        self._rotation = itertools.count()
        self.reset_metrics()

    def _pick(self, slots: int = 1) -> Optional[EngineState]:
        if self.min_engines > 1 and sum(e.healthy for e in self.engines) < self.min_engines:
            return None
        free = [e for e in self.engines if e.healthy and e.inflight + slots <= self.max_inflight_per_engine]
        if not free:
            return None
        least = min(e.inflight for e in free)
        ties = [e for e in free if e.inflight == least]
        return ties[next(self._rotation) % len(ties)]

    def _take(self, engine: EngineState, slots: int = 1) -> None:
        self.tick()
        engine.inflight += slots
        engine.max_inflight = max(engine.max_inflight, engine.inflight)

    async def acquire(self, rid: str, slots: int = 1) -> Optional[EngineState]:
        """``slots`` slots on one engine, or None when the request was withdrawn while it waited."""
        if not self.waiters and not self.paused:
            engine = self._pick(slots)
            if engine is not None:
                self._take(engine, slots)
                return engine
        waiter = _Waiter(rid, asyncio.get_running_loop().create_future(), slots)
        self.tick()
        self.waiters.append(waiter)
        self.queued[rid] = waiter
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.result():
                self.release(waiter.future.result(), failed=False, count=False, slots=slots)
            elif waiter in self.waiters:
                self.tick()
                self.waiters.remove(waiter)
            raise
        finally:
            self.queued.pop(rid, None)

    def release(self, engine: EngineState, *, failed: bool, count: bool = True, slots: int = 1,
                num_completed: int = 1) -> None:
        self.tick()
        engine.inflight -= slots
        assert engine.inflight >= 0, engine
        if count:
            if failed:
                engine.failures += 1
            else:
                engine.completed += num_completed
                self.num_completed += num_completed
        self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots to the oldest waiters (the heart of queue scheduling)."""
        while self.waiters and not self.paused:
            if self.waiters[0].future.done():  # cancelled by its caller
                self.queued.pop(self.waiters.popleft().rid, None)
                continue
            engine = self._pick(self.waiters[0].slots)
            if engine is None:
                return
            waiter = self.waiters.popleft()
            self.queued.pop(waiter.rid, None)
            self._take(engine, waiter.slots)
            waiter.future.set_result(engine)

    def withdraw(self, rid: str) -> bool:
        """Take `rid` out of the queue (its ``acquire`` returns None); False if it is not waiting."""
        waiter = self.queued.pop(rid, None)
        if waiter is None or waiter.future.done():
            return False
        self.tick()
        self.waiters.remove(waiter)
        waiter.future.set_result(None)
        return True

    def withdraw_all(self) -> None:
        """Empty the queue: every waiting ``acquire`` returns None."""
        self.tick()
        while self.waiters:
            waiter = self.waiters.popleft()
            self.queued.pop(waiter.rid, None)
            if not waiter.future.done():
                waiter.future.set_result(None)

    def add(self, client: EngineClient, *, healthy: bool) -> EngineState:
        """A new engine (it joined the fleet); its slots go to the waiters at once when healthy."""
        self.tick()
        engine = EngineState(client, healthy=healthy)
        self.engines.append(engine)
        self.dispatch()
        return engine

    def remove(self, engine: EngineState) -> None:
        """Out of the fleet: no slot of it is handed out again (its in-flight requests still release theirs)."""
        self.tick()
        self.engines.remove(engine)
        self.dispatch()  # min_engines may hold the queue now, or free engines take what waits

    def resume(self) -> None:
        """Hand out slots again after a pause."""
        self.tick()
        self.paused = False
        self.dispatch()

    # -- metrics --------------------------------------------------------------------------------
    def tick(self) -> None:
        """Account the time since the last state change to each engine's busy/idle counters.
        Called before every change of in-flight counts, queue length, health or pause."""
        now = time.monotonic()
        dt = now - self._last_tick
        self._last_tick = now
        queued = bool(self.waiters)
        for e in self.engines:
            if e.inflight > 0:
                e.busy_s += dt
            else:
                e.idle_s += dt
                if queued and e.healthy and not self.paused:
                    e.idle_while_queued_s += dt

    def reset_metrics(self) -> None:
        """Start a new metrics window (counts and time fractions; in-flight state is kept)."""
        self._window_start = self._last_tick = time.monotonic()
        self.num_completed = 0
        for e in self.engines:
            e.completed = e.failures = 0
            e.busy_s = e.idle_s = e.idle_while_queued_s = 0.0
            e.max_inflight = e.inflight

    def engine_metrics(self) -> Tuple[List[EngineMetrics], float]:
        """Each engine's metrics over the window, and the window's length in seconds."""
        self.tick()
        window = max(self._last_tick - self._window_start, 1e-9)
        return [EngineMetrics(url=e.client.url, healthy=e.healthy, unhealthy_reason=e.unhealthy_reason,
                              inflight=e.inflight, max_inflight=e.max_inflight, completed=e.completed,
                              failures=e.failures, busy_fraction=e.busy_s / window, idle_fraction=e.idle_s / window,
                              idle_while_queued_fraction=e.idle_while_queued_s / window)
                for e in self.engines], window
