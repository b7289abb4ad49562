"""The LLMProxy's fleet changes: an engine joins (rollout/fleet.py admitted it after a full push and
the probe) or leaves (deregistered, preempted, or lost after failed probes).

A leaving engine is first taken out of the slots, so nothing new goes to it; then each request it
was serving has its engine call cancelled and goes, with the same rid, to another engine (the proxy's
exactly-once retry, counted as `reissued`), and the leaving engine gets an `/abort_request` for it in
case it still runs. Its caller sees one result, from the engine that finished it; the sample's
version bookkeeping is the scheduler's, unchanged by where it ran. A group's staleness bound is
therefore the same as for a request that was retried after an engine failure.

Nothing here blocks: both calls run on the proxy's event loop (the runtime posts them there).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, List, Optional

from megatron_flash.engines.client import EngineClient

if TYPE_CHECKING:
    from megatron_flash.rollout.slots import EngineState

logger = logging.getLogger(__name__)


class FleetOps:
    """Mixed into LLMProxy (its `_slots`, `_engines`, `_calls`, `_evicted`, `_tracks` live there)."""

    def add_engine(self: Any, url: str, *, api_key: Optional[str] = None, request_timeout_s: float = 600.0,
                   healthy: bool = True) -> "EngineState":
        """Route to the engine at `url` from now on (healthy: it holds the fleet's weights now)."""
        url = url.rstrip("/")
        if url in self.urls:
            raise ValueError(f"add_engine: {url} is already one of this proxy's engines")
        client = EngineClient(url, api_key=api_key, request_timeout_s=request_timeout_s)
        if self.names_adapters and self._fleet_weight_version is not None:
            from megatron_flash.engines.client_replies import lora_adapter_name

            client.lora_name = lora_adapter_name(self._fleet_weight_version)
        engine = self._slots.add(client, healthy=healthy)
        self._tracks[id(engine)] = f"{self._trace_name} {self._next_track}"
        self._next_track += 1
        self.max_attempts = max(self.max_attempts, 2 * len(self._engines))
        logger.info("engine %s joined the fleet (%d engines)", url, len(self._engines))
        return engine

    def remove_engine(self: Any, url: str, why: str) -> int:
        """Take the engine at `url` out of the fleet for good and re-issue what it was serving; returns
        how many requests were re-issued. Unknown URLs: 0 (it may have left already)."""
        engine = next((e for e in self._engines if e.client.url == url.rstrip("/")), None)
        if engine is None:
            return 0
        self._slots.remove(engine)
        moved: List[str] = []
        for rid in list(engine.rids):
            task = self._calls.get(rid)
            if task is not None and not task.done():
                self._evicted.add(rid)
                task.cancel()
                moved.append(rid)
        logger.warning("engine %s left the fleet (%s); %d request(s) re-issued to the %d engine(s) left",
                       url, why, len(moved), len(self._engines))
        self._removed.append(engine)  # its client stays open for the aborts; closed with the proxy
        return len(moved)

    def _evicted_now(self: Any, rid: str, task: "asyncio.Future[Any]") -> bool:
        """Was `rid`'s call cancelled because its engine left (and not because our caller gave up)?"""
        if rid not in self._evicted:
            return False
        self._evicted.discard(rid)
        me = asyncio.current_task()
        return task.cancelled() and not getattr(me, "cancelling", lambda: 0)()

    def set_min_engines(self: Any, n: int) -> None:
        """engines.min_engines: below it no request is dispatched, and `fleet_short` starts its clock."""
        self._slots.min_engines = n
        self._short_since: Optional[float] = None

    def fleet_short(self: Any, now: float, deadline_s: float) -> Optional[str]:
        """The line that stops the run when fewer than engines.min_engines engines have been healthy for
        longer than `deadline_s` (monotonic `now`); None otherwise. Called on the scheduler's tick."""
        need = self._slots.min_engines
        healthy = sum(e.healthy for e in self._engines)
        if healthy >= need or need <= 1:  # one engine short of 1 is the request deadline's case
            self._short_since = None
            return None
        since = getattr(self, "_short_since", None)
        if since is None:
            self._short_since = now
            logger.warning("fleet below engines.min_engines=%d (%d healthy): rollout waits for engines", need, healthy)
            return None
        if now - since <= deadline_s:
            return None
        out = "; ".join(f"{e.client.url}: {e.unhealthy_reason or 'healthy'}" for e in self._engines) or "none left"
        return (f"the rollout fleet stayed below engines.min_engines={need} for {deadline_s:.0f} s "
                f"(engines.down_timeout_s): {healthy} healthy of {len(self._engines)} ({out})")

    def fleet_size(self: Any) -> tuple[int, int]:
        """(engines in the fleet, of them healthy now)."""
        return len(self._engines), sum(e.healthy for e in self._engines)
