"""A fake engine speaking SGLang 0.5.23's native JSON, for unit tests of the client and the proxy.

It is an aiohttp app served on 127.0.0.1 in the test's own event loop. It records every request,
answers /generate after a configurable latency (abortable through /abort_request), can fail chosen
endpoints with a status, and can die (stop listening and drop every connection, in flight or idle)
and come back on the same port. Not a model: output_ids are 100, 101, ... and logprobs -0.5 each.

Parallel sampling (`sampling_params.n` > 1) answers a list of n replies and counts n in flight. By
default it behaves like SGLang 0.5.23: each sample gets a fresh uuid rid and /abort_request with the
request's rid does nothing (`parallel_abort_by_rid=True` makes it end all n, as the local engine does,
with rids "{rid}_{i}"). `disconnected` lists rids whose client closed the connection before the reply.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable, Dict, List, Optional, Union

from aiohttp import web

Latency = Union[float, Callable[[Dict[str, Any]], float]]


class FakeEngine:
    def __init__(self, *, latency_s: Latency = 0.0, weight_version: str = "0",
                 api_key: Optional[str] = None, session_endpoints: bool = True,
                 parallel_abort_by_rid: bool = False) -> None:
        self.latency_s = latency_s
        self.weight_version = weight_version
        self.api_key = api_key
        self.session_endpoints = session_endpoints
        self.parallel_abort_by_rid = parallel_abort_by_rid
        self.requests: List[Dict[str, Any]] = []  # {"path", "body", "auth"}
        self.completed: List[str] = []  # rids answered with a finished, non-abort reply
        self.aborted: List[str] = []
        self.disconnected: List[str] = []
        self.started: List[str] = []  # rids in arrival order
        self.inflight = 0
        self.max_inflight = 0
        self.fail: Dict[str, int] = {}  # path → HTTP status to answer
        self.fail_count: Dict[str, int] = {}  # path → answer `fail` this many times, then succeed
        self.mutate_reply: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
        self.dead = False
        self.session_open = False
        self.url = ""
        self._abort_events: Dict[str, asyncio.Event] = {}
        self._parallel: set = set()  # rids of n > 1 requests in flight
        self._transports: set = set()
        self._runner: Optional[web.AppRunner] = None
        self._site: Optional[web.TCPSite] = None
        self._port = 0

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await self._listen(0)
        return self.url

    async def _listen(self, port: int) -> None:
        self._site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True, shutdown_timeout=0.1)
        await self._site.start()
        self._port = self._site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self._port}"

    async def die(self) -> None:
        """Stop listening and drop every open connection (what a crashed server looks like)."""
        self.dead = True
        await self._site.stop()
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()

    async def revive(self) -> None:
        self.dead = False
        await self._listen(self._port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def paths(self) -> List[str]:
        return [r["path"] for r in self.requests]

    # -- handlers ---------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if self.dead:
            transport.abort()
            return web.Response(status=503)
        self._transports.add(transport)
        body = await request.json() if request.can_read_body else None
        path = request.path
        self.requests.append({"path": path, "body": body, "auth": request.headers.get("Authorization")})
        if self.api_key and path != "/health" and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if path in self.fail:
            left = self.fail_count.get(path)
            if left is None or left > 0:
                if left is not None:
                    self.fail_count[path] = left - 1
                return web.json_response({"error": {"message": f"injected failure on {path}"}},
                                         status=self.fail[path])
        handler = getattr(self, "_" + path.strip("/"), None)
        if handler is None or (path in ("/begin_weight_update", "/end_weight_update")
                               and not self.session_endpoints):
            return web.json_response({"detail": "Not Found"}, status=404)
        return await handler(body)

    async def _generate(self, body: Dict[str, Any]) -> web.StreamResponse:
        rid = body["rid"]
        num_samples = int((body.get("sampling_params") or {}).get("n") or 1)
        self.started.append(rid)
        self.inflight += num_samples
        self.max_inflight = max(self.max_inflight, self.inflight)
        event = self._abort_events[rid] = asyncio.Event()
        if num_samples > 1:
            self._parallel.add(rid)
        try:
            latency = self.latency_s(body) if callable(self.latency_s) else self.latency_s
            try:
                await asyncio.wait_for(event.wait(), latency)
                aborted = True
            except asyncio.TimeoutError:
                aborted = False
            if self.dead:
                return web.Response(status=503)
            if num_samples == 1:
                reply: Any = self._reply(body, rid, aborted)
            else:
                reply = [self._reply(body, f"{rid}_{i}" if self.parallel_abort_by_rid else uuid.uuid4().hex, aborted)
                         for i in range(num_samples)]
            (self.aborted if aborted else self.completed).append(rid)
            return web.json_response(reply)
        except asyncio.CancelledError:  # the client closed the connection
            self.disconnected.append(rid)
            raise
        finally:
            self.inflight -= num_samples
            self._abort_events.pop(rid, None)
            self._parallel.discard(rid)

    def _reply(self, body: Dict[str, Any], rid: str, aborted: bool) -> Dict[str, Any]:
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 3))
        ids = [100 + i for i in range(1 if aborted else n)]
        finish = ({"type": "abort", "message": "Abort in running batch", "status_code": None,
                   "err_type": None} if aborted else {"type": "length", "length": n})
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "weight_version": self.weight_version, "num_retractions": 0, "reasoning_tokens": 0,
                "completion_tokens": len(ids), "cached_tokens": 0}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in ids]
        reply = {"text": "x" * len(ids), "output_ids": ids, "meta_info": meta}
        if self.mutate_reply is not None:
            reply = self.mutate_reply(reply)
        return reply

    async def _abort_request(self, body: Dict[str, Any]) -> web.StreamResponse:
        targets = list(self._abort_events) if body.get("abort_all") else [body.get("rid")]
        if not body.get("abort_all") and not self.parallel_abort_by_rid:
            targets = [rid for rid in targets if rid not in self._parallel]  # SGLang 0.5.23 forgets that rid
        for rid in targets:
            if rid in self._abort_events:
                self._abort_events[rid].set()
        return web.Response(status=200)

    async def _health(self, body: Any) -> web.StreamResponse:
        return web.Response(status=200)

    async def _model_info(self, body: Any) -> web.StreamResponse:
        return web.json_response({"model_path": "fake", "is_generation": True,
                                  "weight_version": self.weight_version})

    async def _flush_cache(self, body: Any) -> web.StreamResponse:
        return web.Response(text="Cache flushed.\n")

    async def _pause_generation(self, body: Dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, body: Any) -> web.StreamResponse:
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _begin_weight_update(self, body: Any) -> web.StreamResponse:
        if self.session_open:
            return self._result(False, "a weight-update session is already open")
        self.session_open = True
        return self._result(True, "Success")

    async def _end_weight_update(self, body: Any) -> web.StreamResponse:
        if not self.session_open:
            return self._result(False, "no weight-update session is open")
        self.session_open = False
        return self._result(True, "Success")

    async def _update_weights_from_tensor(self, body: Dict[str, Any]) -> web.StreamResponse:
        return self._update(body, "update_weights_from_tensor")

    async def _update_weights_from_distributed(self, body: Dict[str, Any]) -> web.StreamResponse:
        return self._update(body, "update_weights_from_distributed")

    async def _update_weights_from_disk(self, body: Dict[str, Any]) -> web.StreamResponse:
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def _init_weights_update_group(self, body: Dict[str, Any]) -> web.StreamResponse:
        return self._result(True, "Succeeded to initialize custom process group.")

    def _update(self, body: Dict[str, Any], name: str) -> web.StreamResponse:
        if self.session_endpoints and not self.session_open:
            return self._result(False, f"{name} must run between begin_weight_update() and "
                                       "end_weight_update()")
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return self._result(True, "Success")

    @staticmethod
    def _result(success: bool, message: str) -> web.StreamResponse:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)
