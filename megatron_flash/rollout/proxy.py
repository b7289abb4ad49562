"""LLMProxy: one asyncio entry point in front of N engine servers (ROLL Flash's LLMProxy).

    callers ──generate()──► FIFO queue ──(a slot frees)──► least-loaded healthy engine
                                 ▲                               │ EngineUnreachable
                                 └──────── retry, same rid ◄─────┘ (engine marked unhealthy)
    health task: every health_check_interval_s, probe unhealthy engines; re-admit on /health 200
                 (and, after a weight update they missed, only if their weight_version matches)

Queue scheduling (rollout/slots.py): each engine holds at most ``max_inflight_per_engine`` requests;
the rest wait in one FIFO queue and the moment a slot frees (a request finishes, an engine is
re-admitted, generation continues after a pause) the oldest waiter is handed that slot directly, so a
later arrival never overtakes it. Among engines with a free slot the one with the fewest in-flight
requests wins; ties rotate.

Parallel sampling: ``generate_n`` sends one request with SGLang's ``sampling_params.n`` to one engine and
holds min(n, max_inflight_per_engine) of its slots (it queues like any request, FIFO, until one engine has
that many free). Use it when prompt replication is off; replication spreads n requests over engines instead.

Exactly once: a request whose engine dies under it (connection refused/reset, server gone, timeout,
HTTP 502/503/504) is re-dispatched with the same rid to another engine, up to ``max_attempts``
engines in all; its caller sees one result. A request aborted on purpose (``abort``/``abort_all``)
is never retried: it returns ``finish_reason == "abort"`` (synthetic when it never reached an engine
or its engine died after the abort). Other errors (HTTP 4xx/500, malformed replies) propagate: they
would repeat on every engine.

Control calls (pause/continue/abort_all/flush_cache) fan out to every healthy engine
and gather results; if any engine fails, ``EngineFanOutError`` names each failed engine.

Metrics (``metrics()``, over the window since construction or ``reset_metrics()``): per engine its
busy, idle and idle-while-queued fractions, in-flight counts, completions, failures and health
(defined in rollout/slots.py); proxy-wide the queue length, completions, retries and aborts. Every
dispatch → reply interval also goes to ``trace.ACTIVITY`` and, with logging.trace, to the run's
timeline (rollout/request_trace.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar

from megatron_flash.engines.client import (EngineClient, EngineError, EngineHTTPError,
                                                  EngineTimeout, EngineUnreachable, GenerateResult)
from megatron_flash.engines.client_replies import lora_adapter_name, parse_input_logprobs, parse_input_top_logprobs
from megatron_flash.rollout.proxy_fleet import FleetOps
from megatron_flash.rollout.request_trace import RequestWatch
from megatron_flash.rollout.slots import EngineMetrics, EngineSlots, EngineState, ProxyMetrics

__all__ = ["EngineFanOutError", "EngineMetrics", "LLMProxy", "N_ABORT_GRACE_S", "ProxyMetrics"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
_UNAVAILABLE_STATUSES = (502, 503, 504)
N_ABORT_GRACE_S = 2.0
"""How long ``abort`` waits for an n > 1 request to end on its engine before closing its connection."""


class EngineFanOutError(RuntimeError):
    """A fanned-out control call failed on some engines; ``errors`` maps URL → error."""

    def __init__(self, op: str, *, num_targets: int, results: Dict[str, Any],
                 errors: Dict[str, BaseException], detail: str = "") -> None:
        self.op = op
        self.results = results
        self.errors = errors
        lines = [f"{op} failed on {len(errors)} of {num_targets} engines" + (f": {detail}" if detail else "")]
        lines += [f"  {url}: {err}" for url, err in errors.items()]
        super().__init__("\n".join(lines))


class LLMProxy(FleetOps):
    """Route generate() over engines; see the module docstring for the policy.

    The proxy owns its clients (``close()`` closes them). Use ``async with LLMProxy(...)`` or call
    ``start()`` (health checker) and ``close()`` yourself inside one event loop.
    """

    def __init__(self, clients: Sequence[EngineClient], *, max_inflight_per_engine: int,
                 health_check_interval_s: float = 2.0, health_check_timeout_s: float = 5.0,
                 max_attempts: Optional[int] = None, trace_name: str = "engine", names_adapters: bool = False) -> None:
        """`trace_name`: its engines' tracks on the run's timeline ("engine 0", ...); only the policy's
        engines ("engine") count as generating for pipeline/overlap (a teacher's scoring does not).
        `names_adapters`: LoRA adapters are pushed by name (weight_sync.lora=adapter); once the fleet
        version is known every request names that version's adapter (engines/client_replies.py)."""
        if not clients:
            raise ValueError("LLMProxy needs at least one engine client, got none")
        if max_inflight_per_engine < 1:
            raise ValueError(f"max_inflight_per_engine must be >= 1, got {max_inflight_per_engine}")
        urls = [c.url for c in clients]
        if len(set(urls)) != len(urls):
            raise ValueError(f"engine urls must be distinct, got {urls}")
        self.health_check_interval_s = health_check_interval_s
        self.health_check_timeout_s = health_check_timeout_s
        self.max_attempts = max_attempts or max(3, 2 * len(clients))
        self._slots = EngineSlots(clients, max_inflight_per_engine=max_inflight_per_engine)
        self._engines = self._slots.engines
        self._tracks = {id(e): f"{trace_name} {i}" for i, e in enumerate(self._engines)}
        self._generates = trace_name == "engine"
        self._active: Dict[str, Optional[EngineState]] = {}  # rid → engine now serving it (None: between)
        self._aborted: Set[str] = set()
        self._fleet_weight_version: Optional[str] = None
        self.names_adapters = names_adapters
        self._health_task: Optional[asyncio.Task] = None
        self._background: Set[asyncio.Future] = set()
        self._parallel_calls: Dict[str, asyncio.Future] = {}  # rid → HTTP call of a generate_n in flight
        self._cut: Set[str] = set()  # generate_n rids whose call the proxy cancelled after an abort
        self._calls: Dict[str, asyncio.Future] = {}  # rid → its engine call now in flight
        self._evicted: Set[str] = set()  # rids whose call was cancelled because their engine left
        self._removed: List[EngineState] = []  # engines that left the fleet (their clients closed at close())
        self._trace_name = trace_name
        self._next_track = len(self._engines)
        self._closed = False
        self.reset_metrics()

    @classmethod
    def from_urls(cls, urls: Sequence[str], *, max_inflight_per_engine: int, api_key: Optional[str] = None,
                  request_timeout_s: float = 600.0, **kwargs: Any) -> "LLMProxy":
        clients = [EngineClient(u, api_key=api_key, request_timeout_s=request_timeout_s) for u in urls]
        return cls(clients, max_inflight_per_engine=max_inflight_per_engine, **kwargs)

    @classmethod
    def from_config(cls, config: Any, urls: Sequence[str], **kwargs: Any) -> "LLMProxy":
        """From an ``EngineConfig`` and the URLs the launcher returned."""
        return cls.from_urls(urls, max_inflight_per_engine=config.max_inflight_per_engine,
                             api_key=config.api_key, request_timeout_s=config.request_timeout_s, **kwargs)

    @property
    def urls(self) -> List[str]:
        return [e.client.url for e in self._engines]

    @property
    def max_inflight_per_engine(self) -> int:
        return self._slots.max_inflight_per_engine

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> "LLMProxy":
        self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def start(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def close(self) -> None:
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for e in [*self._engines, *self._removed]:
            await e.client.close()

    # -- generation -----------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       return_logprob: bool = True, rid: Optional[str] = None,
                       return_routed_experts: bool = False) -> GenerateResult:
        """One completion from whichever engine frees a slot first. See the module docstring."""
        rid = rid or uuid.uuid4().hex

        def call(engine: EngineState) -> Awaitable[GenerateResult]:
            return engine.client.generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid,
                                          return_routed_experts=return_routed_experts)

        return await self._serve(rid, call, lambda message: self._aborted_result(rid, message))

    async def generate_n(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], n: int, *,
                         return_logprob: bool = True, rid: Optional[str] = None,
                         return_routed_experts: bool = False) -> List[GenerateResult]:
        """``n`` completions of one prompt as ONE request (SGLang ``sampling_params.n``) on one engine.

        It holds ``min(n, max_inflight_per_engine)`` slots of that engine, so it waits in the FIFO queue
        until one engine has that many free (a later request never overtakes it); an oversized n waits
        for an empty engine. Retries, health and aborts are those of ``generate``; results are in the
        engine's order, rids as the engine gives them (``EngineClient.generate_n``)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        rid = rid or uuid.uuid4().hex

        async def call(engine: EngineState) -> List[GenerateResult]:
            request = asyncio.ensure_future(engine.client.generate_n(
                input_ids, sampling_params, n, return_logprob=return_logprob, rid=rid,
                return_routed_experts=return_routed_experts))
            self._parallel_calls[rid] = request
            try:
                return await request
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if rid not in self._cut or not request.cancelled() or getattr(me, "cancelling", lambda: 0)():
                    raise  # our caller was cancelled
                self._num_aborted += n
                message = (f"aborted by the proxy: the engine did not end it within {N_ABORT_GRACE_S:g}s of "
                           "/abort_request, so the connection was closed (partial output lost)")
                return [GenerateResult(rid=f"{rid}_{i}", output_ids=[], output_logprobs=[], finish_reason="abort",
                                       finish_message=message, engine_url=engine.client.url) for i in range(n)]
            finally:
                self._parallel_calls.pop(rid, None)
                self._cut.discard(rid)

        def aborted(message: str) -> List[GenerateResult]:
            return [self._aborted_result(f"{rid}_{i}", message) for i in range(n)]

        return await self._serve(rid, call, aborted, num_samples=n)

    async def score(self, input_ids: Sequence[int], *, start: int, rid: Optional[str] = None) -> List[float]:
        """Teacher-forced logprobs of `input_ids[start:]` (each token given the ones before it) from
        whichever engine frees a slot first, with generate's retries and health handling (a teacher's
        scoring of a finished response). Raises EngineError when no engine could answer."""
        values, _, _ = await self.score_top(input_ids, start=start, k=0, rid=rid)
        return values

    async def score_top(self, input_ids: Sequence[int], *, start: int, k: int, rid: Optional[str] = None
                        ) -> Tuple[List[float], List[List[int]], List[List[float]]]:
        """`score` plus, with k > 0, the k most likely tokens and their logprobs at each scored
        position (SGLang `top_logprobs_num`): (logprobs, top ids [R][k], top logprobs [R][k])."""
        if not 1 <= start < len(input_ids):
            raise ValueError(f"score: start must be in [1, {len(input_ids) - 1}], got {start}")
        rid = rid or uuid.uuid4().hex
        ids = list(input_ids)

        async def call(engine: EngineState) -> Tuple[List[float], List[List[int]], List[List[float]]]:
            reply = await engine.client.score([ids], logprob_start_len=start - 1, top_logprobs_num=k)
            item = reply[0] if isinstance(reply, list) and len(reply) == 1 else reply
            values = parse_input_logprobs(item, url=engine.client.url, ids=ids, start=start - 1)
            if not k:
                return values, [], []
            top_ids, top_lps = parse_input_top_logprobs(item, url=engine.client.url, ids=ids, start=start - 1, k=k)
            return values, top_ids, top_lps

        def aborted(message: str) -> Tuple[List[float], List[List[int]], List[List[float]]]:
            raise EngineError(self.urls[0] if self.urls else "", "/generate", f"scoring {rid}: {message}")

        return await self._serve(rid, call, aborted)

    async def _serve(self, rid: str, call: Callable[[EngineState], Awaitable[T]], aborted: Callable[[str], T], *,
                     num_samples: int = 1) -> T:
        """Run ``call`` on an engine slot with the exactly-once policy of the module docstring."""
        self.start()
        if rid in self._active:
            raise ValueError(f"rid {rid!r} is already in flight through this proxy")
        slots = min(num_samples, self.max_inflight_per_engine)
        self._active[rid] = None
        attempts: List[str] = []
        queued = time.monotonic_ns()
        try:
            while True:
                if rid in self._aborted:
                    return aborted("aborted; its engine failed before replying")
                engine = await self._slots.acquire(rid, slots)
                if engine is None:
                    return aborted("aborted by the proxy before dispatch")
                if engine not in self._engines:  # it left the fleet between the hand-out and now
                    self._slots.release(engine, failed=False, count=False, slots=slots)
                    continue
                self._active[rid] = engine
                engine.rids.add(rid)
                watch = RequestWatch(self._tracks[id(engine)], rid, num_samples=num_samples,
                                     weight_version=self._fleet_weight_version,
                                     queued_ns=time.monotonic_ns() - queued, activity=self._generates)
                task = asyncio.ensure_future(call(engine))
                self._calls[rid] = task
                try:
                    result = await task
                except asyncio.CancelledError as e:
                    if not self._evicted_now(rid, task):
                        watch.close(error=e)
                        engine.rids.discard(rid)
                        self._slots.release(engine, failed=True, slots=slots)
                        if not self._closed:  # our caller gave up: the engine must stop generating too
                            self._spawn(self._quiet_abort(engine, rid))
                        raise
                    # Its engine left the fleet (engines/fleet): the same rid goes to another engine.
                    watch.close(error=RuntimeError(f"re-issued: {engine.client.url} left the fleet"))
                    engine.rids.discard(rid)
                    self._slots.release(engine, failed=False, count=False, slots=slots)
                    self._spawn(self._quiet_abort(engine, rid))
                    self._active[rid] = None
                    self._reissued += 1
                    continue
                except (EngineUnreachable, EngineHTTPError) as e:
                    watch.close(error=e)
                    engine.rids.discard(rid)
                    lost = isinstance(e, EngineUnreachable) or e.status in _UNAVAILABLE_STATUSES
                    if lost:  # before the release, or the freed slot would go to the dead engine
                        self._mark_unhealthy(engine, e)
                    self._slots.release(engine, failed=True, slots=slots)
                    if not lost:
                        raise
                    if isinstance(e, EngineTimeout):  # it may still be generating: stop it before the same
                        await self._quiet_abort(engine, rid)  # rid is sent again (SGLang refuses a duplicate)
                    attempts.append(engine.client.url)
                    self._active[rid] = None
                    if len(attempts) >= self.max_attempts:
                        raise
                    self._retried += 1
                    logger.warning("request %s lost with %s (%s); retrying on another engine", rid,
                                   engine.client.url, e)
                    continue
                except BaseException as e:
                    watch.close(error=e)
                    engine.rids.discard(rid)
                    self._slots.release(engine, failed=True, slots=slots)
                    raise
                finally:
                    self._calls.pop(rid, None)
                engine.rids.discard(rid)
                self._slots.release(engine, failed=False, slots=slots, num_completed=num_samples)
                watch.close(result)  # with the release: a metrics window counts it iff the trace puts it before
                return result
        finally:
            self._active.pop(rid, None)
            self._aborted.discard(rid)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _aborted_result(self, rid: str, message: str) -> GenerateResult:
        self._num_aborted += 1
        return GenerateResult(rid=rid, output_ids=[], output_logprobs=[], finish_reason="abort",
                              finish_message=message)

    async def _quiet_abort(self, engine: EngineState, rid: str) -> None:
        with contextlib.suppress(EngineError):
            await engine.client.abort(rid, timeout_s=self.health_check_timeout_s)

    async def abort(self, rid: str) -> bool:
        """Abort one request wherever it is; False if the proxy does not know the rid."""
        if rid not in self._active:
            return False
        self._aborted.add(rid)
        if self._slots.withdraw(rid):
            return True
        engine = self._active.get(rid)
        if engine is not None:
            try:
                await engine.client.abort(rid)
            except EngineUnreachable:
                pass  # its engine is gone: the request ends as aborted without a retry
            request = self._parallel_calls.get(rid)
            if request is not None:  # SGLang 0.5.23 ignores the abort of an n > 1 request: see _cut_after_grace
                self._spawn(self._cut_after_grace(rid, request))
        return True

    async def _cut_after_grace(self, rid: str, request: "asyncio.Future[Any]") -> None:
        """SGLang gives the samples of an n > 1 request fresh rids and forgets the request's own, so
        /abort_request {rid} reaches none of them. Closing the connection does: SGLang polls for a
        disconnected client (every SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s) and aborts each sample.
        The local engine ends them on the abort itself and replies well within the grace period."""
        await asyncio.wait({request}, timeout=N_ABORT_GRACE_S)
        if not request.done() and self._parallel_calls.get(rid) is request:
            self._cut.add(rid)
            request.cancel()

    async def abort_all(self) -> Dict[str, Any]:
        """Abort every queued request here and every running one on the engines."""
        self._aborted.update(self._active)
        self._slots.withdraw_all()
        return await self._fan_out("abort_all", lambda c: c.abort_all())

    # -- health ---------------------------------------------------------------------------------
    def _mark_unhealthy(self, engine: EngineState, error: BaseException) -> None:
        if engine.healthy:
            logger.warning("engine %s marked unhealthy: %s", engine.client.url, error)
        self._slots.tick()
        engine.healthy = False
        engine.unhealthy_reason = str(error)

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_check_interval_s)
            sick = [e for e in self._engines if not e.healthy]
            if sick:
                await asyncio.gather(*(self._probe(e) for e in sick))

    async def _probe(self, engine: EngineState) -> None:
        if not await engine.client.is_healthy(timeout_s=self.health_check_timeout_s):
            return
        if self._fleet_weight_version is not None:
            # It missed a weight update while out: serving it now would hand out stale samples.
            try:
                version = await engine.client.get_weight_version(timeout_s=self.health_check_timeout_s)
            except EngineError as e:
                engine.unhealthy_reason = f"healthy again, but its weight version is unknown: {e}"
                return
            if version != self._fleet_weight_version:
                engine.unhealthy_reason = (f"healthy again, but at weight_version {version!r} while the "
                                           f"fleet is at {self._fleet_weight_version!r}: sync it first")
                return
        logger.info("engine %s re-admitted", engine.client.url)
        self._slots.tick()
        engine.healthy = True
        engine.unhealthy_reason = ""
        self._slots.dispatch()

    async def check_health(self) -> None:
        """Probe every engine now; healthy ones that fail are marked unhealthy, others re-admitted."""
        for engine in self._engines:
            if engine.healthy:
                try:
                    await engine.client.health(timeout_s=self.health_check_timeout_s, retries=0)
                except EngineError as e:
                    self._mark_unhealthy(engine, e)
            else:
                await self._probe(engine)

    # -- fan-out --------------------------------------------------------------------------------
    async def _fan_out(self, op: str, call: Callable[[EngineClient], Awaitable[T]],
                       targets: Optional[Sequence[EngineState]] = None) -> Dict[str, T]:
        targets = [e for e in self._engines if e.healthy] if targets is None else list(targets)
        if not targets:
            raise EngineFanOutError(op, num_targets=0, results={}, errors={},
                                    detail="no healthy engine (unhealthy: " + "; ".join(
                                        f"{e.client.url}: {e.unhealthy_reason}" for e in self._engines) + ")")
        outs = await asyncio.gather(*(call(e.client) for e in targets), return_exceptions=True)
        results: Dict[str, T] = {}
        errors: Dict[str, BaseException] = {}
        for engine, out in zip(targets, outs):
            if isinstance(out, BaseException):
                if not isinstance(out, Exception):
                    raise out
                errors[engine.client.url] = out
                engine.failures += 1
                if isinstance(out, EngineUnreachable):
                    self._mark_unhealthy(engine, out)
            else:
                results[engine.client.url] = out
        if errors:
            raise EngineFanOutError(op, num_targets=len(targets), results=results, errors=errors)
        return results

    async def pause_generation(self, mode: str = "abort") -> Dict[str, Any]:
        """Stop dispatching, then pause every engine (abort: running requests return finish abort;
        retract/in_place: they resume after continue_generation)."""
        self._slots.paused = True
        return await self._fan_out("pause_generation", lambda c: c.pause_generation(mode))

    async def continue_generation(self) -> Dict[str, Any]:
        results = await self._fan_out("continue_generation", lambda c: c.continue_generation())
        self._slots.resume()
        return results

    async def flush_cache(self) -> Dict[str, Any]:
        return await self._fan_out("flush_cache", lambda c: c.flush_cache())

    def note_external_sync(self, weight_version: str, *, failed: Mapping[str, str] = {}) -> None:
        """Weights were pushed around the proxy (the trainer's WeightBridge): the fleet is at
        `weight_version` now, and the engines in `failed` (url → why) must stop serving. They stay
        out until they report `weight_version` again (the health loop checks), so an engine with
        partial or old weights never serves samples labelled with the new version."""
        self._note_version(weight_version)
        by_url = {e.client.url: e for e in self._engines}
        for url, why in failed.items():
            engine = by_url.get(url.rstrip("/"))
            if engine is not None:
                self._mark_unhealthy(engine, RuntimeError(f"taken out of service by weight sync: {why}"))

    def take_out(self, url: str, why: str) -> None:
        """Stop routing to the engine at `url` (e.g. its process exited); the health loop re-admits it
        once it answers at the fleet's weight version."""
        by_url = {e.client.url: e for e in self._engines}
        engine = by_url.get(url.rstrip("/"))
        if engine is None:
            raise ValueError(f"take_out: {url!r} is not one of this proxy's engines {sorted(by_url)}")
        self._mark_unhealthy(engine, RuntimeError(why))

    def _note_version(self, weight_version: Optional[str]) -> None:
        if weight_version is not None:
            self._fleet_weight_version = weight_version
            if self.names_adapters:  # from now on requests name the adapter of this version
                for engine in self._engines:
                    engine.client.lora_name = lora_adapter_name(weight_version)

    # -- metrics --------------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        """Start a new metrics window (counts and time fractions; in-flight state is kept)."""
        self._slots.reset_metrics()
        self._retried = self._num_aborted = self._reissued = 0

    def metrics(self) -> ProxyMetrics:
        engines, window = self._slots.engine_metrics()
        return ProxyMetrics(engines=engines, queue_len=len(self._slots.waiters), completed=self._slots.num_completed,
                            retried=self._retried, aborted=self._num_aborted, window_s=window,
                            reissued=self._reissued)
